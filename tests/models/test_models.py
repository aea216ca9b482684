"""Flavors, model build, init, training step, logprobs and FLOPs of forge_core.models (CPU, tiny sizes)."""

import pytest
import torch
from torch import nn
from torchtitan.models.common import ScaledDotProductAttention

from forge_core.config.schema import ModelConfig
from forge_core.models import (
    FLAVORS,
    build_model,
    build_model_config,
    flops_per_token,
    init_buffers,
    init_weights,
    model_logprobs,
    num_params,
    token_entropy,
)


def _tiny(family="llama3", flavor="tiny", max_seq_len=64):
    return ModelConfig(family=family, flavor=flavor, max_seq_len=max_seq_len)


def _cpu_model(cfg, vocab_size, seed=0):
    model = build_model(cfg, vocab_size, device="meta", attention="sdpa")
    return init_weights(model, seed=seed, device="cpu")


def test_unknown_flavor_lists_valid_flavors():
    with pytest.raises(ValueError) as err:
        build_model_config(_tiny(flavor="huge"), 32, attention="sdpa")
    message = str(err.value)
    assert "model.flavor='huge'" in message
    for flavor in FLAVORS["llama3"]:
        assert repr(flavor) in message


def test_unknown_family_lists_valid_families():
    with pytest.raises(ValueError, match=r"(?s)family.*'llama3', 'qwen2' or 'qwen3'.*input_value='gpt2'"):
        _tiny(family="gpt2")  # the schema refuses it as the section is built
    unchecked = ModelConfig.model_construct(family="gpt2", flavor="tiny", max_seq_len=64)  # built unvalidated
    with pytest.raises(ValueError, match=r"model.family='gpt2'.*'llama3', 'qwen2', 'qwen3'"):
        build_model_config(unchecked, 32, attention="sdpa")


def test_unknown_attention_backend_is_rejected():
    with pytest.raises(ValueError, match=r"attention='flash'.*'sdpa'"):
        build_model_config(_tiny(), 32, attention="flash")


def test_flavors_include_torchtitan_registry_and_cpu_flavors():
    assert {"tiny", "small", "debugmodel", "8B"} <= set(FLAVORS["llama3"])
    assert {"tiny", "small", "debugmodel", "0.6B"} <= set(FLAVORS["qwen3"])


def test_config_applies_vocab_max_seq_len_and_sdpa_to_every_layer():
    config = build_model_config(_tiny(flavor="small", max_seq_len=96), 40, attention="sdpa")
    assert config.vocab_size == 40
    assert config.tok_embeddings.num_embeddings == 40
    assert config.lm_head.out_features == 40
    assert config.max_seq_len == 96
    for layer in config.layers:
        assert layer.attention.rope.max_seq_len == 96
        assert isinstance(layer.attention.inner_attention, ScaledDotProductAttention.Config)


def test_registry_flavor_keeps_real_sizes_on_meta():
    model = build_model(ModelConfig(family="llama3", flavor="8B", max_seq_len=128), 128256, attention="flex")
    assert 7.9e9 < num_params(model) < 8.1e9
    assert next(model.parameters()).is_meta


