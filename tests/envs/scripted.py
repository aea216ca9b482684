"""A scripted model behind the generation protocol: deterministic turns for environment tests.

`ScriptedEngine(script)` answers every request with `script(prompt_text_so_far, turn, sample_index)`, tokenized
one character per token (token id = code point), each token with logprob -0.5 - 0.01 * position; it records every
generate call (how many prompts, which sampling) so tests can check that episodes advance in batched calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from forge_core.config.schema import SamplingConfig
from forge_core.rollout.types import Prompt, Sample

EOS = 3


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


def prompt(prompt_id: str, text: str, ground_truth: str = "", group_id: int = 0) -> Prompt:
    return Prompt(prompt_id, (1, *encode(text)), ground_truth, group_id, text)


@dataclass
class ScriptedEngine:
    """script(context text, turn, sample index) -> the model's text for that turn (EOS appended)."""

    script: Callable[[str, int, int], str]
    calls: list[tuple[int, int]] = field(default_factory=list)  # (prompts, group_size) per generate call
    policy_version: str = "scripted"
    startup_s: float = 0.0
    reload_s: float = 0.0

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingConfig, seed: int) -> list[Sample]:
        self.calls.append((len(prompts), sampling.group_size))
        samples = []
        for p in prompts:
            turn = p.prompt_id.count("/") and int(p.prompt_id.rsplit("/", 1)[1]) + 1
            for k in range(sampling.group_size):
                index = int(p.prompt_id.split("/")[1]) if "/" in p.prompt_id else k
                text = self.script(decode(p.prompt_ids[1:]), turn, index)[: sampling.max_new_tokens - 1]
                ids = (*encode(text), EOS)
                samples.append(
                    Sample(
                        prompt_id=p.prompt_id.split("/")[0] if "/" not in p.prompt_id else p.prompt_id,
                        group_id=p.group_id,
                        sample_index=k,
                        prompt_ids=tuple(p.prompt_ids),
                        response_ids=ids,
                        response_logprobs=tuple(-0.5 - 0.01 * j for j in range(len(ids))),
                        response_text=text,
                        finish_reason="stop",
                        ground_truth=p.ground_truth,
                    )
                )
        return samples

    def reload(self, policy_dir, policy_version: str) -> float:
        return 0.0

    def close(self) -> None:
        pass
