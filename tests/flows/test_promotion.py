"""Promotion in the retrain flow (flows/retrain.py, flows/promotion.py): compare-and-swap on the pointer, the pointer keyed by run
name and config identity, the incumbent's tokenizer checked against the freshly prepared data's.

The race: two real processes (promoter.py) each read the pointer, as a retrain run does at its start, and only
then are both told to promote their candidate, so both decide against the same version and one of the two
swaps must fail. Which one the OS lets through first varies; the outcome may not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from json_line_process import JsonLineProcess

from flows.promotion import check_same_tokenizer, promote_if_better, promotion_pointer
from forge_core.config import load_config
from forge_core.storage import ObjectStore
from forge_core.storage.generations import GenerationLog

HERE = Path(__file__).resolve().parent
TRIALS = 6


def _promoter(root: str) -> JsonLineProcess:
    return JsonLineProcess([sys.executable, str(HERE / "promoter.py"), root])


def _policy(store: ObjectStore, key: str, accuracy: float, tokenizer: bytes = b'{"vocab": 1}') -> str:
    """A committed grpo artifact with a policy/ (weights + tokenizer) and its held-out accuracy."""
    uri = store.artifact_uri("grpo", key)
    policy = store.writer(store.join(uri, "policy"), kind="policy", stage="grpo")
    policy.write_bytes("model.safetensors", key.encode())
    policy.write_bytes("tokenizer.json", tokenizer)
    policy.commit(config={}, inputs={}, metrics={})
    stage = store.writer(uri, kind="grpo", stage="grpo")
    stage.commit(config={}, inputs={}, metrics={"accuracy": accuracy})
    return uri


def _history(store: ObjectStore, pointer: str) -> list[str]:
    """Every target the pointer ever had, oldest first."""
    log = GenerationLog(store, store.join(store.root, "_pointers", pointer))
    return [json.loads(store.get_bytes(log.generation_uri(n)))["uri"] for n in log.generations()]


def _accuracy(store: ObjectStore, uri: str) -> float:
    return float(store.read_manifest(uri).metrics["accuracy"])


@pytest.mark.integration  # two promoter processes
def test_racing_promotions_end_with_the_better_policy_and_never_step_down(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    incumbent = _policy(store, "incumbent", 0.30)
    first, second = _promoter(store.root), _promoter(store.root)
    promoted_worse_first = 0
    try:
        for trial in range(TRIALS):
            pointer = f"promoted-race-{trial}"
            store.pointer_write(pointer, incumbent, expected_version=0)
            worse, better = _policy(store, f"worse-{trial}", 0.50), _policy(store, f"better-{trial}", 0.70)
            # Alternate which process proposes the better candidate.
            with_worse, with_better = (first, second) if trial % 2 == 0 else (second, first)
            assert with_worse.ask(op="read", pointer=pointer)["version"] == 1
            assert with_better.ask(op="read", pointer=pointer)["version"] == 1
            with_worse.send(op="promote", candidate=worse, accuracy=0.50)
            with_better.send(op="promote", candidate=better, accuracy=0.70)
            worse_result, better_result = with_worse.answer(), with_better.answer()

            assert better_result["promoted"] is True, (trial, better_result)
            assert store.pointer_read(pointer) == better
            history = _history(store, pointer)
            accuracies = [_accuracy(store, uri) for uri in history]
            assert accuracies == sorted(set(accuracies)), (trial, history)  # strictly better at every step
            # The worse one got in only when its swap came first, and was then replaced by the better one.
            assert history in ([incumbent, better], [incumbent, worse, better]), (trial, history)
            assert worse_result["promoted"] == (history == [incumbent, worse, better])
            promoted_worse_first += worse_result["promoted"]
    finally:
        first.close()
        second.close()
    print(f"{TRIALS} racing promotions; the worse candidate's swap came first {promoted_worse_first} times")


def test_a_worse_or_equal_candidate_never_replaces_the_incumbent(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    incumbent = _policy(store, "incumbent", 0.60)
    seen = store.pointer_write("p", incumbent, expected_version=0)
    for key, accuracy in (("worse", 0.40), ("equal", 0.60)):
        decision = promote_if_better(
            store, "p", _policy(store, key, accuracy), accuracy, seen, 0.60, lambda uri: _accuracy(store, uri)
        )
        assert not decision.promoted and decision.incumbent_uri == incumbent
    assert _history(store, "p") == [incumbent]


def test_the_pointer_is_keyed_by_run_name_and_config_identity():
    base = promotion_pointer(load_config(None, []))
    assert base.startswith("promoted-demo-")
    # Candidates trained differently compete for the same pointer...
    assert promotion_pointer(load_config(None, ["seed=3", "grpo.optimizer.lr=0.001", "sft.steps=7"])) == base
    # ...a different architecture, tokenizer, task or eval protocol, or another run name, never does.
    for override in (
        "model.flavor=small",
        "data.tokenizer.vocab_size=96",
        "eval.num_prompts=50",
        "name=other",
    ):
        assert promotion_pointer(load_config(None, [override])) != base, override


def test_an_incumbent_with_another_tokenizer_is_a_clear_error(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")
    data = store.writer(store.artifact_uri("data", "fresh"), kind="data", stage="prepare")
    data.write_bytes("tokenizer/tokenizer.json", b'{"vocab": 1}')
    data.commit(config={}, inputs={}, metrics={})
    check_same_tokenizer(store, _policy(store, "same", 0.5), data.uri)
    with pytest.raises(ValueError, match=r"another tokenizer .*files differ: tokenizer.json.*name=\.\.\."):
        check_same_tokenizer(store, _policy(store, "other", 0.5, tokenizer=b'{"vocab": 2}'), data.uri)
