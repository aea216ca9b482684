"""Metric sinks: console, JSON lines, wandb (offline by default). Rank 0 logs; other ranks get a no-op sink.

    sink = build_sinks(cfg.logging, run_name="demo-sft", rank=dist_ctx.rank)
    sink.log({"loss": 1.23, "lr": 2e-3}, step=10)
    sink.summary({"final_loss": 0.4})
    sink.close()

Files go under `cfg.logging.dir/<run_name>/`: `metrics.jsonl` and wandb's offline run folder (`wandb/`, for
`wandb sync`); `logging.wandb_mode=disabled` skips wandb.
"""

from forge_core.metrics.sinks import (
    CompositeSink,
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    NullSink,
    WandbSink,
    build_sinks,
    run_dir,
)

__all__ = [
    "CompositeSink",
    "ConsoleSink",
    "JsonlSink",
    "MetricsSink",
    "NullSink",
    "WandbSink",
    "build_sinks",
    "run_dir",
]