@pytest.mark.parametrize(
    ("family", "flavor", "vocab_size", "low", "high"),
    [
        ("llama3", "tiny", 15, 0.50e6, 0.56e6),  # the 0.53M demo model
        ("llama3", "small", 64, 4.0e6, 7.0e6),
        ("qwen3", "tiny", 15, 0.25e6, 0.6e6),
        ("qwen2", "tiny", 15, 0.25e6, 0.6e6),
        ("qwen3", "small", 64, 4.0e6, 7.0e6),
        ("llama3", "medium", 15, 26.0e6, 28.0e6),
        ("qwen3", "medium", 15, 24.0e6, 28.0e6),
    ],
)
def test_cpu_flavor_sizes(family, flavor, vocab_size, low, high):
    model = build_model(_tiny(family, flavor), vocab_size, attention="sdpa")
    n = num_params(model)
    print(f"{family}/{flavor}: {n} parameters")
    assert low < n < high


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    cfg = _tiny()
    torch.manual_seed(123)
    expected_next_draw = torch.rand(1)
    torch.manual_seed(123)
    a = _cpu_model(cfg, 32, seed=7).state_dict()
    assert torch.equal(torch.rand(1), expected_next_draw)
    b = _cpu_model(cfg, 32, seed=7).state_dict()
    c = _cpu_model(cfg, 32, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.feed_forward.w1.weight"], c["layers.0.feed_forward.w1.weight"])
    assert all(torch.isfinite(v).all() for v in a.values())


def test_init_weights_needs_a_device_for_meta_models():
    model = build_model(_tiny(), 32, attention="sdpa")
    with pytest.raises(ValueError, match="device='cpu'"):
        init_weights(model, seed=0)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_tiny_model_trains_one_sgd_step_on_cpu(family):
    model = _cpu_model(_tiny(family), 32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens_BL = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logp_BL = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:])
    loss = -logp_BL.mean()
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])]
    assert unchanged == []
    with torch.no_grad():
        loss_after = -model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:]).mean()
    assert loss_after < loss


def test_model_logprobs_are_fp32_log_softmax_of_the_logits():
    model = _cpu_model(_tiny(), 32)
    tokens_BL = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp_BL = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:])
        logits_BLV = model(tokens_BL[:, :-1])
    expected_BL = torch.log_softmax(logits_BLV.double(), -1).gather(-1, tokens_BL[:, 1:, None]).squeeze(-1)
    assert logp_BL.dtype == torch.float32 and logp_BL.shape == (2, 8)
    assert torch.allclose(logp_BL.double(), expected_BL, atol=1e-5)
    assert (logp_BL <= 0).all()
    entropy_BL = token_entropy(logits_BLV)
    assert entropy_BL.shape == (2, 8) and (entropy_BL > 0).all()
    assert (entropy_BL <= torch.log(torch.tensor(32.0)) + 1e-5).all()


def test_positions_move_rope():
    model = _cpu_model(_tiny(), 32)
    tokens_BL = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(2))
    # RoPE only sees relative distances: a uniform shift changes nothing (up to rounding), a gap does.
    uniform_shift_BL = torch.arange(5, 13)[None]
    gap_BL = torch.tensor([[0, 1, 2, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        plain = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:])
        default_positions = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:], torch.arange(7)[None])
        shifted = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:], uniform_shift_BL[:, :-1])
        gapped = model_logprobs(model, tokens_BL[:, :-1], tokens_BL[:, 1:], gap_BL[:, :-1])
    assert torch.equal(plain, default_positions)
    assert torch.allclose(plain, shifted, atol=1e-5)
    # torchtitan's init keeps attention logits small, so the effect is small but far above rounding.
    assert (plain[:, 3:] - gapped[:, 3:]).abs().max() > 1e-4
    assert torch.allclose(plain[:, :3], gapped[:, :3], atol=1e-6)


