"""The built-in verifiable task: zero-padded multi-digit addition.

A record is `Q: 123+045=? A: ` -> `<answer>0168</answer>`: operands have `num_digits` digits, the sum
`num_digits + 1`, all zero-padded, so a reward can check it exactly (`check_answer`) or digit by digit
(`per_digit_score`). The answer sits in a tag so a format reward (`has_answer_tag`) measures something real.

Standard library only, so reward functions can import it anywhere:

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
    """Share of digit positions, left to right, that the tagged answer gets right, in [0, 1]; divided by the
    longer length, so only the exact answer scores 1. A missing tag scores 0."""
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
    """Disjoint splits of distinct operand pairs, deterministic in `seed`; eval is drawn first, so it stays the
    same when only `num_sft` or `num_rl` change. ValueError when the sizes exceed the distinct pairs."""


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
