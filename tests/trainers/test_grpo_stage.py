"""The GRPO stage end to end (`python -m forge_core.run grpo --spec ...`): real torchrun ranks over gloo, a
committed sft policy and rollout artifact on a local object store, the KL term on (reference = the sft
policy, scored by the engine before training), 4 optimizer steps (2 epochs x 2 mini-batches).

- data parallel: 1 rank (4 micro-batches per step, in this process) and 2 torchrun ranks (2 each) give the
  same update;
- exact resume: a stage that fails after step 3 is retried, resumes from step 2's checkpoint and ends
  bit-identical to the uninterrupted run (every step's metrics and the weights). Killed ranks under torchrun
  and the launcher's retry are the fault-tolerance suite's subject; the checkpoint content is the same;
- the committed artifact carries lineage, the required metrics and a loadable policy.
"""

from __future__ import annotations

import time
from pathlib import Path

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
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from forge_core.batch import plan_minibatches
from forge_core.engine import (
    CheckpointRef,
    Engine,
    checkpoint_uri,
    committed_checkpoints,
    destroy_distributed,
    load_components,
)
from forge_core.faults import FAULT_ENV, InjectedFault
from forge_core.launch import LaunchSpec, Outcome, launch
from forge_core.models import model_logprobs
from forge_core.run.grpo import plan_seed
from forge_core.run.scaffold import HeldPolicy, run_spec
from forge_core.run.spec import read_spec
from forge_core.storage import ObjectStore
from forge_core.trainers.grpo import rollouts_to_rl_batch

pytestmark = pytest.mark.integration

STEPS = 4
REQUIRED_METRICS = (
    "reward/mean", "reward/std", "advantage/mean", "advantage/std", "policy/loss", "policy/kl",
    "policy/clip_low_frac", "policy/clip_high_frac", "policy/ratio_mean", "policy/ratio_max", "policy/entropy",
    "generator_gap/mean", "generator_gap/max", "grad_norm", "tokens_per_s", "train/time_s", "train/fit_s",
    "mismatch/logprob_diff_mean", "mismatch/logprob_diff_max", "mismatch/kl_k3", "mismatch/seq_ratio_p05",
    "mismatch/seq_ratio_p50", "mismatch/seq_ratio_p95", "correction/masked_token_frac",
    "correction/truncated_seq_frac", "train/score_logprobs_s",
)


