"""The GRPO loss family and the mismatch corrections against references written here from the published
formulas, on random inputs: loss and gradient to 1e-6.

References (each written independently of forge_core, in float64, one sequence at a time):
- token-mean clipped surrogate: torchtitan 0.3.0's DAPOLoss (.venv), bit for bit;
- GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 5-7): s_i = (pi(y_i)/pi_old(y_i))^(1/|y_i|),
  J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), in its sequence form;
- CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): J = 1/sum|o_i| sum_i sum_t sg(clip(r_it)) A_i log pi(o_it);
- k2 KL (Schulman's approximations, as in verl's core_algos "mse"): (logp - ref)^2 / 2 per token;
- corrections as verl's rollout correction and TRL's GRPO docs describe them: token TIS min(w, C), sequence
  masked IS prod_t w_t masked above C, a geometric-mean sequence mask, IcePop's token mask w * 1[a <= w <= b],
  with w = pi_trainer(old weights) / pi_sampler and the PPO ratio taken against pi_trainer(old weights).
Then: every correction equals `none` when trainer and sampler logprobs agree; mismatch metrics on a batch with
a known mismatch; and split invariance (1 x 8 == 8 x 1 == 2 real gloo ranks x 4) for every loss x correction.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from grpo_batches import (
    BATCH,
    CORRECTION_BOUNDS,
    CORRECTIONS,
    LOSS_TYPES,
    family_cases,
    family_loss,
    make_rl_batch,
    rank_gradients,
    tiny_rollout,
    two_rank_worker,
)

from forge_core.batch import plan_minibatches
from forge_core.config.schema import CorrectionConfig, LossConfig
from forge_core.losses.base import ModelOutputs
from forge_core.losses.correction import build_correction, mismatch_summary
from forge_core.losses.grpo import (
    KL_ESTIMATORS,
    CISPOLoss,
    ClipRange,
    GSPOLoss,
    KLPenalty,
    TokenMeanLoss,
    build_policy_loss,
)
from forge_core.models.logprobs import token_logprobs

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def random_inputs(seed: int, rows: int = 6, width: int = 7, spread: float = 0.4):
    """Ragged response masks (one row of a single token, one with none), advantages of both signs, sampler
    logprobs, the trainer's logprobs of the sampler (`old`, a small mismatch) and current logprobs far
    enough from both that every clip bound is hit."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 0, 5, 3])[:rows]
    mask = torch.arange(width)[None, :] < lengths[:, None]
    advantages = torch.randn(rows, generator=g)
    gen = -torch.rand(rows, width, generator=g) * 3 - 0.05
    old = gen + 0.1 * torch.randn(rows, width, generator=g)
    logp = (old + spread * torch.randn(rows, width, generator=g)).clamp(max=-1e-3)
    ref = logp + 0.3 * torch.randn(rows, width, generator=g)
    return mask, advantages, gen, old, logp, ref


def ours(loss_fn, mask, advantages, gen, logp, old=None, ref=None):
    """Loss and d loss / d logp from forge_core, normalised over this one batch."""
    logp = logp.clone().float().requires_grad_(True)
    batch = make_rl_batch(advantages, gen, mask, ref_logprobs=ref, old_logprobs=old)
    result = loss_fn(ModelOutputs(logp), batch, loss_fn.normalizer(batch))
    result.loss.backward()
    return result.loss.detach().double(), logp.grad.double(), result


def reference_grad(loss_of_logp, logp):
    x = logp.double().clone().requires_grad_(True)
    loss = loss_of_logp(x)
    loss.backward()
    return loss.detach(), x.grad


def rows_of(mask):
    return [(i, [t for t in range(mask.shape[1]) if mask[i, t]]) for i in range(mask.shape[0]) if mask[i].any()]


def clip(x, low=CLIP_LOW, high=CLIP_HIGH):
    return x.clamp(1 - low, 1 + high)


# ---- the plain clipped surrogate against torchtitan's DAPO loss ------------------------------------------


