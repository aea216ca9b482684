"""Validation during SFT and the choice of the weights the stage exports (sft.select, select_metric, patience).

    exact_match = GreedyExactMatch(prompts, references, ground_truths, decode, eos_id, rewards, micro_batch_size=64)
    value = exact_match(trainer)        # collective: every data-parallel rank decodes its share, rank 0 scores
    selection = Selection.from_config(cfg.sft)
    improved = selection.observe({"step": 300, "loss": 0.41, "exact_match": 0.58})
    step, reason = selection.selected(last_step=450)   # (300, "early_stop") | (.., "target") | (.., "best") | (.., "last")

The rows are the `sft.eval_rows` of sft.parquet that SFTData holds out, never the data artifact's eval split:
selecting on that would be selecting on the test set.

Exact match: the trainer's own model decodes each prompt greedily (plain torch, no KV cache, up to the longest
reference completion), and the `sft.verifier` reward function scores it against the ground truth; a
completion passes at PASS_THRESHOLD. Before training the verifier is checked on the reference completions:
one that rejects most of them does not fit the data, and selecting on it would select noise.

Selection state is plain JSON stored in every checkpoint, so a resumed run selects as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from forge_core.config.schema import SFTConfig
from forge_core.engine.distributed import broadcast_object, gather_objects, run_on_rank0
from forge_core.rewards import RewardSet
from forge_core.rollout.table import PASS_THRESHOLD
from forge_core.trainers.base import TitanTrainer

# The verifier must pass at least this share of the reference completions, or it does not fit the data.
MIN_REFERENCE_PASS = 0.5
LOSS, EXACT_MATCH = "loss", "exact_match"


def split_completion(ids: np.ndarray, loss_mask: np.ndarray) -> tuple[list[int], list[int]]:
    """(prompt, reference completion) of an SFT row: the completion is where the loss mask starts."""
    start = int(np.argmax(loss_mask > 0)) if loss_mask.any() else len(ids)
    return ids[:start].tolist(), ids[start:].tolist()


@torch.no_grad()
def greedy_decode(
    trainer: TitanTrainer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int, micro_batch_size: int
) -> list[list[int]]:
    """Collective: greedy completions (ending with EOS when one was produced) of `prompts` by the trainer's
    model, `micro_batch_size` prompts per forward. Every rank must pass as many prompts (same forward count)."""
    trainer.model.eval()
    try:
        out = []
        for start in range(0, len(prompts), micro_batch_size):
            out += _greedy_batch(trainer, prompts[start : start + micro_batch_size], max_new_tokens, eos_id)
        return out
    finally:
        trainer.model.train()


def _greedy_batch(
    trainer: TitanTrainer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int
) -> list[list[int]]:
    device = trainer.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids_BL = torch.zeros(len(prompts), int(lengths.max()) + max_new_tokens, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids_BL[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    rows = torch.arange(len(prompts), device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):  # a fixed count, never an early exit: every rank runs as many forwards
        width = int(lengths.max())
        last_BL = torch.arange(width, device=device)[None, :] == (lengths - 1)[:, None]  # one position a row
        next_B = trainer.logits(ids_BL[:, :width], at_BL=last_BL).argmax(-1)
        active = ~done
        ids_BL[rows[active], lengths[active]] = next_B[active]
        done |= active & (next_B == eos_id)
        lengths = lengths + active.long()
    return [ids_BL[row, len(prompt) : int(lengths[row])].tolist() for row, prompt in enumerate(prompts)]


class GreedyExactMatch:
    """Greedy exact match of the trainer's model on validation prompts, decided by a verifier.

    `decode(token_ids) -> text` is the tokenizer's (special tokens skipped, as vLLM returns text); `rewards`
    holds the verifier as its only component."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        references: Sequence[Sequence[int]],
        ground_truths: Sequence[str],
        decode: Callable[[list[int]], str],
        eos_id: int,
        rewards: RewardSet,
        *,
        micro_batch_size: int,
        max_seq_len: int | None = None,
    ) -> None:
        if not len(prompts) == len(references) == len(ground_truths):
            raise ValueError(
                f"GreedyExactMatch: {len(prompts)} prompts, {len(references)} references and "
                f"{len(ground_truths)} ground truths; pass one of each per validation row"
            )
        self.prompts = [list(p) for p in prompts]
        self.references = [list(r) for r in references]
        self.ground_truths = list(ground_truths)
        self.decode = decode
        self.eos_id = eos_id
        self.rewards = rewards
        self.micro_batch_size = micro_batch_size
        longest = max((len(r) for r in self.references), default=1)
        room = (max_seq_len - max(map(len, self.prompts), default=0)) if max_seq_len else longest
        self.max_new_tokens = max(1, min(longest, room))
        self.reference_pass_rate: float | None = None  # set by check_verifier

    def __call__(self, trainer: TitanTrainer) -> float:
        """Collective: the share of this trainer's greedy completions that pass the verifier (same on every
        rank). Rows are split over data-parallel ranks as the validation loss splits them."""
        degree, rank = trainer.engine.dp_degree, trainer.engine.dp_rank
        usable = len(self.prompts) - len(self.prompts) % degree
        if usable == 0:
            raise ValueError(
                f"sft.eval_rows={len(self.prompts)}: fewer validation rows than the {degree} data-parallel ranks; "
                f"hold out at least {degree}"
            )
        mine = greedy_decode(
            trainer, self.prompts[:usable][rank::degree], self.max_new_tokens, self.eos_id, self.micro_batch_size
        )
        gathered = gather_objects((rank, mine))
        value = run_on_rank0(lambda: self._score(_interleave(gathered, degree, usable)), trainer.engine.dist)
        return float(broadcast_object(value))

    def _score(self, completions: list[list[int]]) -> float:
        texts = [self.decode(_until_eos(ids, self.eos_id)) for ids in completions]
        return self._pass_rate(texts, self.ground_truths[: len(texts)])

    def check_verifier(self, trainer: TitanTrainer) -> float:
        """Collective, before training: the verifier's pass rate on the reference completions; a ValueError
        naming sft.verifier when it passes fewer than MIN_REFERENCE_PASS of them."""
        rate = broadcast_object(run_on_rank0(self._reference_pass_rate, trainer.engine.dist))
        self.reference_pass_rate = float(rate)
        return self.reference_pass_rate

    def _reference_pass_rate(self) -> float:
        texts = [self.decode(_until_eos(ids, self.eos_id)) for ids in self.references]
        rate = self._pass_rate(texts, self.ground_truths)
        if rate < MIN_REFERENCE_PASS:
            (component,) = self.rewards.components
            raise ValueError(
                f"sft.verifier={component.spec.name!r}"
                + (f" with sft.verifier_kwargs={component.kwargs}" if component.kwargs else "")
                + f" passes only {rate:.0%} of the reference "
                f"completions of the {len(texts)} validation rows (e.g. {texts[0][:80]!r} against ground truth "
                f"{self.ground_truths[0][:40]!r}): it does not fit this data. Name the task's verifier (e.g. "
                "numeric_answer for GSM8K-style answers), or set sft.select_metric=loss, sft.verifier=null and sft.target=null"
            )
        return rate

    def _pass_rate(self, texts: list[str], ground_truths: list[str]) -> float:
        refs = [f"validation row {i}" for i in range(len(texts))]
        scored = self.rewards.score(texts, ground_truths, refs)
        passed = [value >= PASS_THRESHOLD for value in scored.columns[self.rewards.primary_column]]
        return sum(passed) / len(passed)


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def _interleave(gathered: list[tuple[int, list]] | None, degree: int, usable: int) -> list:
    """Rank 0: the rows back in validation order from every dp rank's share (row i came from dp rank i % degree)."""
    assert gathered is not None, "only rank 0 interleaves"
    shares = dict(gathered)
    return [shares[i % degree][i // degree] for i in range(usable)]


@dataclass
class Selection:
    """Which validation's weights the stage exports; its state travels in the checkpoints (`state_dict`).

    `observe` takes each validation in step order. Better means a higher exact match (ties broken by a lower
    loss) or, for `metric="loss"`, a lower loss; strictly, so the earliest of equal ones stays the best. With
    `patience`, that many validations in a row without a better one stop the run; with `target`, the first
    validation whose metric reaches it does (`stop_reason`: "patience" | "target")."""

    select: str = "best"
    metric: str = EXACT_MATCH
    patience: int = 0
    target: float | None = None
    curve: list[dict] = field(default_factory=list)
    best_step: int | None = None
    best_key: list[float] | None = None  # what "better" compares (see _key)
    since_best: int = 0
    stop_reason: str | None = None

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> Selection:
        return cls(select=cfg.select, metric=cfg.select_metric, patience=cfg.patience or 0, target=cfg.target)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def observe(self, point: dict) -> bool:
        """Record one validation ({"step", "loss", "exact_match"?}); True when it is the new best."""
        assert not self.curve or point["step"] > self.curve[-1]["step"], "validations come in step order"
        self.curve.append(dict(point))
        key = self._key(point)
        if key is not None and (self.best_key is None or key > self.best_key):
            self.best_step, self.best_key, self.since_best = point["step"], key, 0
            if self.target is not None and key[0] >= (self.target if self.metric == EXACT_MATCH else -self.target):
                self.stop_reason = "target"
            return True
        self.since_best += 1
        if self.patience and self.since_best >= self.patience:
            self.stop_reason = "patience"
        return False

    def _key(self, point: dict) -> list[float] | None:
        """Larger is better: [exact match, -loss] or [-loss]; None when the metric is missing or NaN."""
        loss = point.get(LOSS)
        loss_key = -loss if loss is not None and not math.isnan(loss) else -math.inf
        if self.metric == LOSS:
            return None if loss_key == -math.inf else [loss_key]
        value = point.get(EXACT_MATCH)
        return None if value is None or math.isnan(value) else [value, loss_key]

    @property
    def pinned_step(self) -> int | None:
        """The step whose checkpoint must outlive retention: the best so far, when the best is exported."""
        return self.best_step if self.select == "best" else None

    def selected(self, last_step: int) -> tuple[int, str]:
        """(step whose weights are exported, why): "target" (the validation that reached the target), "last",
        "best" (the best validation) or "early_stop" (the best validation, after patience ran out)."""
        if self.stop_reason == "target":
            return last_step, "target"
        if self.select == "last" or self.best_step is None:
            return last_step, "last"
        return self.best_step, "early_stop" if self.stop_reason == "patience" else "best"

    def point_at(self, step: int) -> dict | None:
        return next((p for p in self.curve if p["step"] == step), None)

    def state_dict(self) -> dict:
        return {
            "curve": self.curve,
            "best_step": self.best_step,
            "best_key": self.best_key,
            "since_best": self.since_best,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict) -> None:
        self.curve = [dict(p) for p in state["curve"]]
        self.best_step, self.best_key = state["best_step"], state["best_key"]
        self.since_best, self.stop_reason = state["since_best"], state["stop_reason"]
