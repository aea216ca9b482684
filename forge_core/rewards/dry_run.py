"""A dry run of the configured rewards (rollout.rewards and sft.verifier) on the data's own reference answers,
before anything trains.

    problems = reward_problems(cfg)   # [] or one message per reward that cannot score this data

Each reward component scores the reference completion of the first rows of `data.source` (read as the prepare
stage reads them) against its ground truth. A reward that scores 0 on every reference cannot tell a right
answer from a wrong one on this data (e.g. `answer_format` looks for `<answer>` tags that GSM8K answers never
have): GRPO would train on zero advantage. That, and a reward that raises on a reference, is a problem naming
the reward, the layout and the fix. Rewards that score sample facts instead of the text (`overlong`: they take
`response_len` ...) are not dry-run: 0 is their normal value.
"""

from __future__ import annotations

import dataclasses

from forge_core.config.schema import RewardComponentConfig, RunConfig
from forge_core.data.pipeline import reference_examples
from forge_core.rewards.isolation import RewardIsolation
from forge_core.rewards.registry import RewardFunctionError
from forge_core.rewards.scoring import RewardSet, example_context

DRY_RUN_ROWS = 16
# A dry run's per-sample bound (rollout.reward_timeout_s when lower): validate must not wait long on a hang.
DRY_RUN_TIMEOUT_S = 5.0


def reward_problems(cfg: RunConfig, rows: int = DRY_RUN_ROWS) -> list[str]:
    """One problem per reward of `rollout.rewards` that scores 0 on every reference answer of the first `rows`
    rows of the data (or raises on one); [] when each can score it."""
    try:
        examples = reference_examples(cfg, rows)
    except (ValueError, OSError):
        return []  # an unreadable source or tokenizer: preflight's input_problems names it
    if examples is None or not len(examples):
        return []
    layout = "demo" if cfg.data.source == "demo" else cfg.data.layout
    # User functions run in the isolated reward workers, bounded in time, as the stages run them.
    isolation = dataclasses.replace(
        RewardIsolation.from_config(cfg.rollout), timeout_s=min(cfg.rollout.reward_timeout_s, DRY_RUN_TIMEOUT_S)
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
            contexts = [example_context() for _ in refs]  # the sample-fact rewards are not judged, only run
            result = rewards.score(examples.completions, examples.ground_truths, refs, contexts)
        except RewardFunctionError as exc:
            names = ", ".join(f"{c.config_key}.name={c.spec.name!r}" for c in rewards.components)
            problems.append(
                f"{names}: {exc} (preflight dry run in the reward workers on the reference answers of "
                f"data.layout={layout!r}, {isolation.timeout_s:g} s a sample); fix the function, or raise "
                "rollout.reward_timeout_s if it is only slow"
            )
            continue
        for component in scored:
            if all(score == 0 for score in result.columns[component.column]):
                problems.append(_scores_nothing(cfg, component, examples, layout))
    return problems


def _scores_nothing(cfg: RunConfig, component, examples, layout: str) -> str:
    key = "sft.verifier" if component.config_key.startswith("sft.verifier") else f"{component.config_key}.name"
    return (
        f"{key}={component.spec.name!r}: scored 0 on all {len(examples.completions)} reference "
        f"answers of the first rows of data.source={cfg.data.source!r} (data.layout={layout!r}, e.g. "
        f"{examples.completions[0][-80:]!r} against ground truth {examples.ground_truths[0]!r}), so it "
        "cannot tell a right answer from a wrong one on this data; choose a reward that fits the layout "
        "(gsm8k: numeric_answer) or its kwargs (e.g. tag), or remove it"
    )
