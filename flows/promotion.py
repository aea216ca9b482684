"""Promoting a retrained policy: the shared pointer, the tokenizer check and the compare-and-swap decision.
No Prefect here, so any process can decide.

    pointer = promotion_pointer(cfg)                        # promoted-<run name>-<config identity>
    seen = store.pointer_state(pointer)                     # at the start of a run
    check_same_tokenizer(store, seen.uri, data_uri)         # before scoring the incumbent on new data
    decision = promote_if_better(store, pointer, candidate_uri, accuracy, seen, seen_accuracy, accuracy_of)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from forge_core.artifacts.policy import POLICY_DIR
from forge_core.config import RunConfig, select_sections
from forge_core.storage import ObjectStore, PointerConflict, PointerState, canonical_json

# What a promoted policy is comparable on: its architecture (model), its task, tokenizer and held-out split
# (data), and how it is scored (eval). Seeds and training hyper-parameters may differ between candidates.
PROMOTION_IDENTITY_SECTIONS = ("model", "data", "eval")
TOKENIZER_DIR = "tokenizer"  # in a data artifact (forge_core.data.schemas.TOKENIZER_DIR)


def promotion_pointer(cfg: RunConfig) -> str:
    """`promoted-<run name>-<12 hex of the config identity>` (PROMOTION_IDENTITY_SECTIONS)."""
    identity = canonical_json(select_sections(cfg, PROMOTION_IDENTITY_SECTIONS))
    return f"promoted-{cfg.name}-{hashlib.sha256(identity.encode('ascii')).hexdigest()[:12]}"


def check_same_tokenizer(store: ObjectStore, stage_uri: str, data_uri: str) -> None:
    """ValueError unless the policy of `stage_uri` carries the tokenizer of the data artifact `data_uri`
    (every shared tokenizer file equal by sha256)."""
    policy = store.read_manifest(store.join(stage_uri, POLICY_DIR)).files
    prefix = TOKENIZER_DIR + "/"
    data = {
        rel[len(prefix) :]: entry
        for rel, entry in store.read_manifest(data_uri).files.items()
        if rel.startswith(prefix)
    }
    shared = sorted(set(policy) & set(data))
    differ = [name for name in shared if policy[name].sha256 != data[name].sha256]
    if not shared or differ:
        raise ValueError(
            f"promoted policy {stage_uri} was trained with another tokenizer than the data prepared now "
            f"({data_uri}): {'files differ: ' + ', '.join(differ) if differ else 'no tokenizer file in common'}; "
            "its accuracy on these token ids would mean nothing. Keep data.tokenizer as the promoted policy's, "
            "or start a new line of runs under another run name (name=...)"
        )


@dataclass(frozen=True)
class Promotion:
    """Whether this call moved the pointer, the incumbent last compared with, and the pointer's state after."""

    promoted: bool
    incumbent_uri: str | None
    incumbent_accuracy: float | None
    pointer: PointerState


def promote_if_better(
    store: ObjectStore,
    pointer: str,
    candidate_uri: str,
    candidate_accuracy: float,
    incumbent: PointerState,
    incumbent_accuracy: float | None,
    accuracy_of: Callable[[str], float],
) -> Promotion:
    """Point `pointer` at the candidate if it beats `incumbent` (read and scored before training), by
    compare-and-swap; ties keep the incumbent. A pointer moved meanwhile is rescored with `accuracy_of`."""


    while True:
        if incumbent.uri == candidate_uri:  # another run of this config promoted the very same artifact
            return Promotion(False, incumbent.uri, incumbent_accuracy, incumbent)
        if incumbent.uri is not None and not candidate_accuracy > incumbent_accuracy:
            return Promotion(False, incumbent.uri, incumbent_accuracy, incumbent)
        try:
            after = store.pointer_write(pointer, candidate_uri, expected_version=incumbent.version)
        except PointerConflict as conflict:
            incumbent = conflict.current
            incumbent_accuracy = accuracy_of(incumbent.uri) if incumbent.uri is not None else None
            continue
        return Promotion(True, incumbent.uri, incumbent_accuracy, after)
