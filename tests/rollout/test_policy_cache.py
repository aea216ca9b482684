"""The bounded policy cache (forge_core.artifacts.policy): least recently used folders go, a folder in use by
another process (a stage or an engine service holding its lease) never does. Real store, real processes."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from forge_core.artifacts.policy import (
    MAX_POLICIES_ENV,
    CacheBounds,
    _download,
    fetch_policy,
    policy_uri,
    prune_policy_cache,
    release_policy,
)
from forge_core.storage import ObjectStore

WEIGHT_BYTES = 1000


def commit_policies(store: ObjectStore, count: int) -> list[str]:
    """`count` committed sft artifacts, each with its own (tiny) policy/ export."""
    uris = []
    for n in range(count):
        stage_uri = store.artifact_uri("sft", f"policy-{n}")
        policy = store.writer(store.join(stage_uri, "policy"), kind="policy", stage="sft")
        policy.write_bytes("model.safetensors", bytes([n]) * WEIGHT_BYTES)
        policy.write_bytes("config.json", b"{}")
        policy.commit(config={}, inputs={}, metrics={})
        stage = store.writer(stage_uri, kind="sft", stage="sft")
        stage.write_json("train_summary.json", {})
        stage.commit(config={}, inputs={}, metrics={})
        uris.append(stage_uri)
    return uris


def cached(cache) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")}


HOLDER = textwrap.dedent(
    """
    import sys
    from forge_core.artifacts.policy import fetch_policy
    from forge_core.storage import ObjectStore
    policy = fetch_policy(ObjectStore(sys.argv[1]), sys.argv[2], cache_root=__import__("pathlib").Path(sys.argv[3]))
    print(policy.local_dir.name, flush=True)
    sys.stdin.read()  # in use until the test closes our stdin
    """
)


def test_the_cache_keeps_its_bound_and_never_removes_a_policy_in_use(tmp_path, monkeypatch):
    store = ObjectStore(f"file://{tmp_path}/store")
    uris = commit_policies(store, 4)
    cache = tmp_path / "cache"
    monkeypatch.setenv(MAX_POLICIES_ENV, "2")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store.root, uris[0], str(cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        in_use = holder.stdout.readline().decode().strip()  # policy 0, leased by another process
        assert in_use, "the holder process did not fetch its policy"
        names = [in_use]
        for uri in uris[1:]:
            policy = fetch_policy(store, uri, cache_root=cache)
            names.append(policy.local_dir.name)
            release_policy(policy)  # this stage is done with it
        # Over the bound of 2: the least recently used unused folders went; the one in use stayed.
        assert cached(cache) == {in_use, names[3]}
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # Its user gone, policy 0 is the least recently used folder: fetching policy 1 again removes it.
    release_policy(fetch_policy(store, uris[1], cache_root=cache))
    assert cached(cache) == {names[3], names[1]}


def test_a_fetch_of_a_policy_another_process_is_downloading_waits_and_reads_that_copy(tmp_path):
    """Two engines of one machine fetch the same policy: the second waits for the first's download and uses its
    folder, never replacing it under the first's reader."""
    store = ObjectStore(f"file://{tmp_path}/store")
    [uri] = commit_policies(store, 1)
    cache = tmp_path / "cache"
    first = fetch_policy(store, uri, cache_root=cache)
    local_dir = first.local_dir  # where the policy's copy goes
    release_policy(first)
    shutil.rmtree(local_dir)  # as before anyone fetched it
    turn = os.open(local_dir.with_name(local_dir.name + ".fetch"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(turn, fcntl.LOCK_EX)  # another process is downloading it
    fetched = {}
    second = threading.Thread(target=lambda: fetched.update(policy=fetch_policy(store, uri, cache_root=cache)))
    second.start()
    second.join(1.0)
    assert second.is_alive(), "the second fetch did not wait for the download under way"
    _download(store, policy_uri(store, uri), local_dir, "policy")  # that process's copy, complete
    first_copy = local_dir.stat().st_ino
    os.close(turn)
    second.join(60)
    assert fetched["policy"].local_dir == local_dir and (local_dir / "config.json").is_file()
    assert local_dir.stat().st_ino == first_copy, "the second fetch replaced the first's copy"
    release_policy(fetched["policy"])


def test_the_byte_bound_and_a_bad_setting(tmp_path, monkeypatch):
    store = ObjectStore(f"file://{tmp_path}/store")
    cache = tmp_path / "cache"
    names = []
    for uri in commit_policies(store, 3):
        policy = fetch_policy(store, uri, cache_root=cache)
        names.append(policy.local_dir.name)
        release_policy(policy)
    removed = prune_policy_cache(cache, CacheBounds(max_policies=10, max_bytes=2 * WEIGHT_BYTES + 500))
    assert [p.name for p in removed] == names[:1] and cached(cache) == set(names[1:])
    monkeypatch.setenv(MAX_POLICIES_ENV, "zero")
    with pytest.raises(ValueError, match=rf"{MAX_POLICIES_ENV}='zero': must be a int > 0"):
        CacheBounds.from_environment()


def test_the_cache_lives_under_the_run_folder_unless_moved(monkeypatch, tmp_path):
    """`make clean` removes .forge-runs: the stages pass logging.dir, so their cached policies go with it."""
    from forge_core.artifacts.policy import CACHE_ENV, policy_cache_root

    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert policy_cache_root("./.forge-runs") == __import__("pathlib").Path(".forge-runs/policy-cache")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert policy_cache_root("./.forge-runs") == tmp_path / "elsewhere"
