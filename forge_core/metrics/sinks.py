"""The MetricsSink interface and its implementations (see the package docstring for usage)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from forge_core.config.schema import LoggingConfig


class MetricsSink(ABC):
    """Where scalar metrics go. `log` is called per step; `summary` once with the run's final numbers."""

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def summary(self, metrics: dict[str, float]) -> None:
        """Final numbers of the run (default: ignored)."""

    def close(self) -> None:
        """Flush and release files / background processes."""


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


class NullSink(MetricsSink):
    """What ranks other than 0 get: drops everything."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        return None


class ConsoleSink(MetricsSink):
    """One line per logged step: `[run] step 10 | loss 1.2345 | lr 0.002 ...`."""

    def __init__(self, run_name: str, stream: TextIO | None = None) -> None:
        self.run_name = run_name
        self.stream = stream or sys.stdout

    @staticmethod
    def _format(value: float) -> str:
        value = float(value)
        if math.isfinite(value) and value == int(value) and abs(value) < 1e12:
            return str(int(value))
        return f"{value:.6g}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = " | ".join(f"{k} {self._format(v)}" for k, v in metrics.items())
        print(f"[{self.run_name}] step {step} | {parts}", file=self.stream, flush=True)

    def summary(self, metrics: dict[str, float]) -> None:
        parts = " | ".join(f"{k} {self._format(v)}" for k, v in metrics.items())
        print(f"[{self.run_name}] summary | {parts}", file=self.stream, flush=True)


class JsonlSink(MetricsSink):
    """Appends `{"step", "time", **metrics}` per line to a file (non-finite values become null)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the sink's lifetime

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}})

    def summary(self, metrics: dict[str, float]) -> None:
        self._write({"summary": True, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}})

    def close(self) -> None:
        self._file.close()


class WandbSink(MetricsSink):
    """A wandb run (offline by default: nothing leaves the machine until `wandb sync`).

    The run starts on a thread of its own: `wandb.init` costs about 0.15 s even in a warm process, and a
    stage's first step has no metrics to log before it ends, so the start overlaps that step instead of
    delaying it. Every call waits for the start; a start that failed raises its error at the first call.
    """

    def __init__(
        self, cfg: LoggingConfig, run_name: str, directory: Path, config: dict | None = None
    ) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        start = functools.partial(
            wandb.init,
            project=cfg.wandb_project,
            name=run_name,
            dir=str(directory),
            mode=cfg.wandb_mode,
            config=config or {},
            reinit="create_new",
        )
        starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb-start")
        self._started = starter.submit(start)
        starter.shutdown(wait=False)  # the thread ends once the run has started

    @property
    def _run(self):
        return self._started.result()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        run = self._run
        for key, value in metrics.items():
            run.summary[key] = value

    def close(self) -> None:
        self._run.finish()


class CompositeSink(MetricsSink):
    """Fans every call out to several sinks."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def summary(self, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.summary(metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def run_dir(cfg: LoggingConfig, run_name: str) -> Path:
    """`cfg.dir/<run_name>` with the name made filesystem-safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-") or "run"
    return Path(cfg.dir) / safe


def build_sinks(cfg: LoggingConfig, run_name: str, rank: int = 0, config: dict | None = None) -> MetricsSink:
    """Console + JSON lines + wandb (unless `wandb_mode=disabled`); a NullSink off rank 0 when `cfg.rank0_only`.
    `config` is recorded with the wandb run."""
    if rank != 0 and cfg.rank0_only:
        return NullSink()
    directory = run_dir(cfg, run_name if rank == 0 else f"{run_name}-rank{rank}")
    sinks: list[MetricsSink] = [ConsoleSink(run_name), JsonlSink(directory / "metrics.jsonl")]
    if cfg.wandb_mode != "disabled":
        sinks.append(WandbSink(cfg, run_name, directory, config))
    return CompositeSink(sinks)
