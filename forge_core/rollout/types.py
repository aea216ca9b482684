"""What goes into and comes out of the generator: prompts in, one `Sample` per completion out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One prompt to complete `group_size` times.

    `prompt_ids` are the tokens the model conditions on, exactly as the trainer will see them (the data
    stage tokenized them), so generator and trainer score the same sequence. `group_id` identifies this
    prompt's group of samples within a rollout batch.
    """

    prompt_id: str
    prompt_ids: tuple[int, ...]
    ground_truth: str
    group_id: int
    text: str = ""


@dataclass(frozen=True)
class Sample:
    """One completion and what vLLM computed for it.

    `response_logprobs[j]` is the generator's log-probability of `response_ids[j]` (from the raw logits,
    before temperature/top-k/top-p: vLLM's `raw_logprobs` mode, which is what the trainer recomputes).
    `finish_reason` is "stop" (EOS or a stop string) or "length" (hit max new tokens).
    """

    prompt_id: str
    group_id: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    response_text: str
    finish_reason: str
    ground_truth: str

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def ref(self) -> str:
        """How error messages name this sample."""
        return f"prompt_id={self.prompt_id} group_id={self.group_id} sample_index={self.sample_index}"
