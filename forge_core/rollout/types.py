"""What goes into and comes out of the generator: prompts in, one `Sample` per completion out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One prompt to complete `group_size` times. `prompt_ids` are exactly the tokens the trainer will see;
    `group_id` identifies the prompt's group of samples within a rollout batch."""

    prompt_id: str
    prompt_ids: tuple[int, ...]
    ground_truth: str
    group_id: int
    text: str = ""


@dataclass(frozen=True)
class Sample:
    """One completion. `response_logprobs[j]` is the log-probability of `response_ids[j]` from the raw logits
    (before temperature/top-k/top-p), as the trainer recomputes it; `finish_reason` is "stop" or "length"."""

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


@dataclass(frozen=True)
class TurnRecord:
    """One turn of an episode, role "model" or "env"; `start`/`end` index the episode's `response_ids`; an env
    turn's `tool`, `latency_s` and `error` describe the tool call it answers."""

    turn: int  # 0-based model turn this record belongs to (an observation follows its model turn)
    role: str  # "model" or "env"
    text: str
    start: int
    end: int
    tool: str = ""
    latency_s: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Episode(Sample):
    """A multi-turn episode as one sample: `response_ids` interleaves model and environment tokens after the
    first prompt, `response_mask[j]` is 1 on model tokens (environment tokens have logprob 0.0 and never carry
    loss), `response_text` is the model's text of every turn. `end_reason` is "env", "turn_limit" or
    "token_limit"; a limit ending has finish_reason "length", an "env" one keeps its last turn's."""

    response_mask: tuple[int, ...] = ()
    turns: tuple[TurnRecord, ...] = ()
    end_reason: str = "env"
    env_reward: float | None = None  # the environment's own reward, when it gives one
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0

    @property
    def num_turns(self) -> int:
        return sum(1 for t in self.turns if t.role == "model")

    @property
    def model_tokens(self) -> int:
        return int(sum(self.response_mask))