def test_token_mean_equals_torchtitan_dapo_loss_bit_for_bit():
    from torchtitan.components.loss import compute_logprobs
    from torchtitan.experiments.rl.losses import DAPOLoss

    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 6, 9, 13
    logits = torch.randn(rows, width, vocab, generator=g) * 2
    labels = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor([9, 1, 4, 6, 2, 7])[:, None]
    advantages = torch.randn(rows, generator=g)
    with torch.no_grad():
        gen = compute_logprobs(logits, labels) + 0.4 * torch.randn(rows, width, generator=g)

    theirs_logits = logits.clone().requires_grad_(True)
    dapo = DAPOLoss(DAPOLoss.Config(ratio_clip_low=CLIP_LOW, ratio_clip_high=CLIP_HIGH))
    theirs, _ = dapo(theirs_logits, labels, float(mask.sum()), generator_logprobs=gen,
                     advantages=advantages[:, None] * mask, loss_mask=mask)
    theirs.backward()

    our_logits = logits.clone().requires_grad_(True)
    loss_fn = TokenMeanLoss(ClipRange(CLIP_LOW, CLIP_HIGH), max_log_ratio=10.0)
    batch = make_rl_batch(advantages, gen, mask)
    mine = loss_fn(ModelOutputs(token_logprobs(our_logits, labels)), batch, loss_fn.normalizer(batch))
    mine.loss.backward()

    assert mine.metrics["clip_low_count"] > 0 and mine.metrics["clip_high_count"] > 0
    assert torch.equal(mine.loss, theirs)
    assert torch.equal(our_logits.grad, theirs_logits.grad)


# ---- GSPO, CISPO, k2 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_papers_sequence_objective(seed):
    mask, advantages, gen, _, logp, _ = random_inputs(seed, spread=0.15)
    low, high = 0.02, 0.03  # sequence ratios sit near 1: bounds this tight make some of them clip

    def reference(x):
        objective = []
        for i, tokens in rows_of(mask):
            s = torch.exp(sum(x[i, t] - gen[i, t].double() for t in tokens) / len(tokens))
            a = advantages[i].double()
            objective.append(torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a))
        return -sum(objective) / len(objective)

    want, want_grad = reference_grad(reference, logp)
    got, got_grad, result = ours(GSPOLoss(ClipRange(low, high), 10.0), mask, advantages, gen, logp)
    clipped = result.metrics["clip_low_count"] + result.metrics["clip_high_count"]
    assert 0 < clipped < result.metrics["tokens"], "some sequences must clip and some not"
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_matches_the_minimax_objective(seed):
    mask, advantages, gen, _, logp, _ = random_inputs(seed)

    def reference(x):
        total, tokens = 0.0, 0
        for i, row in rows_of(mask):
            for t in row:
                weight = clip(torch.exp(x[i, t] - gen[i, t].double())).detach()
                total = total + weight * advantages[i].double() * x[i, t]
                tokens += 1
        return -total / tokens

    want, want_grad = reference_grad(reference, logp)
    got, got_grad, result = ours(CISPOLoss(ClipRange(CLIP_LOW, CLIP_HIGH), 10.0), mask, advantages, gen, logp)
    assert result.metrics["clip_low_count"] > 0 and result.metrics["clip_high_count"] > 0
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    # Unlike PPO's clip, CISPO leaves no response token without a gradient (where A != 0).
    assert (got_grad[mask & (advantages[:, None] != 0)] != 0).all()


