"""StageSpec: everything a worker needs to run one stage, stored as `<output_uri>/_specs/<attempt>.json`.

    uri = write_spec(store, StageSpec(stage="sft", config=config_to_dict(cfg), inputs={"data": data_uri},
                                      output_uri=out_uri, params={}))
    spec = read_spec(uri)            # in the worker (python -m forge_core.run sft --spec <uri>)
    cfg = spec.run_config()          # validated RunConfig (ConfigError lists every problem)

The spec is not part of the artifact (not in `_MANIFEST.json`). Each task attempt writes its own spec object,
so racing runs never overwrite each other's; a spec without an attempt lives at `<output_uri>/_spec.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from forge_core.config import RunConfig, config_from_dict
from forge_core.config.schema import StorageConfig
from forge_core.stages import is_stage, stage_names

if TYPE_CHECKING:
    from forge_core.storage import ObjectStore

SPEC_NAME = "_spec.json"
SPECS_DIR = "_specs"
_FIELDS = ("stage", "config", "inputs", "output_uri", "params")
_OPTIONAL_FIELDS = ("attempt", "fingerprints")


@dataclass(frozen=True)
class StageSpec:
    """One stage run: which stage, the full config (as a dict), input artifact URIs, output URI, params.

    `params`: stage-specific JSON values that are not config, e.g. `{"iteration": 3}`.
    `attempt`: the task attempt that launched the worker ("" = none); it also names the spec object.
    `fingerprints`: what the stage reads outside the store, as its key was computed (forge_core.run.external).
    """

    stage: str
    config: dict[str, Any]
    inputs: dict[str, str]
    output_uri: str
    params: dict[str, Any] = field(default_factory=dict)
    attempt: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors = self.check()
        if errors:
            raise ValueError("invalid StageSpec: " + "; ".join(errors))

    def check(self) -> list[str]:
        errors = []
        if not is_stage(self.stage):
            errors.append(f"stage={self.stage!r}: unknown; valid stages: {', '.join(stage_names())}")
        if not isinstance(self.config, dict):
            errors.append(
                f"config: expected the RunConfig as a dict (config_to_dict(cfg)), got {type(self.config)}"
            )
        if not isinstance(self.inputs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.inputs.items()
        ):
            errors.append(f"inputs={self.inputs!r}: expected {{name: artifact URI}} with str names and URIs")
        if not isinstance(self.output_uri, str) or not self.output_uri.strip():
            errors.append(f"output_uri={self.output_uri!r}: give the artifact URI the stage writes")
        if not isinstance(self.params, dict):
            errors.append(f"params={self.params!r}: expected a dict of JSON values")
        if self.attempt and not _is_attempt_id(self.attempt):
            errors.append(f"attempt={self.attempt!r}: expected an attempt id (new_attempt_id()) or ''")
        if not isinstance(self.fingerprints, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.fingerprints.items()
        ):
            errors.append(f"fingerprints={self.fingerprints!r}: expected {{config key: sha256 hex}}")
        if not errors:
            try:
                self.to_json()
            except (TypeError, ValueError) as exc:
                errors.append(
                    f"config/params: not plain JSON data ({exc}); use numbers, strings, lists, dicts"
                )
        return errors

    @property
    def uri(self) -> str:
        """Where `write_spec` puts this spec: `<output_uri>/_specs/<attempt>.json` (no attempt: `_spec.json`)."""
        return spec_uri(self.output_uri, self.attempt)

    def run_config(self) -> RunConfig:
        """The validated RunConfig of this run; raises ConfigError naming every problem."""
        return config_from_dict(self.config, source=f"the {self.stage} stage spec for {self.output_uri}")

    def to_json(self) -> str:
        """Sorted, indented JSON: identical specs give identical bytes."""
        return json.dumps(asdict(self), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "stage spec") -> StageSpec:
        """Parse a spec written by `to_json`; ValueError naming `source` if it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc}); was it written by write_spec?") from exc
        if not isinstance(data, dict):
            # Bad file content, not a programming error: a ValueError like every other malformed spec.
            raise ValueError(f"{source}: expected a JSON object with keys {', '.join(_FIELDS)}")  # noqa: TRY004
        missing = [k for k in _FIELDS if k not in data]
        unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL_FIELDS))
        if missing or unknown:
            raise ValueError(
                f"{source}: missing keys {missing}, unknown keys {unknown}; "
                f"a spec has exactly {', '.join(_FIELDS)} (and optionally {', '.join(_OPTIONAL_FIELDS)})"
            )
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc


def _is_attempt_id(value) -> bool:
    from forge_core.storage.manifest import is_attempt_id  # only when set: keeps this module's imports light

    return is_attempt_id(value)


def spec_uri(output_uri: str, attempt: str = "") -> str:
    folder = output_uri.rstrip("/")
    return f"{folder}/{SPECS_DIR}/{attempt}.json" if attempt else f"{folder}/{SPEC_NAME}"


def write_spec(store: ObjectStore, spec: StageSpec) -> str:
    """Write `spec` to `spec.uri` through an ObjectStore (atomic put); returns its URI."""
    store.put_bytes(spec.uri, spec.to_json().encode("utf-8"))
    return spec.uri


def read_spec(uri: str, storage_cfg: StorageConfig | None = None) -> StageSpec:
    """Read a spec by URI (file://, s3://, memory:// or a local path); FileNotFoundError naming it when absent.
    `storage_cfg` supplies the S3 endpoint, region and retries; without it the standard environment applies."""
    from forge_core.storage import ObjectStore

    folder = uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") else "."
    # The defaults' retry horizon too: a worker that starts during a storage brown-out rides it out.
    cfg = storage_cfg or StorageConfig()
    store = ObjectStore(
        folder,
        endpoint_url=cfg.endpoint_url,
        region=cfg.region,
        retries=cfg.retries,
        retry_backoff_s=cfg.retry_backoff_s,
        retry_horizon_s=cfg.retry_horizon_s,
    )
    try:
        data = store.get_bytes(uri)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"stage spec {uri} does not exist; the task writes it with write_spec() before launching "
            "the worker"
        ) from exc
    return StageSpec.from_json(data, source=f"stage spec {uri}")
