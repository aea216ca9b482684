"""Engine pieces in one process (world size 1, CPU + gloo): parallel-degree validation, LR schedules,
mixed-precision choice, and that the engine builds the same weights however many ranks there are."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from forge_core.config import load_config
from forge_core.config.schema import OptimizerConfig, ParallelismConfig
from forge_core.engine import Engine, build_parallel_dims, resolve_param_dtype
from forge_core.engine.optim import current_lr
from forge_core.models import build_model, init_weights


def test_tensor_parallel_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"training.parallelism.tp=2: tensor parallelism needs GPUs"):
        build_parallel_dims(ParallelismConfig(tp=2), world_size=2, device_type="cpu")


def test_degrees_that_do_not_match_the_world_size_are_rejected():
    with pytest.raises(ValueError, match=r"dp_replicate=3 \* tp=1 does not divide the world size 2"):
        build_parallel_dims(ParallelismConfig(dp_replicate=3), world_size=2, device_type="cpu")
    with pytest.raises(ValueError, match=r"dp_shard=4 \* tp=1 != world size 2"):
        build_parallel_dims(ParallelismConfig(dp_shard=4), world_size=2, device_type="cpu")


def test_mixed_precision_defaults_to_bf16_on_gpu_and_fp32_on_cpu():
    assert resolve_param_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_param_dtype("auto", "cpu") == torch.float32
    assert resolve_param_dtype("bf16", "cpu") == torch.bfloat16


def _lrs(cfg: OptimizerConfig, total_steps: int) -> list[float]:
    optimizers, schedulers = cfg.build(torch.nn.Linear(2, 2), device_type="cpu", total_steps=total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(current_lr(optimizers))
        optimizers.step()
        schedulers.step()
    return lrs


def test_warmup_then_cosine_decays_to_the_floor():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=2, decay="cosine", min_lr_ratio=0.1)
    lrs = _lrs(cfg, total_steps=10)
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert all(a > b for a, b in itertools.pairwise(lrs[2:])), lrs
    # Step 10 of 10 is at the end of the cosine: 0.1 + 0.9 * 0.5 * (1 + cos(pi * 7/8)).
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_constant_schedule_stays_flat_after_warmup():
    lrs = _lrs(OptimizerConfig(lr=0.5, warmup_steps=1, decay="constant"), total_steps=5)
    assert lrs == pytest.approx([0.5] * 5)
    linear = _lrs(OptimizerConfig(lr=1.0, decay="linear", min_lr_ratio=0.0), total_steps=4)
    assert linear == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_engine_starts_from_the_unsharded_init_of_the_seed(tmp_path):
    """FSDP materialises shards with per-shard random draws on CPU meshes; the engine must still start from
    exactly the weights an unsharded model gets for the seed (the same for 1 or N ranks)."""
    cfg = load_config(None, ["training.device=cpu", "seed=3"])
    engine = Engine.Config.from_run_config(cfg, 48, cfg.sft.optimizer, total_steps=1).build()
    reference = build_model(cfg.model, 48, device="meta", attention="sdpa")
    init_weights(reference, seed=3, device="cpu")
    full = engine.full_state_dict()
    assert set(full) == set(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    assert engine.describe()["world_size"] == 1 and engine.dp_group is None


def test_local_weights_put_back_the_model_after_other_weights_were_loaded():
    """What GRPO's scoring does around a swap: copy the shards, load other weights, put the copy back."""
    cfg = load_config(None, ["training.device=cpu", "seed=3"])
    engine = Engine.Config.from_run_config(cfg, 48, cfg.sft.optimizer, total_steps=1).build()
    before = engine.full_state_dict()
    saved = engine.local_weights()
    other = torch.Generator().manual_seed(99)  # not the seeded global stream the init drew from
    engine.load_full_state_dict({key: torch.randn(value.shape, generator=other) for key, value in before.items()})
    swapped = engine.full_state_dict()
    assert all(not torch.equal(swapped[key], before[key]) for key in before)
    parameters = dict(engine.model.named_parameters())
    engine.load_local_weights(saved)
    after = engine.full_state_dict()
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert all(param is parameters[name] for name, param in engine.model.named_parameters())  # in place


def test_activation_checkpointing_gives_the_same_training_steps():
    import numpy as np

    from forge_core.losses import TokenCrossEntropy
    from forge_core.trainers import TitanTrainer, pad_token_rows

    rng = np.random.default_rng(0)
    rows = [(rng.integers(1, 30, 9), np.array([0] * 4 + [1] * 5, np.int8)) for _ in range(4)]
    batch = pad_token_rows(rows)
    losses = {}
    for ac in ("false", "true"):
        cfg = load_config(None, ["training.device=cpu", f"training.activation_checkpoint={ac}"])
        trainer = TitanTrainer(
            Engine.Config.from_run_config(cfg, 30, cfg.sft.optimizer, total_steps=3).build()
        )
        losses[ac] = [trainer.train_step(batch.split(2), TokenCrossEntropy())["loss"] for _ in range(3)]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-6)
