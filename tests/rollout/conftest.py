"""Fixtures of the rollout tests: a real data artifact (demo task), a tiny exported policy, ONE vLLM engine.

Session-scoped because a vLLM engine takes tens of seconds to start on CPU: every generation test reuses
`generator`. The policy is forgeflow's llama3 `tiny` flavor built with torchtitan, redrawn at unit scale
(torchtitan's init gives near-uniform logits, under which parity and finish reasons would test little) and
exported with `write_hf_folder`, the trainer's own export path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from forge_core.config import config_from_dict
from forge_core.config.schema import ModelConfig, SamplingConfig
from forge_core.storage import ObjectStore

GROUP_SIZE = 4
MAX_NEW_TOKENS = 12
MODEL_CFG = ModelConfig(family="llama3", flavor="tiny", max_seq_len=128)
SAMPLING = SamplingConfig(group_size=GROUP_SIZE, temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
# What the `generator` fixture says it serves (a label: its folder is a copy, not a fetched artifact).
ENGINE_POLICY_VERSION = "test-policy"


def run_config_dict(store_root: str, **rollout) -> dict:
    """A small demo run: 40 RL prompts, 12 eval prompts, the tiny model; `rollout` overrides that section."""
    return {
        "seed": 3,
        "storage": {"root": store_root},
        "model": {"family": "llama3", "flavor": "tiny", "max_seq_len": MODEL_CFG.max_seq_len},
        "data": {"max_seq_len": 64, "demo": {"num_sft": 8, "num_rl": 40, "num_eval": 12}},
        "rollout": {
            "prompts_per_iteration": 6,
            "sampling": {"group_size": GROUP_SIZE, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
            "rewards": [{"name": "exact_answer", "weight": 1.0}, {"name": "per_digit", "weight": 0.5}],
            "kv_cache_gib": 1,
            "max_num_seqs": 64,
            "engine_lifetime": "stage",  # the stage-lifetime paths; tests of the flow engines set "flow"
            **rollout,
        },
        "eval": {"num_prompts": 8, "max_new_tokens": MAX_NEW_TOKENS},
        "grpo": {"iterations": 0},
    }


@dataclass(frozen=True)
class PolicyWorld:
    """A store holding a data artifact and an `sft` artifact whose `policy/` is `policy_dir`."""

    store: ObjectStore
    store_root: str
    data_uri: str
    stage_uri: str
    policy_dir: Path
    tokenizer_dir: Path
    vocab_size: int


def unit_scale_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw weights so logits are O(1..10): matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 1.5 / param.shape[-1] ** 0.5)
    return model


def write_policy(out_dir: Path, tokenizer_dir: Path, vocab_size: int, seed: int) -> Path:
    from forge_core.models import build_model, init_weights, write_hf_folder

    model = build_model(MODEL_CFG, vocab_size, device="meta", attention="sdpa")
    init_weights(model, seed=seed, device="cpu")
    unit_scale_(model, seed)
    return write_hf_folder(model.state_dict(), MODEL_CFG, vocab_size, out_dir, tokenizer_dir)


def commit_policy_stage(store: ObjectStore, stage_uri: str, policy_dir: Path) -> None:
    """Commit `policy_dir` like a training stage: the nested `policy` artifact, then the `sft` artifact."""
    policy = store.writer(store.join(stage_uri, "policy"), kind="policy", stage="sft")
    for path in sorted(policy_dir.iterdir()):
        policy.put_file(path, path.name)
    policy.commit(config={}, inputs={}, metrics={})
    stage = store.writer(stage_uri, kind="sft", stage="sft")
    stage.write_json("train_summary.json", {"metrics": {}})
    stage.commit(config={}, inputs={}, metrics={})


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> PolicyWorld:
    from forge_core.data.pipeline import prepare_data
    from forge_core.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("rollout-world")
    store_root = f"file://{root}/store"
    store = ObjectStore(store_root)
    cfg = config_from_dict(run_config_dict(store_root))
    data_uri = store.artifact_uri("data", "test-data")
    prepare_data(cfg, data_uri, store)
    tokenizer_dir = store.reader(data_uri).download_dir("tokenizer", root / "tokenizer")
    vocab_size = load_tokenizer(str(tokenizer_dir)).vocab_size
    policy_dir = write_policy(root / "policy", tokenizer_dir, vocab_size, seed=11)
    stage_uri = store.artifact_uri("sft", "test-policy")
    commit_policy_stage(store, stage_uri, policy_dir)
    return PolicyWorld(store, store_root, data_uri, stage_uri, policy_dir, tokenizer_dir, vocab_size)


# The second policy of the engine tests: other weights, the same architecture and tokenizer.
POLICY_B_KEY = "test-policy-b"


@pytest.fixture(scope="session")
def policy_b_uri(world, tmp_path_factory) -> str:
    """An `sft` artifact like the world's, with policy B (other weights) as its `policy/`."""
    root = tmp_path_factory.mktemp("policy-b")
    other_dir = write_policy(root / "policy-b", world.tokenizer_dir, world.vocab_size, seed=12)
    uri = world.store.artifact_uri("sft", POLICY_B_KEY)
    commit_policy_stage(world.store, uri, other_dir)
    return uri


@pytest.fixture(scope="module")
def policies(world, policy_b_uri, tmp_path_factory):
    """Policy A (the world's) and policy B, fetched as a stage fetches them (a cache of the module's own)."""
    from forge_core.artifacts.policy import fetch_policy

    cache = tmp_path_factory.mktemp("policy-cache")
    return (
        fetch_policy(world.store, world.stage_uri, cache_root=cache),
        fetch_policy(world.store, policy_b_uri, cache_root=cache),
    )


# Module scope, not session: an in-process engine shares torch.distributed's default group with the process,
# and a later suite that initialises and destroys groups (trainers) would break its teardown.
@pytest.fixture(scope="module")
def generator(world, tmp_path_factory):
    """The vLLM engine of one rollout test module, on a private copy of the policy (reload tests rewrite it)."""
    import shutil

    from forge_core.rollout import EngineOptions, Generator

    engine_dir = tmp_path_factory.mktemp("engine") / "policy"
    shutil.copytree(world.policy_dir, engine_dir)
    engine = EngineOptions(kv_cache_gib=1, max_num_seqs=64, in_process=True)
    gen = Generator(engine_dir, engine, policy_version=ENGINE_POLICY_VERSION)
    yield gen
    gen.close()
