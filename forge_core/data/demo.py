"""The built-in verifiable task: zero-padded multi-digit addition.

A record is `Q: 123+045=? A: ` -> `<answer>0168</answer>`: both operands have `num_digits` digits, the sum
has `num_digits + 1`, all zero-padded, so every answer of a difficulty has the same length and a reward can
check it exactly (`check_answer`) or digit by digit (`per_digit_score`). The answer sits in a tag so a format
reward (`has_answer_tag`) measures something real. The demo's budgets (docs/getting-started.md, "Does it learn?") rest on what
was measured with this format and the demo's BPE: at 2 digits, SFT of the tiny model on 1000 labels sometimes
only memorises them (~10% held out) and on 1500 labels jumps to 30-75% after 300-450 steps; at 3 digits, 1000
labels give 1-2% on every seed tried.

This module is dependency-free (standard library only) so reward functions can import it anywhere:

    from forge_core.data.demo import check_answer, extract_answer
    check_answer("<answer>0168</answer>", "0168")  # True
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
SOURCE_NAME = "demo:addition"
# Every character a prompt or completion can contain: the tokenizer keeps all of them even if unseen.
ALPHABET = "0123456789Q: +=?A" + ANSWER_OPEN + ANSWER_CLOSE
SPLITS = ("eval", "sft", "rl")

_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class AdditionExample:
    a: int
    b: int
    num_digits: int

    @property
    def prompt(self) -> str:
        d = self.num_digits
        return f"Q: {self.a:0{d}d}+{self.b:0{d}d}=? A: "

    @property
    def ground_truth(self) -> str:
        return f"{self.a + self.b:0{self.num_digits + 1}d}"

    @property
    def completion(self) -> str:
        return f"{ANSWER_OPEN}{self.ground_truth}{ANSWER_CLOSE}"


def extract_answer(text: str) -> str | None:
    """The stripped content of the first `<answer>...</answer>` tag in `text`, or None when there is none."""
    match = _ANSWER_RE.search(text)
    return match.group(1).strip() if match else None


def has_answer_tag(text: str) -> bool:
    """True when `text` contains a closed answer tag (the format reward)."""
    return extract_answer(text) is not None


def check_answer(completion_text: str, ground_truth: str) -> bool:
    """Exact match of the tagged answer against the ground truth (zero padding included)."""
    answer = extract_answer(completion_text)
    return answer is not None and answer == ground_truth.strip()


def per_digit_score(completion_text: str, ground_truth: str) -> float:
    """Share of ground-truth digit positions that the tagged answer gets right, in [0, 1].

    Positions are compared left to right; a missing tag scores 0 and a too-long answer is penalised by
    dividing by the longer of the two lengths, so only the exact answer scores 1.
    """
    answer = extract_answer(completion_text)
    truth = ground_truth.strip()
    if answer is None or not truth:
        return 0.0
    matches = sum(1 for x, y in zip(answer, truth) if x == y)
    return matches / max(len(answer), len(truth))


def num_pairs(num_digits: int) -> int:
    """How many distinct operand pairs exist at this difficulty."""
    return 10 ** (2 * num_digits)


def generate_splits(
    num_digits: int, num_sft: int, num_rl: int, num_eval: int, seed: int
) -> dict[str, list[AdditionExample]]:
    """Disjoint `eval`, `sft` and `rl` splits of distinct operand pairs, deterministic in `seed`.

    Pairs are drawn one by one without replacement and handed out eval first, then sft, then rl, so the
    held-out eval set stays the same when only `num_sft` or `num_rl` change.
    """
    wanted = {"eval": num_eval, "sft": num_sft, "rl": num_rl}
    total = num_eval + num_sft + num_rl
    space = num_pairs(num_digits)
    if total > space:
        raise ValueError(
            f"data.demo: num_eval + num_sft + num_rl = {total} exceeds the {space} distinct pairs of "
            f"{num_digits}-digit addition; raise data.demo.num_digits or lower the split sizes"
        )
    rng = random.Random(f"forgeflow-demo-addition:{seed}:{num_digits}")
    modulus = 10**num_digits
    seen: set[int] = set()
    splits: dict[str, list[AdditionExample]] = {}
    for split in SPLITS:
        examples = []
        while len(examples) < wanted[split]:
            pair = rng.randrange(space)
            if pair in seen:
                continue
            seen.add(pair)
            examples.append(AdditionExample(pair // modulus, pair % modulus, num_digits))
        splits[split] = examples
    return splits
