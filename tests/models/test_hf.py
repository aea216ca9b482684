"""HF <-> torchtitan conversion against real transformers models (fp32, CPU, random weights).

Random HF weights are drawn at unit scale (not transformers' std 0.02 init) so logits are O(1..10) and a wrong
q/k permutation, RoPE convention or norm epsilon shows up far above the 1e-4 tolerance.
"""

import io
import json
import math

import pytest
import safetensors.torch
import torch
import transformers

from forge_core.config.schema import ModelConfig
from forge_core.models import (
    build_model,
    forward_logits,
    hf_config_dict,
    hf_folder_files,
    init_buffers,
    init_weights,
    load_hf_folder,
    write_hf_folder,
)
from forge_core.models.hf import write_safetensors

TOLERANCE = 1e-4
VOCAB = 48

# Hand-written transformers configs of forgeflow's CPU flavors (independent of hf_config_dict on purpose).
HF_CONFIGS = {
    ("llama3", "tiny"): lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    ("llama3", "small"): lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    ("qwen3", "tiny"): lambda: transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def _randomize_at_unit_scale(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm weights: around 1, but not exactly 1
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            if "embed_tokens" in name or "tok_embeddings" in name:
                param.mul_(math.sqrt(param.shape[1]))


def _save_random_hf_model(family, flavor, folder, seed=0):
    config = HF_CONFIGS[(family, flavor)]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize_at_unit_scale(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _titan_model(cfg, vocab_size, seed=0):
    model = build_model(cfg, vocab_size, device="meta", attention="sdpa")
    return init_weights(model, seed=seed, device="cpu").eval()


def _loaded_titan_model(cfg, vocab_size, state_dict):
    model = build_model(cfg, vocab_size, device="meta", attention="sdpa")
    init_buffers(model, device="cpu")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _tokens(batch=3, length=20, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize(("family", "flavor"), [("llama3", "tiny"), ("llama3", "small"), ("qwen3", "tiny")])
def test_imported_hf_model_matches_transformers_logits(family, flavor, tmp_path):
    hf_model = _save_random_hf_model(family, flavor, tmp_path)
    state_dict, info = load_hf_folder(tmp_path)
    assert (info.family, info.flavor, info.vocab_size) == (family, flavor, VOCAB)
    titan = _loaded_titan_model(info.to_model_config(max_seq_len=64), info.vocab_size, state_dict)

    tokens_BL = _tokens()
    # A jump in positions changes relative distances, so RoPE conventions must agree beyond position 0..L-1.
    gapped_positions_BL = torch.cat([torch.arange(5), torch.arange(12, 27)]).expand(3, 20)
    with torch.no_grad():
        expected = hf_model(tokens_BL).logits
        got = forward_logits(titan, tokens_BL)
        expected_gapped = hf_model(tokens_BL, position_ids=gapped_positions_BL).logits
        got_gapped = forward_logits(titan, tokens_BL, gapped_positions_BL)
    diff, diff_gapped = _max_diff(got, expected), _max_diff(got_gapped, expected_gapped)
    print(
        f"{family}/{flavor}: logits max|diff| {diff:.3g} (positions 0..19), {diff_gapped:.3g} (positions with a gap)"
    )
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert diff < TOLERANCE and diff_gapped < TOLERANCE


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_export_then_import_round_trips_bitwise(family, tmp_path):
    cfg = ModelConfig(family=family, flavor="tiny", max_seq_len=64)
    state_dict = _titan_model(cfg, VOCAB, seed=3).state_dict()
    write_hf_folder(state_dict, cfg, VOCAB, tmp_path, bos_token_id=1, eos_token_id=2)
    reloaded, info = load_hf_folder(tmp_path)
    assert info.to_model_config() == cfg
    assert set(reloaded) == set(state_dict)
    for name, tensor in state_dict.items():
        assert reloaded[name].dtype == tensor.dtype, name
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_exported_folder_loads_in_transformers_with_same_logits(family, tmp_path):
    cfg = ModelConfig(family=family, flavor="tiny", max_seq_len=64)
    titan = _titan_model(cfg, VOCAB, seed=4)
    _randomize_at_unit_scale(titan, seed=4)
    write_hf_folder(titan.state_dict(), cfg, VOCAB, tmp_path, bos_token_id=1, eos_token_id=2)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [
        {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    ]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (64, 1, 2)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens_BL = _tokens(seed=5)
    with torch.no_grad():
        diff = _max_diff(hf_model(tokens_BL).logits, forward_logits(titan, tokens_BL))
    print(f"{family}/tiny exported: transformers vs torchtitan logits max|diff| {diff:.3g}")
    assert diff < TOLERANCE


def _save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    symbols = ["<pad>", "<bos>", "<eos>"] + list("0123456789+=")
    tokenizer = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return fast


def test_write_copies_tokenizer_and_takes_its_special_ids(tmp_path):
    tokenizer = _save_tokenizer(tmp_path / "tok")
    cfg = ModelConfig(family="llama3", flavor="tiny", max_seq_len=32)
    out = write_hf_folder(
        _titan_model(cfg, 16).state_dict(), cfg, 16, tmp_path / "policy", tokenizer_dir=tmp_path / "tok"
    )
    config = json.loads((out / "config.json").read_text())
    assert (
        (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
        == (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        == (1, 2, 0)
    )
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded("12+3=")["input_ids"] == tokenizer("12+3=")["input_ids"]


def test_write_rejects_tokenizer_larger_than_vocab(tmp_path):
    _save_tokenizer(tmp_path / "tok")  # 15 tokens
    cfg = ModelConfig(family="llama3", flavor="tiny", max_seq_len=32)
    with pytest.raises(ValueError, match="vocab_size=8"):
        write_hf_folder(
            _titan_model(cfg, 8).state_dict(), cfg, 8, tmp_path / "p", tokenizer_dir=tmp_path / "tok"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_streamed_safetensors_are_the_bytes_the_library_writes(dtype):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(7, 5, generator=generator).to(dtype),
        "lm_head.weight": torch.randn(3, 8, generator=generator).to(dtype),
        "model.norm.weight": torch.randn(5, generator=generator).to(dtype),
        "scalar": torch.tensor(1.5, dtype=dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    stream = io.BytesIO()
    write_safetensors(tensors, stream, metadata={"format": "pt"})
    assert stream.getvalue() == safetensors.torch.save(tensors, metadata={"format": "pt"})
    loaded = safetensors.torch.load(stream.getvalue())
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) and loaded[k].dtype == dtype for k in tensors)


def test_streamed_safetensors_refuse_mixed_or_unnamed_dtypes():
    with pytest.raises(ValueError, match=r"dtypes \['torch.bfloat16', 'torch.float32'\]"):
        write_safetensors({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)}, io.BytesIO(), {})
    with pytest.raises(ValueError, match=r"dtypes \['torch.int64'\]; pass tensors of one of"):
        write_safetensors({"a": torch.zeros(2, dtype=torch.long)}, io.BytesIO(), {})


def test_folder_files_stream_the_folder_write_hf_folder_writes(tmp_path):
    """The files a store's writer takes one by one are the folder's, byte for byte, weights last."""
    _save_tokenizer(tmp_path / "tok")
    cfg = ModelConfig(family="llama3", flavor="tiny", max_seq_len=32)
    state_dict = _titan_model(cfg, 16).state_dict()
    out = write_hf_folder(state_dict, cfg, 16, tmp_path / "policy", tokenizer_dir=tmp_path / "tok")
    streamed = {}
    for name, write in hf_folder_files(state_dict, cfg, 16, tokenizer_dir=tmp_path / "tok"):
        stream = io.BytesIO()
        write(stream)
        streamed[name] = stream.getvalue()
    assert list(streamed)[-1] == "model.safetensors"
    assert streamed == {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= streamed.keys()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_write_rejects_weights_of_another_size(tmp_path):
    cfg = ModelConfig(family="llama3", flavor="tiny", max_seq_len=32)
    state_dict = _titan_model(cfg, 16).state_dict()
    with pytest.raises(ValueError, match=r"shape of .*\(16, 128\) != expected \(20, 128\)"):
        write_hf_folder(state_dict, cfg, 20, tmp_path)


def test_load_takes_any_size_from_config_json(tmp_path):
    """A size no flavor has loads as `auto` (tests/models/test_checkpoint_architectures.py: parity per family)."""
    config = HF_CONFIGS[("llama3", "tiny")]()
    config.hidden_size, config.head_dim = 96, 24
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    _, info = load_hf_folder(tmp_path)
    assert (info.family, info.flavor, info.architecture.hidden_size) == ("llama3", "auto", 96)


def test_load_rejects_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: not found"):
        load_hf_folder(tmp_path)


def test_hf_config_dict_describes_registry_flavor():
    config = hf_config_dict(ModelConfig(family="qwen3", flavor="0.6B", max_seq_len=4096), 151936)
    expected = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 1000000.0
