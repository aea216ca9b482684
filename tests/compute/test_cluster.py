"""The cluster the stages compute on: loopback only, token authentication, pools as node labels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from forge_core.compute.cluster import (
    AUTH_MODE_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    Listener,
    listeners_beyond_loopback,
)
from tests.ray_cluster import POOL, POOL_NODES

pytestmark = pytest.mark.integration


def test_no_ray_port_listens_beyond_loopback(ray_cluster):
    pids = ray_cluster.pids()
    from forge_core.compute.cluster import listeners

    found = listeners(pids)
    processes = {listener.process for listener in found}
    assert {"gcs_server", "raylet"} <= processes, f"the check saw no Ray server among {processes}"
    assert listeners_beyond_loopback(pids) == []


def test_the_loopback_check_tells_every_interface_from_loopback():
    def listener(address: str) -> Listener:
        return Listener(address, 1, 1, "x")

    assert listener("127.0.0.1").loopback and listener("::1").loopback
    assert listener("::ffff:127.0.0.1").loopback
    assert not listener("0.0.0.0").loopback and not listener("::").loopback
    assert not listener("192.0.2.2").loopback


def test_pools_are_node_labels(ray_cluster):
    nodes = ray_cluster.compute.pool_nodes(POOL)
    assert len(nodes) >= POOL_NODES and all(node.gpus == 1 for node in nodes)
    assert all(node.address == "127.0.0.1" for node in ray_cluster.compute.nodes())
    assert "no live node is labelled forgeflow.pool=gpu-z" in ray_cluster.compute.describe_pool("gpu-z")


CLIENT = textwrap.dedent(
    """
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
        print("connected", ray.cluster_resources().get("GPU"))
    except Exception as exc:
        print("refused", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        sys.exit(3)
    """
)


@pytest.mark.parametrize(
    "auth", [{AUTH_MODE_ENV: "token", TOKEN_ENV: "0" * 64}, {AUTH_MODE_ENV: "disabled"}], ids=["wrong", "none"]
)
def test_a_client_without_the_token_cannot_join(ray_cluster, auth):
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_PATH_ENV, TOKEN_ENV, AUTH_MODE_ENV)}
    env.update(auth, RAY_NUM_REDIS_GET_RETRIES="2")  # Ray's own connection retries, once a second
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, ray_cluster.compute.address], env=env, capture_output=True, text=True,
        timeout=180, check=False,
    )
    assert out.returncode == 3, out.stdout + out.stderr[-2000:]
    assert "refused" in out.stdout


def test_a_client_with_the_token_joins(ray_cluster):
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_PATH_ENV, TOKEN_ENV)}
    env.update({AUTH_MODE_ENV: "token", TOKEN_ENV: ray_cluster.token_path.read_text()})
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, ray_cluster.compute.address], env=env, capture_output=True, text=True,
        timeout=180, check=False,
    )
    assert out.returncode == 0 and "connected" in out.stdout, out.stdout + out.stderr[-2000:]


def test_the_embedded_token_is_private_and_a_shared_folder_is_refused(tmp_path):
    from forge_core.compute.cluster import private_token_file

    token = private_token_file(tmp_path / "mine")
    assert token.stat().st_mode & 0o777 == 0o600 and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
    assert len(token.read_text()) == 64
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match="lets other users reach"):
        private_token_file(shared)


EMBEDDED = textwrap.dedent(
    """
    from forge_core.compute.cluster import connect
    cluster = connect(None)
    print("embedded", cluster.embedded, cluster.address)
    cluster.close()
    """
)


def test_the_embedded_cluster_is_a_new_one_while_another_runs_on_this_machine(ray_cluster):
    """With no address Ray itself would join the newest cluster started on the machine (here the tests' one):
    the embedded start makes a cluster of its own."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_PATH_ENV, TOKEN_ENV, AUTH_MODE_ENV, "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", EMBEDDED], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("embedded ")]
    _, embedded, address = line.split()
    assert embedded == "True" and address != ray_cluster.compute.address, (line, ray_cluster.compute.address)


JOINED_THEN_EMBEDDED = textwrap.dedent(
    """
    import sys
    from forge_core.compute.cluster import connect
    joined = connect(sys.argv[1])
    joined.close()
    cluster = connect(None)
    print("embedded", cluster.embedded, cluster.address)
    cluster.close()
    """
)


def test_a_process_that_left_a_cluster_starts_the_embedded_one_with_its_own_token(ray_cluster):
    """Joining caches the cluster's token in Ray's token loader; the embedded start's fresh token must replace
    it, or the new cluster refuses its own driver."""
    out = subprocess.run(
        [sys.executable, "-c", JOINED_THEN_EMBEDDED, ray_cluster.compute.address],
        env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("embedded ")]
    _, embedded, address = line.split()
    assert embedded == "True" and address != ray_cluster.compute.address, (line, ray_cluster.compute.address)


STARTED_ON_A_THREAD_THAT_ENDS = textwrap.dedent(
    """
    import threading
    import ray
    from forge_core.compute.cluster import connect
    clusters = []
    starter = threading.Thread(target=lambda: clusters.append(connect(None)))
    starter.start()
    starter.join()

    @ray.remote
    def ping():
        return "pong"

    print("answer", ray.get(ping.remote(), timeout=120))
    clusters[0].close()
    """
)


def test_the_embedded_cluster_outlives_the_thread_that_started_it():
    """A flow starts its embedded cluster from whichever thread first needs it (a stage's own thread when the
    first stage to run is an in-process rollout); Ray's head processes die with the thread that forked them
    (Linux's parent-death signal follows the thread), so the cluster must not be forked from that thread."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_PATH_ENV, TOKEN_ENV, AUTH_MODE_ENV, "RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", STARTED_ON_A_THREAD_THAT_ENDS], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "answer pong" in out.stdout.splitlines(), out.stdout
