"""Metric sinks: JSON lines + console on rank 0, nothing on other ranks, and a real offline wandb run."""

from __future__ import annotations

import io
import json

import pytest

from forge_core.config.schema import LoggingConfig
from forge_core.metrics import ConsoleSink, NullSink, build_sinks, run_dir


def test_rank0_writes_jsonl_and_other_ranks_write_nothing(tmp_path):
    cfg = LoggingConfig(wandb_mode="disabled", dir=str(tmp_path))
    sink = build_sinks(cfg, "my run/sft", rank=0)
    sink.log({"loss": 1.5, "lr": 0.002}, step=1)
    sink.log({"loss": float("nan")}, step=2)
    sink.summary({"final_loss": 0.5})
    sink.close()
    assert isinstance(build_sinks(cfg, "my run/sft", rank=1), NullSink)
    lines = [
        json.loads(line) for line in (run_dir(cfg, "my run/sft") / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(r.get("step"), r.get("loss")) for r in lines[:2]] == [(1, 1.5), (2, None)]
    assert lines[2]["summary"] is True and lines[2]["final_loss"] == 0.5
    assert run_dir(cfg, "my run/sft").name == "my-run-sft"


def test_console_line_format():
    stream = io.StringIO()
    ConsoleSink("demo", stream).log({"loss": 1.234567, "tokens": 256.0, "x": float("inf")}, step=7)
    assert stream.getvalue() == "[demo] step 7 | loss 1.23457 | tokens 256 | x inf\n"


def test_wandb_offline_run_lands_under_the_logging_dir(tmp_path):
    cfg = LoggingConfig(wandb_mode="offline", dir=str(tmp_path))
    sink = build_sinks(cfg, "wb", rank=0, config={"seed": 1})
    sink.log({"loss": 2.0}, step=1)
    sink.summary({"final_loss": 2.0})
    sink.close()
    runs = list((run_dir(cfg, "wb") / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((run_dir(cfg, "wb")).rglob("*"))


def test_wandb_starts_off_the_caller_s_path_and_a_failed_start_raises_at_the_first_call(tmp_path):
    cfg = LoggingConfig(wandb_mode="offline", dir=str(tmp_path))
    # wandb.init rejects a config it cannot serialize: building the sink must not raise it (the start runs
    # beside the caller), the first use must.
    sink = build_sinks(cfg, "wb-bad", rank=0, config={"not_json": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        sink.log({"loss": 1.0}, step=1)
