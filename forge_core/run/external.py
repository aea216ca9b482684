"""What a stage reads from outside the store: keyed by its contents when planned, verified by the worker.

    fingerprints = external_fingerprints(cfg, store, "prepare")  # {"data.source": sha, "data.tokenizer.path": sha}
    verify_external_inputs(spec, cfg, store)                     # in the worker, before it reads them

Which stage reads which keys is `Stage.external` (forge_core.stages). The fingerprints go into the stage's key
and `StageSpec.fingerprints`; the worker recomputes them and raises `SourceChanged` (retryable: the retry plans
again under a new key) when one differs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from forge_core.config import RunConfig
from forge_core.launch.errors import RetryableStageError
from forge_core.run.spec import StageSpec
from forge_core.stages import stage_named
from forge_core.storage import ObjectStore
from forge_core.storage.fingerprints import entries_fingerprint, folder_fingerprint, is_content_name
from forge_core.storage.uris import split_scheme

log = logging.getLogger(__name__)

# External keys whose path reaches no output: their contents alone stand for them in keys, so a moved model or
# tokenizer folder is still the same input (data.source is not one: the rejects table names it).
KEYED_BY_CONTENT_ONLY = ("model.hf_path", "data.tokenizer.path")


class SourceChanged(RetryableStageError):
    """An input outside the store changed after its stage was planned; a retry re-plans with the new one."""


def external_fingerprints(cfg: RunConfig, store: ObjectStore, stage: str) -> dict[str, str]:
    """{config key: content fingerprint} of what `stage` reads from outside the store (unset keys left out)."""
    fingerprints = {}
    for key in stage_named(stage).external:
        fingerprint = _FINGERPRINTS[key](cfg, store)
        if fingerprint is not None:
            fingerprints[key] = fingerprint
    return fingerprints


def verify_external_inputs(spec: StageSpec, cfg: RunConfig, store: ObjectStore) -> None:
    """Raise SourceChanged unless what the worker is about to read is what the stage's key was made from.
    A spec without fingerprints is logged, not refused."""
    if not spec.fingerprints:
        if stage_named(spec.stage).external:
            log.warning("%s: the stage spec records no input fingerprints; its inputs are not verified", spec.uri)
        return
    unknown = sorted(set(spec.fingerprints) - set(_FINGERPRINTS))
    if unknown:
        raise ValueError(f"stage spec {spec.uri}: fingerprints of unknown inputs {unknown}; plan the stage again")
    current = {key: _FINGERPRINTS[key](cfg, store) for key in spec.fingerprints}
    changed = sorted(key for key, planned in spec.fingerprints.items() if current[key] != planned)
    if changed:
        details = "; ".join(
            f"{key}={_config_value(cfg, key)}: planned {spec.fingerprints.get(key)}, now {current.get(key)}"
            for key in changed
        )
        raise SourceChanged(
            f"the {spec.stage} stage's inputs outside the store changed after it was planned ({details}); its "
            f"output key {spec.output_uri} is stale. A retry plans the stage again with the new contents; "
            "keep sources unchanged while a run reads them"
        )


def _config_value(cfg: RunConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _storage_options(uri: str, store: ObjectStore) -> dict:
    from forge_core.data.pipeline import storage_options_for

    return storage_options_for(uri, store)


def _data_source(cfg: RunConfig, store: ObjectStore) -> str | None:
    from forge_core.data.generated import REASONING_GYM_DISTRIBUTION, TOOLS_DEMO_SOURCE, reasoning_gym_version
    from forge_core.data.pipeline import DEMO_SOURCE
    from forge_core.data.sources import source_fingerprint

    if cfg.data.source in (DEMO_SOURCE, TOOLS_DEMO_SOURCE):
        return None
    if cfg.data.source.startswith("reasoning_gym:"):
        # Generated, not read: its rows depend on the settings (in the key) and the generator's version.
        return f"{REASONING_GYM_DISTRIBUTION}=={reasoning_gym_version()}"
    return source_fingerprint(cfg.data.source, cfg.data.format, _storage_options(cfg.data.source, store))


def _tokenizer_folder(cfg: RunConfig, store: ObjectStore) -> str | None:
    from forge_core.data.tokenizer import TOKENIZER_FOLDER_FILES

    path = cfg.data.tokenizer.path
    if path is None:
        return None
    options = _storage_options(path, store)
    return folder_fingerprint(path, options, names=TOKENIZER_FOLDER_FILES, what="data.tokenizer.path")


def _model_folder(cfg: RunConfig, store: ObjectStore) -> str | None:
    """A committed artifact by its manifest's file hashes (nothing to read), any other folder file by file."""
    path = cfg.model.hf_path
    if path is None:
        return None
    uri = path if "://" in path else "file://" + os.path.abspath(path)
    if split_scheme(uri)[0] == store.scheme and store.is_committed(uri):
        files = store.read_manifest(uri).files
        return entries_fingerprint({rel: entry.sha256 for rel, entry in files.items() if is_content_name(rel)})
    return folder_fingerprint(path, _storage_options(path, store), what="model.hf_path")


_FINGERPRINTS: dict[str, Callable[[RunConfig, ObjectStore], str | None]] = {
    "data.source": _data_source,
    "data.tokenizer.path": _tokenizer_folder,
    "model.hf_path": _model_folder,
}
