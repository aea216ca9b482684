"""Loading DCP checkpoints from storage without running pickled code.

torch's DCP reader unpickles the `.metadata` file and every non-tensor value with plain pickle, so a crafted
checkpoint in storage could run code (the manifest's sha256 does not help: whoever can rewrite a checkpoint
can rewrite its manifest). `SafeFsspecReader` reads `.metadata` with an unpickler that only builds DCP's
metadata classes and torch sizes, dtypes, layouts and memory formats; `SafeLoadPlanner` loads non-tensor
values with `torch.load(weights_only=True)` plus the numpy types an RNG state holds. Anything else raises
`UnsafeCheckpoint`.

    reader = SafeFsspecReader(store.fsspec_path(uri), **store.storage_options)
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file asked to build an object that is not plain checkpoint data (a code-execution
    attempt, or a checkpoint written by a different tool): it is not loaded."""


def _torch_globals() -> dict[str, object]:
    """torch names DCP metadata may reference: Size, every dtype, layout and memory format."""
    allowed: dict[str, object] = {"Size": torch.Size}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[name] = value
    return allowed


def _metadata_globals() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        # torch pickles layouts through this helper (it returns a torch.layout by name).
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }
    for name, value in vars(dcp_metadata).items():
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, name)] = value
    allowed.update({("torch", name): value for name, value in _torch_globals().items()})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    _allowed = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpoint(
                f"checkpoint {METADATA_FILE} references {module}.{name}, which is not checkpoint metadata; "
                "refusing to unpickle it (the file may have been tampered with)"
            ) from None


def load_metadata(stream) -> dcp_metadata.Metadata:
    """Unpickle a DCP `.metadata` stream, allowing only metadata classes (UnsafeCheckpoint otherwise)."""
    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpoint(
            f"checkpoint {METADATA_FILE} holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class SafeFsspecReader(FsspecReader):
    """FsspecReader whose `.metadata` is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
            metadata = load_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# What an RNG state (forge_core.engine.rng) holds besides builtins: numpy's MT19937 state array.
_NUMPY_GLOBALS = [
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
    getattr(np, "_core", np.core).multiarray._reconstruct,
]


def safe_torch_load(value: io.BytesIO) -> Any:
    """torch.load of a non-tensor checkpoint value with `weights_only=True` (UnsafeCheckpoint if refused)."""
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is long (how to load it anyway); keep the line naming what was refused.
        refused = re.search(r"Unsupported global: [^\n]*", str(exc))
        raise UnsafeCheckpoint(
            "a checkpoint value needs more than plain data to load, refusing it "
            f"({refused.group(0) if refused else exc})"
        ) from exc


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are loaded with `safe_torch_load`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = safe_torch_load(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