class Setup:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.cfg = grpo_test_config(
            tmp_path, "grpo.loss.kl_coef=0.05", "grpo.checkpoint_every=2", "grpo.correction.measure_mismatch=true"
        )
        self.store = ObjectStore.from_config(self.cfg.storage)
        tokenizer = demo_tokenizer(tmp_path)
        policy = plain_policy(self.cfg, tokenizer.vocab_size, seed=3)
        self.policy_uri = write_policy_artifact(
            self.store, self.store.artifact_uri("sft", "parent"), self.cfg, tokenizer.vocab_size,
            policy.state_dict(), tmp_path / "tokenizer",
        )
        table = rollout_table(policy, tokenizer, self.policy_uri)
        self.rollouts_uri = write_rollouts_artifact(self.store, self.store.artifact_uri("rollouts", "r0"), table)
        self.inputs = {"policy": self.policy_uri, "rollouts": self.rollouts_uri}

    def spec_uri(self, name: str) -> str:
        return grpo_spec(self.cfg, self.store, self.store.artifact_uri("grpo", name), self.inputs)

    def run_torchrun(self, name: str, nproc: int, env: dict | None = None):
        spec = LaunchSpec(
            "forge_core.run", ["grpo", "--spec", self.spec_uri(name)], nproc_per_node=nproc, env=env or {},
            deadline_s=300,
        )
        start = time.monotonic()
        return launch(spec, log=lambda line: print(f"[{time.monotonic() - start:6.1f}s] {line}"))

    def run_in_process(self, name: str, cfg=None) -> None:
        """The stage as one plain process (world size 1): here, in the test process (`cfg`: another config)."""
        spec_uri = grpo_spec(cfg or self.cfg, self.store, self.store.artifact_uri("grpo", name), self.inputs)
        try:
            with intra_op_threads(1):
                run_spec(read_spec(spec_uri))
        finally:
            destroy_distributed()

    def summary(self, name: str) -> dict:
        return self.store.reader(self.store.artifact_uri("grpo", name)).read_json("train_summary.json")

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return read_policy_weights(self.store, self.store.artifact_uri("grpo", name), self.tmp / f"w-{name}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(tmp_path_factory.mktemp("grpo-stage"))
    result = s.run_torchrun("two-ranks", nproc=2)
    assert result.outcome is Outcome.SUCCESS, (result.reason, result.tail[-30:])
    s.run_in_process("one-rank")
    return s


def test_stage_commits_policy_with_lineage_and_metrics(setup):
    uri = setup.store.artifact_uri("grpo", "two-ranks")
    manifest = setup.store.read_manifest(uri)
    assert manifest.kind == "grpo"
    assert {k: v.uri for k, v in manifest.inputs.items()} == {
        "policy": setup.policy_uri, "rollouts": setup.rollouts_uri, "reference": setup.policy_uri,
    }
    assert manifest.config["grpo"]["loss"]["kl_coef"] == 0.05
    missing = [k for k in REQUIRED_METRICS if k not in manifest.metrics]
    assert not missing, missing
    assert manifest.metrics["train/steps"] == STEPS and manifest.metrics["world_size"] == 2
    # Reference = the starting policy: the first step's KL is 0 and its ratio 1 up to fp32 noise (the
    # generator was a plain unpadded forward of the same weights).
    first = setup.summary("two-ranks")["steps"][0]
    assert first["policy/kl"] == pytest.approx(0.0, abs=1e-9)
    assert manifest.metrics["generator_gap/max"] < 1e-5
    # Sync: the extra forward scores the rows with the input policy's weights (the sampler's), on two ranks
    # that each score half and all-gather: trainer and sampler agree up to fp32 noise, on every row.
    assert manifest.metrics["mismatch/logprob_diff_max"] < 1e-5
    assert manifest.metrics["mismatch/seq_ratio_p50"] == pytest.approx(1.0, abs=1e-5)
    assert first["mismatch/logprob_diff_max"] < 1e-5 and manifest.metrics["correction"] == "none"
    # Later steps are off-policy against the stored generator logprobs: the ratio moves away from 1.
    assert manifest.metrics["policy/ratio_max"] > 1.0
    # Step 2 (checkpoint_every) and the last step's (grpo.optimizer_state=carry: the next iteration's AdamW).
    assert [ref.step for ref in committed_checkpoints(setup.store, uri)] == [4, 2]
    assert manifest.metrics["optimizer/state_step"] == STEPS and manifest.metrics["optimizer_init"] == "fresh"
    assert manifest.metrics["optimizer/adam_steps"] == STEPS  # an SFT input policy: a new AdamW
    assert setup.store.is_committed(setup.store.join(uri, "policy"))
    trained = setup.weights("two-ranks")
    start = read_policy_weights(setup.store, setup.policy_uri, setup.tmp / "w-parent")
    assert any(not torch.equal(trained[k], start[k]) for k in start)


def test_one_rank_and_two_ranks_give_the_same_update(setup):
    one, two = setup.summary("one-rank")["steps"], setup.summary("two-ranks")["steps"]
    for a, b in zip(one, two, strict=True):
        # Losses are sums over micro-batches (4 on one rank, 2 + 2 on two) in another order: fp32 rounding.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    w1, w2 = setup.weights("one-rank"), setup.weights("two-ranks")
    start = read_policy_weights(setup.store, setup.policy_uri, setup.tmp / "w-parent-2")
    # Per tensor: |update(1 rank) - update(2 ranks)| / |update(1 rank)| (Frobenius norms) after 4 AdamW steps.
    # Measured <= 6.6e-6 (fp32 reduction order; AdamW's per-element normalisation amplifies the rounding of
    # near-zero gradient entries, so single elements differ by up to ~5e-4 of the largest update).
    worst = max(((w1[k] - w2[k]).norm() / (w1[k] - start[k]).norm().clamp(min=1e-12)).item() for k in w1)
    print(f"1 vs 2 ranks: max relative update difference {worst:.3e}")
    assert worst < 1e-4, worst


def test_without_a_correction_the_sampler_scoring_is_skipped_and_the_update_is_the_same(setup):
    """With correction none the loss never reads the old logprobs: unless asked to measure the mismatch, the
    stage skips that forward, and trains exactly as the measuring run did."""
    cfg = grpo_test_config(setup.tmp, "grpo.loss.kl_coef=0.05", "grpo.checkpoint_every=2", "grpo.optimizer_state=fresh")
    setup.run_in_process("unmeasured", cfg)
    measured = setup.store.read_manifest(setup.store.artifact_uri("grpo", "one-rank")).metrics
    unmeasured = setup.store.read_manifest(setup.store.artifact_uri("grpo", "unmeasured")).metrics
    assert "mismatch/logprob_diff_max" in measured
    assert not [k for k in unmeasured if k.startswith(("mismatch/", "correction/"))], unmeasured
    assert unmeasured["generator_gap/max"] == measured["generator_gap/max"]  # from the first step, either way
    for metrics in (measured, unmeasured):
        assert {"phase/load_s", "phase/score_s", "phase/steps_s", "phase/export_s"} <= set(metrics), metrics
        assert 0 < metrics["phase/commit_s"] <= metrics["phase/export_s"]
    untimed = ("step_time_s", "tokens_per_s")
    steps = [setup.summary(name)["steps"] for name in ("one-rank", "unmeasured")]
    unmeasured_keys = ("mismatch/", "correction/")
    assert [{k: v for k, v in m.items() if k not in untimed and not k.startswith(unmeasured_keys)} for m in steps[0]] == [
        {k: v for k, v in m.items() if k not in untimed} for m in steps[1]
    ]
    w_measured, w_unmeasured = setup.weights("one-rank"), setup.weights("unmeasured")
    assert all(torch.equal(w_measured[k], w_unmeasured[k]) for k in w_measured)
    # optimizer_state=fresh (on an SFT input both start a new AdamW): no optimizer state is committed, so a
    # stage that would carry it on from this policy is refused before it builds anything.
    unmeasured_uri = setup.store.artifact_uri("grpo", "unmeasured")
    assert [ref.step for ref in committed_checkpoints(setup.store, unmeasured_uri)] == [2]
    assert "optimizer/state_step" not in unmeasured
    spec_uri = grpo_spec(
        setup.cfg, setup.store, setup.store.artifact_uri("grpo", "on-fresh"), {**setup.inputs, "policy": unmeasured_uri}
    )
    with pytest.raises(ValueError, match=r"grpo.optimizer_state=carry: inputs.policy=.*unmeasured committed no "
                                         r"optimizer state.*set grpo.optimizer_state=fresh"):
        run_spec(read_spec(spec_uri))


def test_interrupted_stage_resumes_mid_stage_exactly(setup, monkeypatch):
    # The stage fails right after optimizer step 3, before its checkpoint: the retry resumes from step 2.
    monkeypatch.setenv(FAULT_ENV, "raise_rank:0:3")
    with pytest.raises(InjectedFault):
        setup.run_in_process("resumed")
    uri = setup.store.artifact_uri("grpo", "resumed")
    assert not setup.store.is_committed(uri)
    assert [ref.step for ref in committed_checkpoints(setup.store, uri)] == [2]

    monkeypatch.delenv(FAULT_ENV)
    setup.run_in_process("resumed")
    assert setup.store.read_manifest(uri).metrics["resumed_from_step"] == 2
    resumed, uninterrupted = setup.summary("resumed"), setup.summary("one-rank")
    timing = ("step_time_s", "tokens_per_s")
    assert [{k: v for k, v in m.items() if k not in timing} for m in resumed["steps"]] == [
        {k: v for k, v in m.items() if k not in timing} for m in uninterrupted["steps"]
    ]
    w_resumed, w_straight = setup.weights("resumed"), setup.weights("one-rank")
    assert all(torch.equal(w_resumed[k], w_straight[k]) for k in w_straight)


def test_stage_on_a_grpo_parent_scores_the_kl_against_the_sft_root(setup):
    """The policy input is a grpo artifact: the reference comes from its lineage (the sft root), is swapped
    into the engine to score the rollouts, and the policy's own weights are restored before training, so
    the first step's KL is KL(grpo policy || sft policy) on that step's rows."""
    parent = setup.store.artifact_uri("grpo", "one-rank")
    inputs = {"policy": parent, "rollouts": setup.rollouts_uri}
    output = setup.store.artifact_uri("grpo", "second")
    spec_uri = grpo_spec(setup.cfg, setup.store, output, inputs, iteration=1)
    try:
        with intra_op_threads(1):
            run_spec(read_spec(spec_uri))
    finally:
        destroy_distributed()
    manifest = setup.store.read_manifest(output)
    assert manifest.inputs["reference"].uri == setup.policy_uri
    # AdamW went on from the parent's committed final state: its step counts continue from the parent's.
    parent_metrics = setup.store.read_manifest(parent).metrics
    assert manifest.metrics["optimizer_init"] == "checkpoint"
    assert manifest.metrics["optimizer/adam_steps"] == parent_metrics["optimizer/adam_steps"] + manifest.metrics["train/steps"]
    assert manifest.metrics["rollout/sampled_by_input_policy"] == 0.0

    table = setup.store.reader(setup.rollouts_uri).read_table("rollouts.parquet")
    policy = _plain_from(setup, setup.weights("one-rank"))
    reference = _plain_from(setup, read_policy_weights(setup.store, setup.policy_uri, setup.tmp / "w-ref"))
    first_rows = plan_minibatches(
        table.num_rows, setup.cfg.grpo.mini_batch_size, setup.cfg.grpo.mini_batch_size, setup.cfg.grpo.epochs,
        seed=plan_seed(setup.cfg.seed, 1),
    )[0].micro_rows[0].tolist()
    carries_loss_B = rollouts_to_rl_batch(table, setup.cfg.grpo.advantage).batch.loss_mask_BL.any(dim=1)
    kept = set(torch.nonzero(carries_loss_B).flatten().tolist())
    kl_sum, tokens = 0.0, 0
    for i in (r for r in first_rows if r in kept):
        prompt, response = table.column("prompt_ids")[i].as_py(), table.column("response_ids")[i].as_py()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = model_logprobs(policy, ids[:, :-1], ids[:, 1:])[0, len(prompt) - 1 :]
            ref = model_logprobs(reference, ids[:, :-1], ids[:, 1:])[0, len(prompt) - 1 :]
        delta = ref - logp
        kl_sum += float((torch.exp(delta) - delta - 1).sum())
        tokens += len(response)
    first = setup.store.reader(output).read_json("train_summary.json")["steps"][0]
    assert kl_sum / tokens > 1e-4, "the policy must have moved away from the reference for this check to bite"
    assert first["policy/kl"] == pytest.approx(kl_sum / tokens, rel=1e-3)


def _plain_from(setup, weights: dict) -> torch.nn.Module:
    return plain_policy(setup.cfg, weights["tok_embeddings.weight"].shape[0], state_dict=weights)


def test_one_rank_goes_on_with_the_optimizer_state_two_ranks_committed(setup, tmp_path):
    """DCP reshards the carried AdamW state to another world size: each of the two FSDP ranks committed its shard
    of every moment; one rank loads them whole (bitwise the two ranks' moments, unsharded) and a stage on one
    rank goes on from them."""
    parent = setup.store.artifact_uri("grpo", "two-ranks")
    step = int(setup.store.read_manifest(parent).metrics["optimizer/state_step"])
    ref = CheckpointRef(step=step, uri=checkpoint_uri(setup.store, parent, step))
    folder = tmp_path / "two-ranks-state.pt"
    dcp_to_torch_save(Path(setup.store.local_path(setup.store.reader(ref.uri).file_uri(".metadata"))).parent, folder)
    saved = torch.load(folder, weights_only=False)["optimizer"]
    vocab = setup.weights("two-ranks")["tok_embeddings.weight"].shape[0]
    engine = Engine.Config.from_run_config(setup.cfg, vocab, setup.cfg.grpo.optimizer, total_steps=STEPS).build()
    load_components(setup.store, ref, {"optimizer": engine.optimizers}, engine.dist)
    loaded = engine.optimizers.state_dict()
    moments = [k for k in saved if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert len(moments) == 2 * len(list(engine.model.parameters())), sorted(saved)[:6]
    assert all(torch.equal(loaded[k].full_tensor() if hasattr(loaded[k], "full_tensor") else loaded[k], saved[k])
               for k in moments)  # fmt: skip
    assert any(saved[k].abs().max() > 0 for k in moments)

    output = setup.store.artifact_uri("grpo", "one-rank-after-two")
    spec_uri = grpo_spec(setup.cfg, setup.store, output, {"policy": parent, "rollouts": setup.rollouts_uri}, iteration=1)
    try:
        with intra_op_threads(1):
            run_spec(read_spec(spec_uri))
    finally:
        destroy_distributed()
    metrics = setup.store.read_manifest(output).metrics
    assert metrics["world_size"] == 1 and metrics["optimizer_init"] == "checkpoint"
    assert metrics["optimizer/adam_steps"] == step + metrics["train/steps"]


def test_a_lost_final_state_is_rebuilt_by_training_its_stage_again(setup):
    """A trainer group that ends while it writes a stage's final AdamW state behind the stage's commit leaves the
    stage committed without that checkpoint. The next stage trains the input's stage again from its manifest
    (resuming from its step-2 checkpoint), which commits the state; on a rank that holds policies it then goes on
    with the rebuilt engine. Its policy and steps are bitwise those of the same stage on the uninterrupted
    parent."""
    setup.run_in_process("lost-state")  # the one-rank stage again, under another output
    lost, whole = setup.store.artifact_uri("grpo", "lost-state"), setup.store.artifact_uri("grpo", "one-rank")
    step = int(setup.store.read_manifest(lost).metrics["optimizer/state_step"])
    state_uri = checkpoint_uri(setup.store, lost, step)
    setup.store.delete_artifact(state_uri)
    assert [ref.step for ref in committed_checkpoints(setup.store, lost)] == [2]

    def next_stage(parent: str, held: HeldPolicy | None) -> str:
        output = setup.store.artifact_uri("grpo", f"after-{parent.rsplit('/', 1)[-1]}")
        spec_uri = grpo_spec(setup.cfg, setup.store, output, {"policy": parent, "rollouts": setup.rollouts_uri}, 1)
        try:
            with intra_op_threads(1):
                run_spec(read_spec(spec_uri), held=held)
        finally:
            if held is not None:
                held.drop()
            destroy_distributed()
        return output

    held = HeldPolicy()
    after_lost, after_whole = next_stage(lost, held), next_stage(whole, None)
    assert setup.store.is_committed(state_uri)
    assert held.engine is None and held.pending is None
    repaired, uninterrupted = (setup.store.read_manifest(uri).metrics for uri in (after_lost, after_whole))
    assert repaired["optimizer_init"] == "repaired" and repaired["model_init"] == "kept", repaired
    assert repaired["phase/repair_s"] > 0 and "phase/repair_s" not in uninterrupted
    assert uninterrupted["optimizer_init"] == "checkpoint"
    assert repaired["optimizer/adam_steps"] == uninterrupted["optimizer/adam_steps"] == 2 * STEPS
    steps = [setup.store.reader(uri).read_json("train_summary.json")["steps"] for uri in (after_lost, after_whole)]
    untimed = [[{k: v for k, v in step.items() if not k.endswith("_s")} for step in run] for run in steps]
    assert len(untimed[0]) == STEPS and untimed[0] == untimed[1]
    rebuilt, expected = setup.weights("after-lost-state"), setup.weights("after-one-rank")
    assert rebuilt.keys() == expected.keys()
    assert all(torch.equal(rebuilt[k], expected[k]) for k in expected)
