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

from forge_core.config.schema import RewardComponentConfig, RunConfig
from forge_core.data.pipeline import reference_examples
from forge_core.rewards.registry import RewardFunctionError
from forge_core.rewards.scoring import RewardSet

DRY_RUN_ROWS = 16


def reward_problems(cfg: RunConfig, rows: int = DRY_RUN_ROWS) -> list[str]:
    """One problem per reward of `rollout.rewards` that scores 0 on every reference answer of the first `rows`
    rows of the data (or raises on one); [] when each can score it."""
    try:
        examples = reference_examples(cfg, rows)
    except (ValueError, OSError):
        return []  # an unreadable source or tokenizer: preflight's input_problems names it
    if examples is None or not len(examples):
        return []
    # In this process: the user's functions, on a few rows. SFT's verifier (its validation exact match) too.
    components = list(RewardSet.from_config(cfg.rollout.rewards).components)
    verifier = getattr(cfg.sft, "verifier", None)
    if verifier is not None:
        config = RewardComponentConfig(name=verifier, kwargs=dict(getattr(cfg.sft, "verifier_kwargs", {})))
        components += RewardSet.from_config([config], section="sft.verifier").components
    layout = "demo" if cfg.data.source == "demo" else cfg.data.layout
    problems = []
    for component in components:
        if component.sample_fields:
            continue
        refs = [f"{examples.source} row {row}" for row in examples.rows]
        try:
            scores = [
                component.score(completion, truth, ref)
                for completion, truth, ref in zip(examples.completions, examples.ground_truths, refs)
            ]
        except RewardFunctionError as exc:
            problems.append(f"{exc} (preflight dry run on the reference answers of data.layout={layout!r})")
            continue
        if all(score == 0 for score in scores):
            key = "sft.verifier" if component.config_key.startswith("sft.verifier") else f"{component.config_key}.name"
            problems.append(
                f"{key}={component.spec.name!r}: scored 0 on all {len(scores)} reference "
                f"answers of the first rows of data.source={cfg.data.source!r} (data.layout={layout!r}, e.g. "
                f"{examples.completions[0][-80:]!r} against ground truth {examples.ground_truths[0]!r}), so it "
                "cannot tell a right answer from a wrong one on this data; choose a reward that fits the layout "
                "(gsm8k: numeric_answer) or its kwargs (e.g. tag), or remove it"
            )
    return problems
