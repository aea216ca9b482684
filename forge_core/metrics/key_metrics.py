"""The one line a reader looks for first in each stage's committed metrics (the stage table's `key metric`).

A stage names its function in its registry record (`Stage.key_metric`, "module:function"). Each function takes
the manifest's metrics as the stage worker wrote them and returns a short line; a missing metric prints "n/a".
"""

from __future__ import annotations

from collections.abc import Mapping


def fmt(value) -> str:
    """A metric as the tables print it: 3 decimals for numbers, "n/a" when missing."""
    if isinstance(value, bool) or value is None:
        return "n/a" if value is None else str(value)
    return f"{value:.3f}" if isinstance(value, (int, float)) else str(value)


def data_rows(m: Mapping) -> str:
    rows = m.get("rows")
    if isinstance(rows, Mapping):
        return "rows " + " ".join(f"{split}={count}" for split, count in rows.items())
    return f"rows {fmt(rows)}"


def sft_loss_and_selection(m: Mapping) -> str:
    text = f"loss {fmt(m.get('final_loss'))}"
    if m.get("selected_step") is None:
        return text
    exact_match = m.get("val_exact_match")
    validation = f"val exact match {fmt(exact_match)}" if exact_match is not None else f"val loss {fmt(m.get('eval_loss'))}"
    return f"{text}, step {m['selected_step']}/{m.get('steps')} ({m.get('selected_by')}): {validation}"


def rollout_reward(m: Mapping) -> str:
    return f"reward {fmt(m.get('reward_mean'))} pass {fmt(m.get('pass_rate'))}"


def grpo_loss_on_reward(m: Mapping) -> str:
    # A batch whose every group scored equal rewards has no advantage to learn from: GRPO skips all its steps and
    # writes no loss. Say so rather than print a missing loss.
    if m.get("train/steps") == 0 and m.get("train/skipped_steps"):
        return f"no update (equal rewards in every group) on reward {fmt(m.get('reward/mean'))}"
    return f"loss {fmt(m.get('final/loss'))} on reward {fmt(m.get('reward/mean'))}"


def eval_accuracy(m: Mapping) -> str:
    rate = m.get("env/tool_call_rate")  # episode evaluations (rollout.env) also say how often it called a tool
    return f"accuracy {fmt(m.get('accuracy'))}" + ("" if rate is None else f" tool calls {fmt(rate)}")
