"""Checkpoints and models load without running pickled code from storage.

A tampered checkpoint (its manifest re-committed, as someone with write access to the bucket could) must be
refused before anything in it runs. The control shows each payload does run through torch's plain reader.
"""

from __future__ import annotations

import ast
import contextlib
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from forge_core.engine import Checkpointer
from forge_core.engine.checkpoint import ModelState
from forge_core.engine.distributed import DistContext
from forge_core.engine.safe_dcp import SafeFsspecReader, SafeLoadPlanner, UnsafeCheckpoint
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates `marker`: a harmless stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _checkpointer(store: ObjectStore) -> Checkpointer:
    world_of_one = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return Checkpointer(
        store, store.artifact_uri("sft", "run"), world_of_one, stage="sft", config={}, inputs={}
    )


def _recommit(store: ObjectStore, uri: str) -> None:
    """What an attacker with bucket access does after editing files: drop the manifest and commit anew (the
    edited files stay where they are: under the committed attempt's prefix)."""
    attempt = store.read_manifest(uri).attempt
    os.remove(store.local_path(store.manifest_uri(uri)))
    writer = store.writer(uri, kind="checkpoint", stage="sft", attempt=attempt)
    writer.adopt_existing()
    writer.commit(config={}, inputs={}, metrics={"step": 1})


def test_a_real_checkpoint_round_trips_through_the_safe_reader(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    checkpointer = _checkpointer(store)
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    checkpointer.save(1, {"model": ModelState(saved)}, {"sampler": {"epoch": 2}})
    loaded = torch.nn.Linear(4, 3)
    resume = checkpointer.load_latest({"model": ModelState(loaded)})
    assert resume.step == 1 and resume.data_cursor == {"sampler": {"epoch": 2}}
    assert torch.equal(loaded.weight, saved.weight)


def test_tampered_metadata_is_refused_before_its_code_runs(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    checkpointer = _checkpointer(store)
    checkpointer.save(1, {"model": ModelState(torch.nn.Linear(4, 3))}, {})
    (ref,) = [
        c
        for c in __import__("forge_core.engine", fromlist=["x"]).committed_checkpoints(
            store, checkpointer.output_uri
        )
    ]
    metadata = Path(store.local_path(store.reader(ref.uri).file_uri(".metadata")))
    marker = tmp_path / "code-ran"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    _recommit(store, ref.uri)

    with pytest.raises(UnsafeCheckpoint, match=r"pathlib\.Path\.touch"):
        checkpointer.load_latest({"model": ModelState(torch.nn.Linear(4, 3))})
    assert not marker.exists()

    with contextlib.suppress(Exception):  # control: torch's own reader runs the payload (then chokes)
        FsspecReader(store.reader(ref.uri).files_uri).read_metadata()
    assert marker.exists()


def test_a_pickled_object_among_checkpoint_values_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    path = f"file://{tmp_path}/ckpt"
    dcp.save({"weight": torch.ones(2), "extra": _Payload(marker)}, storage_writer=FsspecWriter(path))
    state = {"weight": torch.zeros(2), "extra": None}

    # DCP reports a rank's failure as a CheckpointException carrying that rank's traceback.
    with pytest.raises(CheckpointException, match=r"UnsafeCheckpoint: .*refusing it \(Unsupported global"):
        dcp.load(state, storage_reader=SafeFsspecReader(path), planner=SafeLoadPlanner())
    assert not marker.exists()

    dcp.load(state, storage_reader=FsspecReader(path))  # control: the default planner runs it
    assert marker.exists()


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(func: ast.AST) -> str:
    return ast.unparse(func)


def test_no_code_path_unpickles_storage_data():
    """Source audit of forge_core, tasks and flows: torch.load only with weights_only=True; DCP read only
    through SafeFsspecReader + SafeLoadPlanner; pickle only where the bytes never came from storage."""
    allowed_pickle = {("forge_core/rollout/pool.py", "pickle.loads")}  # round-trip of our own exception
    problems = []
    for folder in ("forge_core", "tasks", "flows"):
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel == "forge_core/engine/safe_dcp.py":
                continue
            for call in _calls(ast.parse(path.read_text())):
                name = _name(call.func)
                if name == "torch.load" and not any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in call.keywords
                ):
                    problems.append(f"{rel}:{call.lineno}: torch.load without weights_only=True")
                if name.startswith("pickle.load") and (rel, name) not in allowed_pickle:
                    problems.append(f"{rel}:{call.lineno}: {name}")
                if name.endswith(("FsspecReader", "FileSystemReader")) and name != "SafeFsspecReader":
                    problems.append(f"{rel}:{call.lineno}: {name} (use forge_core.engine.safe_dcp)")
                if name.endswith("dcp.load") and not any(k.arg == "planner" for k in call.keywords):
                    problems.append(f"{rel}:{call.lineno}: dcp.load without planner=SafeLoadPlanner()")
    assert problems == []
