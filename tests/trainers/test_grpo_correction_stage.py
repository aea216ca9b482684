"""The GRPO stage with a mismatch correction in async mode (`python -m forge_core.run grpo` in this process):
rollouts sampled by the SFT policy train the next (GRPO) policy, one update later. The stage must score the
rows with the weights that sampled them, swapped in for the extra forward (and the input policy's restored
for training), take the ratio against those logprobs, and record the mismatch in every step and in its
manifest. The KL reference is the same SFT policy, so it is scored once with the sampler."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from grpo_helpers import (
    demo_tokenizer,
    grpo_spec,
    grpo_test_config,
    intra_op_threads,
    plain_policy,
    read_policy_weights,
    rollout_table,
    write_policy_artifact,
    write_rollouts_artifact,
)

from forge_core.engine import destroy_distributed
from forge_core.models import model_logprobs
from forge_core.run.scaffold import run_spec
from forge_core.run.spec import read_spec
from forge_core.storage import ObjectStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-correction")
    cfg = grpo_test_config(
        tmp, "grpo.mode=async", "grpo.max_staleness=1", "grpo.correction.type=tis", "grpo.correction.tis_cap=2.0",
        "grpo.loss.kl_coef=0.05", "grpo.epochs=1",
        "grpo.optimizer_state=fresh",  # the parent below is written by hand: it has no AdamW state to go on with
    )
    store = ObjectStore.from_config(cfg.storage)
    tokenizer = demo_tokenizer(tmp)
    vocab = tokenizer.vocab_size
    sampler = plain_policy(cfg, vocab, seed=3)
    sft_uri = write_policy_artifact(
        store, store.artifact_uri("sft", "sampler"), cfg, vocab, sampler.state_dict(), tmp / "tokenizer"
    )
    torch.manual_seed(0)
    newer = {k: v + 0.05 * torch.randn_like(v) for k, v in sampler.state_dict().items()}  # one update later
    parent_uri = write_policy_artifact(
        store, store.artifact_uri("grpo", "parent"), cfg, vocab, newer, tmp / "tokenizer", kind="grpo"
    )
    table = rollout_table(sampler, tokenizer, store.join(sft_uri, "policy"))
    n = table.num_rows
    table = table.append_column("iteration", pa.array([1] * n, pa.int32())).append_column(
        "policy_iteration", pa.array([0] * n, pa.int32())
    )
    rollouts_uri = write_rollouts_artifact(store, store.artifact_uri("rollouts", "stale"), table)
    output = store.artifact_uri("grpo", "corrected")
    spec_uri = grpo_spec(cfg, store, output, {"policy": parent_uri, "rollouts": rollouts_uri, "reference": sft_uri},
                         iteration=1)
    try:
        with intra_op_threads(1):
            run_spec(read_spec(spec_uri))
    finally:
        destroy_distributed()
    summary = store.reader(output).read_json("train_summary.json")
    return {
        "cfg": cfg, "store": store, "tmp": tmp, "vocab": vocab, "table": table, "sampler": sampler,
        "newer": newer, "sft_uri": sft_uri, "parent_uri": parent_uri, "output": output,
        "manifest": store.read_manifest(output), "steps": summary["steps"],
    }


def test_stale_rows_are_scored_with_the_weights_that_sampled_them(stage):
    metrics = stage["manifest"].metrics
    assert metrics["correction"] == "tis"
    assert metrics["sampler_uris"] == [stage["sft_uri"]]
    assert metrics["rollout/staleness_max"] == 1.0 and metrics["rollout/sampled_by_input_policy"] == 0.0
    # The generator logprobs came from the SFT weights (an unpadded forward): the trainer's scores under the
    # sampler's weights agree to fp32 noise. Under the input policy's weights they would be far off.
    assert metrics["mismatch/logprob_diff_max"] < 1e-5
    assert metrics["mismatch/kl_k3"] < 1e-9
    assert metrics["mismatch/seq_ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["mismatch/seq_ratio_p95"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["correction/truncated_token_frac"] == 0.0 and metrics["correction/masked_seq_frac"] == 0.0
    table, newer = stage["table"], plain_policy(stage["cfg"], stage["vocab"], state_dict=stage["newer"])
    prompt, response = table.column("prompt_ids")[0].as_py(), table.column("response_ids")[0].as_py()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        under_input = model_logprobs(newer, ids[:, :-1], ids[:, 1:])[0, len(prompt) - 1 :]
    stored = torch.tensor(table.column("response_logprobs")[0].as_py())
    assert (under_input - stored).abs().max() > 1e-2, "the input policy must differ for this check to bite"


def test_the_ratio_is_against_the_sampler_and_the_input_policy_is_what_trains(stage):
    first = stage["steps"][0]
    # The input policy (one update later) trains: its ratio against the sampler's logprobs is off 1, and the
    # KL to the reference (= the sampler) is positive from the first step.
    assert abs(first["policy/ratio_mean"] - 1.0) > 1e-3
    assert first["policy/kl"] > 1e-5
    for key in ("mismatch/logprob_diff_mean", "mismatch/kl_k3", "correction/truncated_token_frac",
                "correction/masked_seq_frac"):
        assert key in first, key
    trained = read_policy_weights(stage["store"], stage["output"], stage["tmp"] / "trained")
    parent = read_policy_weights(stage["store"], stage["parent_uri"], stage["tmp"] / "parent")
    assert all(trained[k].shape == parent[k].shape for k in parent)
    # Trained from the parent (the swap restored it): each update is small next to the parent-sampler gap.
    sft = stage["sampler"].state_dict()
    key = "tok_embeddings.weight"
    assert (trained[key] - parent[key]).norm() < (parent[key] - sft[key]).norm()
    assert not torch.equal(trained[key], parent[key])
