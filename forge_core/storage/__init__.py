"""forgeflow's artifact store: fsspec object storage (file://, s3://, memory://) with manifest commits.

from forge_core.storage import ObjectStore, content_key, code_version
store = ObjectStore.from_config(cfg.storage)
uri = store.artifact_uri("data", content_key("prepare", cfg_dict, {}, code_version()))
if not store.is_committed(uri):
    w = store.writer(uri, kind="data", stage="prepare")
    w.write_table("sft.parquet", table)
    w.commit(config=cfg_dict, inputs={}, metrics={})
table = store.reader(uri).read_table("sft.parquet")
"""

from forge_core.storage.errors import (
    ArtifactAlreadyCommitted,
    ArtifactCorrupted,
    ArtifactError,
    ArtifactNotCommitted,
    LeaseLost,
    PointerConflict,
    StorageAccessError,
    StorageError,
    StorageUnavailable,
)
from forge_core.storage.keys import canonical_json, code_version, content_key, source_tree_hash
from forge_core.storage.lease import Lease, acquire_lease
from forge_core.storage.manifest import (
    ATTEMPTS_DIR,
    CHECKPOINTS_DIR,
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    InputRef,
    Manifest,
    new_attempt_id,
)
from forge_core.storage.reader import ArtifactReader
from forge_core.storage.retry import Retrier, is_transient
from forge_core.storage.store import ObjectStore, PointerState, endpoint_from_env
from forge_core.storage.uris import normalize_root_uri, safe_join
from forge_core.storage.writer import ArtifactWriter

__all__ = [
    "ATTEMPTS_DIR",
    "CHECKPOINTS_DIR",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ArtifactAlreadyCommitted",
    "ArtifactCorrupted",
    "ArtifactError",
    "ArtifactNotCommitted",
    "ArtifactReader",
    "ArtifactWriter",
    "FileEntry",
    "InputRef",
    "Lease",
    "LeaseLost",
    "Manifest",
    "ObjectStore",
    "PointerConflict",
    "PointerState",
    "Retrier",
    "StorageAccessError",
    "StorageError",
    "StorageUnavailable",
    "acquire_lease",
    "canonical_json",
    "code_version",
    "content_key",
    "endpoint_from_env",
    "is_transient",
    "new_attempt_id",
    "normalize_root_uri",
    "safe_join",
    "source_tree_hash",
]