def test_each_loss_type_clips_at_its_papers_bounds_by_default():
    """CISPO sets no lower bound on its weight (MiniMax-M1: clip_low "a high value"), GSPO clips its sequence
    ratio at 3e-4 / 4e-4, the token-level types at DAPO's 0.2 / 0.28; an explicit setting wins."""
    assert LossConfig(type="cispo").clip_range() == (1.0, 0.28)
    assert LossConfig(type="gspo").clip_range() == (3e-4, 4e-4)
    assert LossConfig().clip_range() == (0.2, 0.28)
    assert LossConfig(type="cispo", clip_low=0.5).clip_range() == (0.5, 0.28)
    assert LossConfig(type="cispo").check() == []
    assert "grpo.loss.clip_low=1.0" in " ".join(LossConfig(type="gspo", clip_low=1.0).check())
    # With the default floor of 0, a token pushed far down (ratio 0.05) is weighted 0.05, not 1 - 0.2.
    cispo = build_policy_loss(LossConfig(type="cispo"), max_new_tokens=4)
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.full((1, 1), math.log(0.05), requires_grad=True)
    terms = cispo.surrogate(logp, torch.zeros(1, 1), torch.ones(1), mask, cispo.clip, 10.0)
    terms.loss_BL.sum().backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 1), -0.05))


def test_k2_kl_penalty_matches_half_the_squared_log_ratio():
    mask, advantages, gen, _, logp, ref = random_inputs(3)
    coef = 0.3

    def reference(x):
        total, tokens = 0.0, 0
        for i, row in rows_of(mask):
            for t in row:
                r = torch.exp(x[i, t] - gen[i, t].double())
                a = advantages[i].double()
                total = total - torch.minimum(r * a, clip(r) * a) + coef * 0.5 * (x[i, t] - ref[i, t].double()) ** 2
                tokens += 1
        return total / tokens

    want, want_grad = reference_grad(reference, logp)
    loss_fn = TokenMeanLoss(ClipRange(CLIP_LOW, CLIP_HIGH), 10.0, kl=KLPenalty(coef=coef, estimator="k2"))
    got, got_grad, _ = ours(loss_fn, mask, advantages, gen, logp, ref=ref)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    assert KL_ESTIMATORS["k2"](torch.tensor([-2.0, 0.0, 0.5])).tolist() == [2.0, 0.0, 0.125]


# ---- the corrections --------------------------------------------------------------------------------------


def reference_weight(kind: str, w_row: list[torch.Tensor]) -> list[torch.Tensor]:
    """The correction's weight of each token of one sequence, from its token weights w = trainer / sampler."""
    if kind == "tis":
        return [w.clamp(max=CORRECTION_BOUNDS["tis_cap"]) for w in w_row]
    if kind == "mis":
        seq = math.prod(w_row)
        return [seq if seq <= CORRECTION_BOUNDS["mis_threshold"] else seq * 0 for _ in w_row]
    if kind == "geo_mask":
        geo = math.prod(w_row) ** (1 / len(w_row))
        keep = CORRECTION_BOUNDS["geo_low"] <= geo <= CORRECTION_BOUNDS["geo_high"]
        return [torch.tensor(1.0 if keep else 0.0, dtype=torch.float64) for _ in w_row]
    assert kind == "icepop"
    low, high = CORRECTION_BOUNDS["icepop_low"], CORRECTION_BOUNDS["icepop_high"]
    return [w if low <= w <= high else w * 0 for w in w_row]


@pytest.mark.parametrize("kind", ["tis", "mis", "geo_mask", "icepop"])
@pytest.mark.parametrize("seed", [0, 1])
def test_correction_weights_the_decoupled_ratio_like_the_published_form(kind, seed):
    mask, advantages, gen, old, logp, _ = random_inputs(seed)
    old = gen + 0.3 * (old - gen) / 0.1  # a mismatch wide enough that each correction acts

    def reference(x):
        total, tokens = 0.0, 0
        for i, row in rows_of(mask):
            weights = reference_weight(kind, [torch.exp(old[i, t].double() - gen[i, t].double()) for t in row])
            for t, weight in zip(row, weights):
                r = torch.exp(x[i, t] - old[i, t].double())  # the PPO ratio against the trainer's old policy
                a = advantages[i].double()
                total = total - weight * torch.minimum(r * a, clip(r) * a)
                tokens += 1
        return total / tokens

    want, want_grad = reference_grad(reference, logp)
    correction = build_correction(CorrectionConfig(type=kind, **CORRECTION_BOUNDS))
    loss_fn = TokenMeanLoss(ClipRange(CLIP_LOW, CLIP_HIGH), 10.0, correction=correction)
    got, got_grad, result = ours(loss_fn, mask, advantages, gen, logp, old=old)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    acted = result.metrics["corrected_masked_tokens"] + result.metrics["corrected_truncated_tokens"]
    assert 0 < acted < result.metrics["tokens"], "the correction must act on some tokens, not all"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kind", CORRECTIONS[1:])
