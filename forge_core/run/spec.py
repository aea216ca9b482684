"""StageSpec: everything a worker needs to run one stage, stored as `<output_uri>/_spec.json`.

The task side writes it, the worker side reads it:

    uri = write_spec(store, StageSpec(stage="sft", config=config_to_dict(cfg), inputs={"data": data_uri},
                                      output_uri=out_uri, params={}))
    # ... python -m forge_core.run sft --spec <uri>
    spec = read_spec(uri)            # in the worker
    cfg = spec.run_config()          # validated RunConfig (ConfigError lists every problem)

The spec sits inside the output prefix but is not part of the artifact: only files written through the
artifact writer are listed in `_MANIFEST.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from forge_core.config import RunConfig, config_from_dict
from forge_core.config.schema import STAGES, StorageConfig

if TYPE_CHECKING:
    from forge_core.storage import ObjectStore

SPEC_NAME = "_spec.json"
_FIELDS = ("stage", "config", "inputs", "output_uri", "params")


@dataclass(frozen=True)
class StageSpec:
    """One stage run: which stage, the full config (as a dict), input artifact URIs, output URI, params.

    `params` carries stage-specific values that are not config, e.g. `{"iteration": 3}`; they must be JSON.
    """

    stage: str
    config: dict[str, Any]
    inputs: dict[str, str]
    output_uri: str
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors = self.check()
        if errors:
            raise ValueError("invalid StageSpec: " + "; ".join(errors))

    def check(self) -> list[str]:
        errors = []
        if self.stage not in STAGES:
            errors.append(f"stage={self.stage!r}: unknown; valid stages: {', '.join(STAGES)}")
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
        """Where `write_spec` puts this spec: `<output_uri>/_spec.json`."""
        return spec_uri(self.output_uri)

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
        unknown = sorted(set(data) - set(_FIELDS))
        if missing or unknown:
            raise ValueError(
                f"{source}: missing keys {missing}, unknown keys {unknown}; "
                f"a spec has exactly {', '.join(_FIELDS)}"
            )
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc


def spec_uri(output_uri: str) -> str:
    return output_uri.rstrip("/") + "/" + SPEC_NAME


def write_spec(store: ObjectStore, spec: StageSpec) -> str:
    """Write `spec` to `<spec.output_uri>/_spec.json` through an ObjectStore (atomic put); returns its URI."""
    uri = store.join(spec.output_uri, SPEC_NAME)
    store.put_bytes(uri, spec.to_json().encode("utf-8"))
    return uri


def read_spec(uri: str, storage_cfg: StorageConfig | None = None) -> StageSpec:
    """Read a spec by URI (file://, s3://, memory:// or a local path).

    `storage_cfg` supplies the S3 endpoint/region/retries (its `root` is not used: the URI names the store);
    without it the standard endpoint environment variables apply (see forge_core.storage).
    Raises FileNotFoundError naming the URI when there is no spec.
    """
    from forge_core.storage import ObjectStore

    folder = uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") else "."
    if storage_cfg is None:
        store = ObjectStore(folder)
    else:
        store = ObjectStore(
            folder,
            endpoint_url=storage_cfg.endpoint_url,
            region=storage_cfg.region,
            retries=storage_cfg.retries,
            retry_backoff_s=storage_cfg.retry_backoff_s,
        )
    try:
        data = store.get_bytes(uri)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"stage spec {uri} does not exist; the task writes it with write_spec() before launching "
            "the worker"
        ) from exc
    return StageSpec.from_json(data, source=f"stage spec {uri}")
