"""A dry run of the configured rewards (rollout.rewards and sft.verifier) on the data's own reference answers,
before anything trains.

    problems = reward_problems(cfg)   # [] or one message per reward that cannot score this data

A reward that scores 0 on every reference cannot tell a right answer from a wrong one on this data, so GRPO
would train on zero advantage; its problem shows what the reward saw and the settings that change what it
compares. A reward that raises, kills its worker or outlasts the per-sample bound is a problem too. Rewards of
sample facts (`overlong`) are run but not judged: 0 is their normal value.
"""

from __future__ import annotations

import dataclasses
import inspect
import reprlib

from forge_core.config.schema import RewardComponentConfig, RunConfig
from forge_core.data.pipeline import reference_examples
from forge_core.rewards.isolation import RewardIsolation
from forge_core.rewards.registry import RewardFunctionError
from forge_core.rewards.scoring import SAMPLE_FIELDS, RewardComponent, RewardSet, example_context
from forge_core.timings import REWARD_DRY_RUN_TIMEOUT_S

DRY_RUN_ROWS = 16


def reward_problems(cfg: RunConfig, rows: int = DRY_RUN_ROWS) -> list[str]:
    """One problem per reward (rollout.rewards, sft.verifier) that scores 0 on every reference answer of the
    first `rows` rows, or fails on one; [] when each can score them or the data cannot be read."""
    try:
        examples = reference_examples(cfg, rows)
    except (ValueError, OSError):
        return []  # an unreadable source or tokenizer: preflight's input_problems names it
    if examples is None or not len(examples):
        return []
    layout = "demo" if cfg.data.source == "demo" else cfg.data.layout
    # User functions run in the isolated reward workers, bounded in time, as the stages run them.
    isolation = dataclasses.replace(
        RewardIsolation.from_config(cfg.rollout), timeout_s=min(cfg.rollout.reward_timeout_s, REWARD_DRY_RUN_TIMEOUT_S)
    )
    sets = [RewardSet.from_config(cfg.rollout.rewards, isolation=isolation)]
    verifier = getattr(cfg.sft, "verifier", None)
    if verifier is not None:
        config = RewardComponentConfig(name=verifier, kwargs=dict(getattr(cfg.sft, "verifier_kwargs", {})))
        sets.append(RewardSet.from_config([config], section="sft.verifier", isolation=isolation))
    problems = []
    refs = [f"{examples.source} row {row}" for row in examples.rows]
    for rewards in sets:
        scored = [c for c in rewards.components if not c.sample_fields]
        if not scored:
            continue
        try:
            # The sample-fact rewards are not judged, only run, under the run's own length cap.
            contexts = [example_context(cfg.rollout.sampling.max_new_tokens) for _ in refs]
            result = rewards.score(examples.completions, examples.ground_truths, refs, contexts)
        except RewardFunctionError as exc:  # its message names the sample and the fix
            names = ", ".join(f"{c.config_key}.name={c.spec.name!r}" for c in rewards.components)
            truth_source, _ = _ground_truth_source(cfg.data, layout)
            problems.append(
                f"{names}: {exc} (the preflight dry run in the reward workers, {isolation.timeout_s:g} s a sample, "
                f"on the reference answers of data.layout={layout!r}, whose ground truth is {truth_source})"
            )
            continue
        for component in scored:
            if all(score == 0 for score in result.columns[component.column]):
                problems.append(_scores_nothing(cfg, component, examples, layout))
    return problems


def _scores_nothing(cfg: RunConfig, component: RewardComponent, examples, layout: str) -> str:
    """The problem of a reward that scored 0 on every reference: what it saw and the settings to change."""
    verifier = component.config_key.startswith("sft.verifier")
    key = "sft.verifier" if verifier else f"{component.config_key}.name"
    kwargs_key = "sft.verifier_kwargs" if verifier else f"{component.config_key}.kwargs"
    truth_source, truth_setting = _ground_truth_source(cfg.data, layout)
    settings = [
        truth_setting,
        f"{kwargs_key} (now {component.kwargs}; {component.spec.name} takes {_kwargs_it_takes(component)})",
        "a reward that fits what the ground truth is (GSM8K answers: numeric_answer), or removing it",
    ]
    return (
        f"{key}={component.spec.name!r}: scored 0 on all {len(examples.completions)} reference answers of the "
        f"first rows of data.source={cfg.data.source!r}, so it cannot tell a right answer from a wrong one on "
        f"this data. What it saw ({examples.source} row {examples.rows[0]}, data.layout={layout!r}):\n"
        f"      completion:   {_SHOWN.repr(examples.completions[0])}\n"
        f"      ground truth: {_SHOWN.repr(examples.ground_truths[0])} ({truth_source})\n"
        f"    Settings that change what it compares: {'; '.join(settings)}"
    )


# A reference shown in a problem: long enough to see its end (where answers are), bounded for huge rows.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = 240


def _ground_truth_source(data, layout: str) -> tuple[str, str]:
    """(where the layout takes the ground truth from, the setting that changes it)."""
    if layout == "demo":
        return "the demo task's answer", "data.demo (the demo task's own answers)"
    if layout == "gsm8k":
        own_column = "data.layout (prompt_completion or chat take data.ground_truth_field, a column of your own)"
        return f"the number after '####' in data.answer_field={data.answer_field!r}", own_column
    setting = "data.ground_truth_field=<a column holding exactly what the reward compares against>"
    if data.ground_truth_field:
        return f"column data.ground_truth_field={data.ground_truth_field!r}", f"{setting} (now {data.ground_truth_field!r})"
    itself = f"data.completion_field={data.completion_field!r}" if layout == "prompt_completion" else "the last message"
    return f"{itself} as is: data.ground_truth_field is unset", setting


def _kwargs_it_takes(component: RewardComponent) -> str:
    """The kwargs a config may set for the reward, with defaults: `tag='answer', rel_tol=1e-06`."""
    try:
        parameters = list(inspect.signature(component.spec.fn).parameters.values())[2:]
    except (TypeError, ValueError):
        return "unknown kwargs"
    shown = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in parameters
        if p.name not in SAMPLE_FIELDS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    return ", ".join(shown) or "no kwargs"
