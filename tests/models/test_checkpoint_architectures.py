"""Checkpoints of any size: the architecture comes from config.json (`model.flavor: auto`), for every family.

Foreign checkpoints are made here with transformers itself (random weights at unit scale, sizes no flavor has:
3 layers, hidden 96, 6 heads, 2 kv heads), loaded into torchtitan and compared with transformers' logits
(fp32, within 1e-4, positions with a gap too); their exports keep the checkpoint's facts (context length, RoPE
settings, generation config) and load back in transformers with the same logits. Unsupported features fail
naming the config.json field and value; a hand-set flavor or family that disagrees with the checkpoint fails
naming both. The pipeline end to end from such checkpoints (and vLLM on their exports) is
tests/flows/test_foreign_checkpoints.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from forge_core.config.schema import ModelConfig
from forge_core.models import (
    build_model,
    build_model_config,
    forward_logits,
    init_buffers,
    load_hf_folder,
    read_hf_info,
    write_hf_folder,
)

TOLERANCE = 1e-4
VOCAB = 50
ODD_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 96,
    "intermediate_size": 200,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# name -> (family, transformers config)
FOREIGN = {
    "llama-untied": ("llama3", lambda: transformers.LlamaConfig(**ODD_SIZES, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-tied-rope-scaled": (
        "llama3",
        lambda: transformers.LlamaConfig(
            **ODD_SIZES, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)
        ),
    ),
    "qwen2": ("qwen2", lambda: transformers.Qwen2Config(**ODD_SIZES, tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": ("qwen3", lambda: transformers.Qwen3Config(**ODD_SIZES, head_dim=24, tie_word_embeddings=False)),
}


def randomize_at_unit_scale(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Logits of O(1..10): matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms around 1, biases ~ N(0, 0.25)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.5 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            if "embed_tokens" in name:
                param.mul_(math.sqrt(param.shape[1]))
    return model


def save_foreign_checkpoint(name: str, folder, seed: int = 0, **config_changes):
    config = FOREIGN[name][1]()
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_at_unit_scale(model, seed)
    model.save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], do_sample=True, temperature=0.7, top_p=0.8).save_pretrained(
        folder
    )
    return model


def _titan_from(folder, max_seq_len=64):
    state_dict, info = load_hf_folder(folder)
    model = build_model(
        info.to_model_config(max_seq_len), info.vocab_size, device="meta", attention="sdpa",
        architecture=info.architecture,
    )
    init_buffers(model, device="cpu")
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), info


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_foreign_checkpoint_matches_transformers_logits(name, tmp_path):
    family = FOREIGN[name][0]
    hf_model = save_foreign_checkpoint(name, tmp_path)
    titan, info = _titan_from(tmp_path)
    assert (info.family, info.flavor, info.architecture.num_hidden_layers) == (family, "auto", 3)
    assert info.architecture.tie_word_embeddings == (name in ("llama-tied-rope-scaled", "qwen2"))
    tokens_BL = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    gapped_BL = torch.cat([torch.arange(5), torch.arange(40, 55)]).expand(3, 20)
    with torch.no_grad():
        expected, got = hf_model(tokens_BL).logits, forward_logits(titan, tokens_BL)
        expected_gapped = hf_model(tokens_BL, position_ids=gapped_BL).logits
        got_gapped = forward_logits(titan, tokens_BL, gapped_BL)
    diff, diff_gapped = _max_diff(got, expected), _max_diff(got_gapped, expected_gapped)
    print(f"{name}: logits max|diff| {diff:.3g}, with a position gap {diff_gapped:.3g}")
    assert expected.abs().max() > 1.0
    assert diff < TOLERANCE and diff_gapped < TOLERANCE


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_export_keeps_the_checkpoints_facts_and_loads_in_transformers(name, tmp_path):
    hf_model = save_foreign_checkpoint(name, tmp_path / "ckpt")
    titan, info = _titan_from(tmp_path / "ckpt", max_seq_len=64)  # trained at a shorter context
    out = write_hf_folder(
        titan.state_dict(), info.to_model_config(64, hf_path="x"), VOCAB, tmp_path / "out", checkpoint=info
    )
    original = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported["max_position_embeddings"] == original["max_position_embeddings"] == 512
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings", "model_type"):
        assert exported.get(key) == original.get(key), key
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (tmp_path / "ckpt" / "generation_config.json").read_text()
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens_BL = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _max_diff(reloaded(tokens_BL).logits, hf_model(tokens_BL).logits) < TOLERANCE


def test_a_hand_set_flavor_that_disagrees_is_an_error_naming_both(tmp_path):
    save_foreign_checkpoint("qwen3", tmp_path)
    info = read_hf_info(tmp_path)
    wrong = ModelConfig(family="qwen3", flavor="1.7B", hf_path=str(tmp_path), max_seq_len=64)
    with pytest.raises(ValueError, match=r"model.flavor='1.7B' disagrees.*hidden_size: flavor 2048 vs checkpoint 96.*model.flavor=auto"):
        build_model_config(wrong, VOCAB, attention="sdpa", architecture=info.architecture)
    other_family = ModelConfig(family="llama3", hf_path=str(tmp_path), max_seq_len=64)
    with pytest.raises(ValueError, match=r"model.family='llama3'.*model_type='qwen3'.*model.family=qwen3"):
        build_model_config(other_family, VOCAB, attention="sdpa", architecture=info.architecture)


def test_auto_is_the_default_and_means_tiny_from_scratch():
    from forge_core.config import load_config
    from forge_core.models.flavors import flavor_architecture

    assert load_config(None, ["model.hf_path=/x"]).model.flavor == "auto"
    scratch = load_config(None, ["model.family=qwen2"]).model  # no hf_path: a from-scratch run
    built = build_model_config(scratch, VOCAB, attention="sdpa")
    assert built.dim == flavor_architecture("qwen2", "tiny").hidden_size == 128
    # With a checkpoint the caller must pass its architecture: nothing silently falls back to `tiny`.
    with pytest.raises(ValueError, match=r"model.flavor='auto' with model.hf_path='/x'.*read_hf_info"):
        build_model_config(ModelConfig(family="qwen2", hf_path="/x", max_seq_len=64), VOCAB, attention="sdpa")


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window=True"),
        ("llama-untied", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ("llama-untied", {"mlp_bias": True}, r"mlp_bias=True"),
        ("llama-untied", {"attention_bias": True}, r"attention_bias=True"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}},
            r"rope_parameters.rope_type='yarn' \(supported for qwen3: \['default'\]\)",
        ),
    ],
)
def test_unsupported_features_name_the_field_and_value(name, changes, message, tmp_path):
    config = FOREIGN[name][1]()
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"config.json: .*{message}"):
        read_hf_info(tmp_path)


def test_an_unsupported_model_type_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    with pytest.raises(ValueError, match=r"model_type='qwen3_moe' is not supported.*\['llama', 'qwen2', 'qwen3'\]"):
        read_hf_info(tmp_path)