def test_every_correction_equals_none_when_trainer_and_sampler_agree(loss_type, kind):
    mask, advantages, gen, _, logp, ref = random_inputs(4)
    cfg = LossConfig(type=loss_type, kl_coef=0.1, kl_estimator="k3",
                     horizon=9 if loss_type == "clipped_fixed_horizon" else None)
    plain = build_policy_loss(cfg, max_new_tokens=8)
    corrected = build_policy_loss(cfg, max_new_tokens=8, correction=CorrectionConfig(type=kind))
    loss_a, grad_a, _ = ours(plain, mask, advantages, gen, logp, ref=ref)
    loss_b, grad_b, result_b = ours(corrected, mask, advantages, gen, logp, old=gen.clone(), ref=ref)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert result_b.metrics["corrected_masked_tokens"] == result_b.metrics["corrected_truncated_tokens"] == 0
    assert result_b.metrics["mismatch_abs_max"] == 0


def test_a_correction_without_old_logprobs_is_a_clear_error():
    mask, advantages, gen, _, logp, _ = random_inputs(0)
    loss_fn = build_policy_loss(LossConfig(), 8, correction=CorrectionConfig(type="tis"))
    with pytest.raises(ValueError, match="grpo.correction.type='tis': the batch has no old_logprobs_BL"):
        ours(loss_fn, mask, advantages, gen, logp)


# ---- mismatch metrics on a constructed batch -------------------------------------------------------------


def test_mismatch_metrics_on_a_batch_with_a_known_mismatch():
    """Two live sequences: row 0's trainer logprobs sit log(2) above the sampler's on both tokens (w = 2, a
    sequence ratio of 4), row 1's log(0.5) below on one token and equal on the other (w = 0.5, 1; ratio 0.5);
    row 2 carries no loss and holds garbage the metrics must ignore."""
    gen = torch.tensor([[-1.0, -2.0], [-0.5, -1.5], [float("nan"), 3.0]])
    old = gen + torch.tensor([[math.log(2), math.log(2)], [math.log(0.5), 0.0], [50.0, 50.0]])
    mask = torch.tensor([[True, True], [True, True], [False, False]])
    batch = make_rl_batch(torch.tensor([1.0, -1.0, 0.0]), gen, mask, old_logprobs=old)

    k3 = {2.0: 2 - 1 - math.log(2), 0.5: 0.5 - 1 - math.log(0.5), 1.0: 0.0}
    expected_common = {
        "mismatch/logprob_diff_mean": 3 * math.log(2) / 4,
        "mismatch/logprob_diff_max": math.log(2),
        "mismatch/kl_k3": (2 * k3[2.0] + k3[0.5]) / 4,
        "mismatch/seq_ratio_max": 4.0,
        "mismatch/seq_ratio_min": 0.5,
        "mismatch/seq_ratio_p50": (4.0 + 0.5) / 2,
    }
    # (correction config, masked tokens, truncated tokens, masked sequences, truncated sequences)
    cases = [
        ({"type": "none"}, 0, 0, 0, 0),
        ({"type": "tis", "tis_cap": 1.5}, 0, 2, 0, 1),      # row 0's two w = 2 are capped
        ({"type": "mis", "mis_threshold": 3.0}, 2, 0, 1, 0),  # row 0's ratio 4 > 3: masked
        ({"type": "geo_mask"}, 4, 0, 2, 0),                   # geo means 2 and 0.71: both outside [0.99, 1.01]
        ({"type": "icepop", "icepop_low": 0.6, "icepop_high": 2.5}, 1, 0, 1, 0),  # only w = 0.5 is outside
    ]
    for cfg, masked, truncated, masked_seqs, truncated_seqs in cases:
        summary = mismatch_summary(batch, build_correction(CorrectionConfig(**cfg)))
        for key, value in expected_common.items():
            assert summary[key] == pytest.approx(value, rel=1e-6), (cfg, key)
        assert summary["correction/masked_token_frac"] == masked / 4, cfg
        assert summary["correction/truncated_token_frac"] == truncated / 4, cfg
        assert summary["correction/masked_seq_frac"] == masked_seqs / 2, cfg
        assert summary["correction/truncated_seq_frac"] == truncated_seqs / 2, cfg

    # The same numbers come out of a training step's loss metrics, reduced and summarized.
    loss_fn = build_policy_loss(LossConfig(), 8, correction=CorrectionConfig(type="mis", mis_threshold=3.0))
    result = loss_fn(ModelOutputs(old.clone()), batch, loss_fn.normalizer(batch))
    logged = loss_fn.summarize({k: float(v) for k, v in result.metrics.items()})
    assert logged["mismatch/kl_k3"] == pytest.approx(expected_common["mismatch/kl_k3"], rel=1e-6)
    assert logged["mismatch/seq_ratio_max"] == pytest.approx(4.0, rel=1e-6)
    assert logged["correction/masked_seq_frac"] == 0.5
    assert math.isfinite(float(result.loss))


