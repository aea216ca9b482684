"""What a person reads first where a flow fails: the worker's one-line cause and fix, not its output."""

from __future__ import annotations

from forge_core.launch import LaunchResult, Outcome
from forge_core.launch.result import LaunchFailed


def test_the_failure_message_is_the_cause_and_fix_without_the_tracebacks():
    reason = "rank 0: ValueError: model.max_seq_len=512: exceeds the checkpoint's context. Fix: lower it"
    tail = tuple(["Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "ValueError: ..."] * 5)
    failed = LaunchFailed(LaunchResult(Outcome.FATAL, 1, reason, tail=tail, launch_id="sft-1"))

    message = str(failed)
    assert message.startswith(reason)
    assert "Traceback" not in message and "\n" not in message
    assert "[fatal; launch sft-1, the worker's output and tracebacks are in the task log]" in message
    assert failed.result.tail == tail  # kept for whoever needs it
