"""Multi-turn SFT traces: a completion made of model turns and environment observations, trained on the model's
tokens only.

A trace completion is one string of segments joined by TURN_SEPARATOR, alternating model turn and
observation, starting and ending with a model turn:

    completion = join_trace(["<calculator>12*34</calculator>", "<result>408</result>", "<answer>408</answer>"])

Each segment is tokenized on its own, as a multi-turn rollout builds its tokens; every model turn ends with
EOS. A completion without the separator is a single-turn completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TURN_SEPARATOR = "\x1e"


def join_trace(segments: Sequence[str]) -> str:
    """One completion string from model/observation segments (model first and last); ValueError otherwise."""

    if len(segments) % 2 == 0:
        raise ValueError(f"a trace alternates model turns and observations and ends with a model turn: {segments!r}")
    if any(TURN_SEPARATOR in segment for segment in segments):
        raise ValueError("a trace segment may not contain the turn separator \\x1e")
    return TURN_SEPARATOR.join(segments)


def trace_segments(completion: str) -> list[str]:
    """The segments of a trace completion (one segment for a single-turn completion)."""
    return completion.split(TURN_SEPARATOR)


def is_trace(completion: str) -> bool:
    return TURN_SEPARATOR in completion


def encode_trace(
    completion: str, encode: Callable[[list[str]], list[list[int]]], end_model_turn: Callable[[list[int]], list[int]]
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a trace completion: segments encoded one by one, each model turn ended by
    `end_model_turn` (EOS), mask 1 on model tokens, 0 on observation tokens."""
    segments = trace_segments(completion)
    ids: list[int] = []
    mask: list[int] = []
    for index, segment_ids in enumerate(encode(segments)):
        model_turn = index % 2 == 0
        if model_turn:
            segment_ids = end_model_turn(list(segment_ids))
        ids += segment_ids
        mask += [1 if model_turn else 0] * len(segment_ids)
    return ids, mask
