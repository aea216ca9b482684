"""Where a finished run left its results, for the commands that come after it.

    path = record_run(summary, cfg)            # every run's ending
    record = read_run(".forge-runs", "last")   # forgeflow export last <dir>

A record (summary, store, config) is written under `logging.dir` as
`<name>/<flow run id>/summary-<flow run id>.json` (kept) and `last-run.json` (replaced by the next run).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from forge_core.config import RunConfig
from forge_core.storage import ObjectStore, normalize_root_uri

LAST_RUN_FILE = "last-run.json"
LAST = "last"


def _summary_path(log_dir: Path, name: str, flow_run_id: str) -> Path:
    return log_dir / name / flow_run_id / f"summary-{flow_run_id}.json"


def record_run(summary: dict, cfg: RunConfig, config: str | None = None) -> Path:
    """Write the run's record (see the module docstring); returns the kept summary's path."""
    record = {
        **summary,
        "config": config,
        "store": {
            "root": normalize_root_uri(cfg.storage.root),  # absolute: the record is read from any folder
            "endpoint_url": cfg.storage.endpoint_url,
            "region": cfg.storage.region,
        },
    }
    log_dir = Path(cfg.logging.dir).expanduser().resolve()
    path = _summary_path(log_dir, cfg.name, record["flow_run_id"])
    text = json.dumps(record, indent=2, default=str) + "\n"
    _write_atomically(path, text)
    _write_atomically(log_dir / LAST_RUN_FILE, text)
    return path


def _write_atomically(path: Path, text: str) -> None:
    """Write via a temp file and rename, so a concurrent reader never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def read_run(log_dir: str | os.PathLike, run: str = LAST) -> dict:
    """The record of `run` (`last`, or a flow run id) under `log_dir`; ValueError saying where it looked."""

    log_dir = Path(log_dir).expanduser().resolve()
    if run == LAST:
        candidates = [log_dir / LAST_RUN_FILE]
    else:
        candidates = sorted(log_dir.glob(f"*/{run}/summary-{run}.json"))
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    what = "no finished run is recorded" if run == LAST else f"no run {run!r} is recorded"
    raise ValueError(
        f"{what} under {log_dir} (the runs folder, logging.dir); run the command from the folder the run started "
        "in, or pass logging.dir=<the run's logging.dir> (or --config <the run's config>)"
    )


def find_run(log_dir: str | os.PathLike, run: str = LAST) -> dict | None:
    """`read_run`, or None when there is no such record."""
    try:
        return read_run(log_dir, run)
    except ValueError:
        return None


def run_store(record: dict, cfg: RunConfig) -> ObjectStore:
    """The store a recorded run wrote to, with `cfg`'s retry settings."""
    store = record["store"]
    return ObjectStore(
        store["root"],
        endpoint_url=store.get("endpoint_url"),
        region=store.get("region"),
        retries=cfg.storage.retries,
        retry_backoff_s=cfg.storage.retry_backoff_s,
        retry_horizon_s=cfg.storage.retry_horizon_s,
    )


def status_store(cfg: RunConfig, store_named: bool) -> tuple[ObjectStore, str]:
    """The store `forgeflow status` reads and where the choice came from: `cfg`'s when `store_named`, else the
    last run's recorded one, else the default."""

    if not store_named:
        record = find_run(cfg.logging.dir)
        if record is not None:
            path = Path(cfg.logging.dir).expanduser().resolve() / LAST_RUN_FILE
            return run_store(record, cfg), f"the last run's, flow run {record['flow_run_id']} ({path})"
    store = ObjectStore.from_config(cfg.storage)
    if store_named:
        return store, "storage.root of the config and overrides"
    return store, f"the default store: no run is recorded under {Path(cfg.logging.dir).expanduser().resolve()}"
