"""Exports are written in the training dtype (TitanTrainer.export_weights -> Engine.export_dtype): a bf16 run
exports bf16 (half the bytes of fp32; what vLLM serves), the weights are exactly the bf16 model's, and
transformers runs the folder with the same logits as the trainer's bf16 model.

Tolerances. The exported weights are checked bitwise (they are the master weights rounded to bf16, which is
what the bf16 forward computes with). transformers in fp32 on those weights must match torchtitan in fp32 on
the same bf16-rounded weights within the fp32 parity tolerance of tests/models/test_hf.py (1e-4): that pins
names, layouts, RoPE and config. The two bf16 forwards (transformers vs torchtitan/FSDP) cannot agree
bitwise: each rounds activations to bf16 (8 bits of mantissa) in its own order. Their gap must stay within
3x the rounding noise of torchtitan's own bf16 forward (its distance to the fp32 forward on the same weights,
measured here): two forwards with noise of one size differ by at most twice it, plus margin; a wrong export
(a weight, a permutation) moves logits by their own scale (~5 here), some 70x the noise (~0.07 here).
"""

from __future__ import annotations

import json

import torch
import transformers

from forge_core.config import load_config
from forge_core.engine import Engine, destroy_distributed
from forge_core.models import build_model, forward_logits, load_hf_folder
from forge_core.storage import ObjectStore
from forge_core.trainers.base import ArtifactContext, TitanTrainer

VOCAB = 48
FP32_PARITY = 1e-4  # tests/models/test_hf.py: transformers vs torchtitan, both fp32
BF16_NOISE_FACTOR = 3.0


def _unit_scale(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Weights at unit scale (torchtitan's init gives near-uniform logits, under which parity tests little)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if value.ndim == 1:
            out[name] = torch.ones_like(value)
        elif "embed" in name:
            out[name] = torch.randn(value.shape, generator=generator)
        else:
            out[name] = torch.randn(value.shape, generator=generator) * 1.5 / value.shape[-1] ** 0.5
    return out


def test_bf16_training_exports_bf16_that_transformers_runs_with_the_same_logits(tmp_path):
    cfg = load_config(
        None,
        [
            "training.device=cpu",  # bf16 on CPU only when asked for explicitly (preflight)
            "training.mixed_precision=bf16",
            "model.family=qwen3",
            "model.flavor=tiny",
            "model.max_seq_len=64",
            "data.max_seq_len=64",
            "seed=3",
        ],
    )
    store = ObjectStore(f"file://{tmp_path}/store")
    try:
        engine = Engine.Config.from_run_config(cfg, VOCAB, cfg.sft.optimizer, total_steps=1).build()
        engine.load_full_state_dict(_unit_scale(engine.full_state_dict(), seed=7))
        master = engine.full_state_dict()  # fp32 master weights (the tied embedding holds one of the draws)
        trainer = TitanTrainer(engine, artifacts=ArtifactContext(store, stage="sft"))
        uri = trainer.export_weights(store.artifact_uri("policy", "bf16"), tokenizer_dir=None).uri
        tokens_BL = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            titan_bf16 = forward_logits(engine.model, tokens_BL).float()
    finally:
        destroy_distributed()

    folder = store.reader(uri).download_dir("", tmp_path / "policy")
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    exported, _ = load_hf_folder(folder)
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    for name, value in master.items():
        assert torch.equal(exported[name], value.to(torch.bfloat16)), name
    fp32_bytes = sum(v.numel() * 4 for v in master.values())
    assert (folder / "model.safetensors").stat().st_size < 0.6 * fp32_bytes

    # torchtitan in fp32 on the bf16-rounded weights: the exact result the two bf16 forwards approximate.
    reference = build_model(cfg.model, VOCAB, device="cpu", attention="sdpa")
    reference.load_state_dict({k: v.float() for k, v in exported.items()})
    hf_fp32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        exact = forward_logits(reference, tokens_BL)
        hf_fp32_gap = (hf_fp32(tokens_BL).logits - exact).abs().max().item()
        hf_bf16_logits = hf_bf16(tokens_BL).logits.float()
    titan_noise = (titan_bf16 - exact).abs().max().item()
    gap = (hf_bf16_logits - titan_bf16).abs().max().item()
    scale = exact.abs().max().item()
    print(
        f"logit scale {scale:.3g}; fp32 transformers vs torchtitan {hf_fp32_gap:.3g}; torchtitan bf16 noise "
        f"{titan_noise:.3g}; transformers bf16 vs torchtitan bf16 {gap:.3g}"
    )
    assert hf_fp32_gap < FP32_PARITY
    assert 0 < titan_noise < 0.05 * scale  # bf16 rounding: present, and small against the logits
    assert gap <= BF16_NOISE_FACTOR * titan_noise