# ---- split invariance: micro-batches and real ranks -------------------------------------------------------


def single_rank_gradients(loss_type: str, correction: str, micro_batch_size: int, seed: int):
    loss_fn = family_loss(loss_type, correction)
    policy, batch = tiny_rollout(off_policy_noise=0.3, with_ref=True, mismatch=0.3)
    (step,) = plan_minibatches(BATCH, BATCH, micro_batch_size, epochs=1, seed=seed)
    normalizer = sum(loss_fn.normalizer(batch.select(rows)) for rows in step.micro_rows)
    return normalizer, rank_gradients(loss_fn, policy, batch, step.micro_rows, normalizer), batch, loss_fn


@pytest.mark.parametrize(("loss_type", "correction"), family_cases())
def test_one_micro_batch_of_8_equals_8_micro_batches_of_1(loss_type, correction):
    norm_a, grads_a, batch, loss_fn = single_rank_gradients(loss_type, correction, 8, seed=3)
    norm_b, grads_b, _, _ = single_rank_gradients(loss_type, correction, 1, seed=4)
    assert norm_a == norm_b == loss_fn.normalizer(batch)
    assert any(g.abs().sum() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_corrections_act_on_the_split_invariance_batch():
    """The bounds of the split tests make every correction change the loss there, so the invariance they
    check is not the trivial one of weight 1."""
    _, batch = tiny_rollout(off_policy_noise=0.3, with_ref=True, mismatch=0.3)
    for kind in CORRECTIONS[1:]:
        summary = mismatch_summary(batch, build_correction(CorrectionConfig(type=kind, **CORRECTION_BOUNDS)))
        acted = summary["correction/masked_token_frac"] + summary["correction/truncated_token_frac"]
        assert 0 < acted < 1, (kind, summary)


def test_two_gloo_ranks_of_four_equal_one_rank_of_eight(tmp_path):
    """Real ranks: two spawned processes over gloo, each with its half of the mini-batch in micro-batches of
    2, the normalizer and gradients all-reduced by SUM; every (loss, correction) pair."""
    mp.start_processes(two_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    two_ranks = torch.load(tmp_path / "two_ranks.pt")
    assert set(two_ranks) == {f"{loss}/{correction}" for loss, correction in family_cases()}
    for loss_type, correction in family_cases():
        normalizer, grads, _, _ = single_rank_gradients(loss_type, correction, 8, seed=3)
        got = two_ranks[f"{loss_type}/{correction}"]
        assert got["normalizer"] == normalizer, (loss_type, correction)
        for a, b in zip(grads, got["grads"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=f"{loss_type}/{correction}")