def test_model_logprobs_rejects_mismatched_shapes():
    model = _cpu_model(_tiny(), 32)
    with pytest.raises(ValueError, match="same shape"):
        model_logprobs(model, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize(("family", "flavor"), [("llama3", "small"), ("qwen3", "tiny"), ("llama3", "1B")])
def test_flops_per_token_is_6n_plus_attention(family, flavor):
    cfg = ModelConfig(family=family, flavor=flavor, max_seq_len=128)
    config = build_model_config(cfg, 1000, attention="sdpa")
    model = build_model(cfg, 1000, attention="sdpa")
    # Counted independently from the built modules: every nn.Linear weight, the (possibly tied) lm_head included.
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attn = config.layers[0].attention
    head_dim = attn.head_dim or config.dim // attn.n_heads
    attention_term = 12 * len(config.layers) * attn.n_heads * head_dim * 128
    assert flops_per_token(config, 128) == 6 * matmul_params + attention_term
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token(config, 0)


def test_init_buffers_materialises_rope_without_random_draws():
    cfg = _tiny()
    reference = _cpu_model(cfg, 32, seed=0)
    model = build_model(cfg, 32, attention="sdpa")
    torch.manual_seed(5)
    expected_next_draw = torch.rand(1)
    torch.manual_seed(5)
    init_buffers(model, device="cpu")
    assert torch.equal(torch.rand(1), expected_next_draw)
    model.load_state_dict(reference.state_dict())
    tokens_BL = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(tokens_BL), reference(tokens_BL))


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_separate_qkv_initialises_like_torchtitans_fused_wqkv(family):
    """forgeflow un-fuses wqkv (for DCP); the weights a seed draws must stay those of torchtitan's fused layout."""
    from forge_core.models.flavors import _base_config, _with_vocab

    fused_config = _with_vocab(_base_config(family, "tiny"), 32)  # torchtitan's builders: fused wqkv
    for layer in fused_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        fused = fused_config.build()
    assert type(fused.layers["0"].attention.qkv_linear).__name__ == "FusedQKVLinear"
    init_weights(fused, seed=11, device="cpu")
    ours = _cpu_model(_tiny(family), 32, seed=11)
    assert type(ours.layers["0"].attention.qkv_linear).__name__ == "QKVLinear"
    fused_state, our_state = fused.state_dict(), ours.state_dict()
    assert set(fused_state) == set(our_state)
    assert all(torch.equal(fused_state[k], our_state[k]) for k in fused_state)


def test_torch_dcp_full_state_dict_round_trips():
    """Parameters and state-dict keys coincide, so torch's DCP state-dict helpers work on forgeflow models."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    source, target = _cpu_model(_tiny("qwen3"), 32, seed=1), _cpu_model(_tiny("qwen3"), 32, seed=2)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(target, get_model_state_dict(source, options=options), options=options)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_config_validation_names_valid_flavors_without_importing_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from forge_core.config import ConfigError, load_config\n"
        "try:\n"
        "    load_config(None, ['model.family=qwen3', 'model.flavor=7B'])\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "model.flavor='7B': unknown flavor for model.family='qwen3'" in out
    assert "'0.6B'" in out and "'tiny'" in out
    assert "torch imported: False" in out


def test_length_buckets_are_powers_of_two_from_64_capped_at_the_context():
    from forge_core.models import length_bucket

    assert [length_bucket(n, 1024) for n in (1, 63, 64, 65, 100, 128, 129, 700, 1000, 1024)] == [
        64, 64, 64, 128, 128, 128, 256, 1024, 1024, 1024,
    ]  # fmt: skip
    assert {length_bucket(n, 1024) for n in range(1, 1025)} == {64, 128, 256, 512, 1024}
    assert length_bucket(40, 48) == 48 and length_bucket(300, 256) == 300  # beyond the context: unchanged
    with pytest.raises(ValueError, match="length=0"):
        length_bucket(0, 64)


@pytest.mark.parametrize("with_positions", [False, True])
def test_padding_to_a_bucket_leaves_every_real_position_unchanged(with_positions):
    """Causal attention: right padding cannot reach a real position, so the logits of the first L positions
    are those of the unpadded batch (up to kernel rounding across shapes)."""
    from forge_core.models import forward_logits

    model = _cpu_model(_tiny(max_seq_len=64), 32, seed=2)
    tokens_BL = torch.randint(0, 32, (3, 21), generator=torch.Generator().manual_seed(0))
    positions_BL = torch.arange(5, 26).expand(3, 21) if with_positions else None
    with torch.no_grad():
        plain = forward_logits(model, tokens_BL, positions_BL)
        padded = forward_logits(model, tokens_BL, positions_BL, pad_to=32)
    assert padded.shape == plain.shape
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_attention_is_sdpa_on_both_devices_with_the_reason():
    from forge_core.models import attention_choice

    cpu, cpu_reason = attention_choice("cpu")
    cuda, cuda_reason = attention_choice("cuda")
    assert (cpu, cuda) == ("sdpa", "sdpa")
    assert "right-padded" in cuda_reason and "recompiles" in cuda_reason
    assert "no CPU backward" in cpu_reason
    with pytest.raises(ValueError, match="device_type='mps'"):
        attention_choice("mps")
