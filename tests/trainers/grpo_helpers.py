"""Builders for the GRPO trainer tests: a tiny demo config, a committed parent policy (`sft` artifact with a
nested `policy/` HF folder) and a committed `rollouts` artifact whose generator logprobs come from that
policy. Plain functions, imported by the test modules."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pyarrow as pa
import torch

from forge_core.artifacts.policy import POLICY_DIR
from forge_core.config import RunConfig, load_config
from forge_core.data.demo import ALPHABET, AdditionExample
from forge_core.data.tokenizer import train_demo_tokenizer
from forge_core.models import build_model, init_weights, model_logprobs, write_hf_folder
from forge_core.run.spec import StageSpec, write_spec
from forge_core.storage import ObjectStore

PROMPTS, GROUP, MAX_NEW = 8, 4, 8


@contextlib.contextmanager
def intra_op_threads(count: int):
    """torch on `count` intra-op threads inside the block. Tests run tiny models on a shared 2-core box, where
    two OpenMP threads per process spin-wait on each other and make a step many times slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def grpo_test_config(tmp_path: Path, *overrides: str) -> RunConfig:
    """Tiny llama3 on CPU, 8 prompts x 4 samples, 2 epochs x 2 mini-batches of 16 (4 optimizer steps)."""
    return load_config(
        None,
        [
            "training.device=cpu",
            f"storage.root=file://{tmp_path}/store",
            "model.max_seq_len=64",
            "data.max_seq_len=64",
            f"rollout.prompts_per_iteration={PROMPTS}",
            f"rollout.sampling.group_size={GROUP}",
            f"rollout.sampling.max_new_tokens={MAX_NEW}",
            "grpo.mini_batch_size=16",
            "grpo.micro_batch_size=4",
            "grpo.epochs=2",
            "grpo.checkpoint_every=1",
            "grpo.optimizer.lr=1e-3",
            "logging.wandb_mode=disabled",
            f"logging.dir={tmp_path}/runs",
            *overrides,
        ],
    )


def demo_tokenizer(tmp_path: Path):
    """The demo task's BPE (trained on a few hundred examples), saved under tmp_path/tokenizer."""
    rng = random.Random(0)
    examples = [AdditionExample(rng.randrange(1000), rng.randrange(1000), 3) for _ in range(300)]
    tokenizer = train_demo_tokenizer(
        (e.prompt + e.completion for e in examples), vocab_size=64, model_max_length=64, alphabet=ALPHABET
    )
    tokenizer.save(str(tmp_path / "tokenizer"))
    return tokenizer


def plain_policy(cfg: RunConfig, vocab_size: int, state_dict: dict | None = None, seed: int = 0):
    """An unsharded CPU model (random init from `seed`, or `state_dict`)."""
    model = build_model(cfg.model, vocab_size, device="meta", attention="sdpa")
    init_weights(model, seed=seed, device="cpu")
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def write_policy_artifact(
    store: ObjectStore, uri: str, cfg: RunConfig, vocab_size: int, state_dict: dict, tokenizer_dir: Path,
    kind: str = "sft",
) -> str:
    """A committed training-stage artifact (`kind`) holding `policy/` as SFT/GRPO stages write it."""
    folder = tokenizer_dir.parent / f"hf-{uri.rstrip('/').rsplit('/', 1)[-1]}"
    write_hf_folder(state_dict, cfg.model, vocab_size, folder, tokenizer_dir=tokenizer_dir)
    policy = store.writer(store.join(uri, POLICY_DIR), kind="policy", stage=kind)
    for path in sorted(folder.iterdir()):
        policy.put_file(path, path.name)
    policy.commit(config={}, inputs={}, metrics={})
    outer = store.writer(uri, kind=kind, stage=kind)
    outer.write_json("train_summary.json", {})
    outer.commit(config={}, inputs={}, metrics={})
    return uri


def rollout_table(
    model: torch.nn.Module, tokenizer, policy_uri: str, seed: int = 0, prompts: int = PROMPTS, group: int = GROUP
) -> pa.Table:
    """`prompts` demo prompts x `group` random responses of 1..MAX_NEW tokens, with the logprobs `model`
    gives them (one unpadded forward per row) and rewards in [0, 1]; one group gets equal rewards."""
    rng = random.Random(seed)
    rows: dict[str, list] = {k: [] for k in (
        "prompt_ids", "response_ids", "response_logprobs", "group_id", "reward", "finish_reason", "policy_uri"
    )}
    vocab = tokenizer.vocab_size
    for p in range(prompts):
        example = AdditionExample(rng.randrange(1000), rng.randrange(1000), 3)
        prompt_ids = tokenizer.backend.encode(example.prompt).ids
        for _ in range(group):
            response = [rng.randrange(vocab) for _ in range(rng.randint(1, MAX_NEW))]
            tokens = torch.tensor([prompt_ids + response])
            with torch.no_grad():
                logprobs = model_logprobs(model, tokens[:, :-1], tokens[:, 1:])[0, len(prompt_ids) - 1 :]
            rows["prompt_ids"].append(prompt_ids)
            rows["response_ids"].append(response)
            rows["response_logprobs"].append(logprobs.tolist())
            rows["group_id"].append(p)
            rows["reward"].append(1.0 if p == 0 else float(rng.random() < 0.5))
            rows["finish_reason"].append("length" if len(response) == MAX_NEW else "stop")
            rows["policy_uri"].append(policy_uri)
    return pa.table(rows)


def write_rollouts_artifact(store: ObjectStore, uri: str, table: pa.Table) -> str:
    writer = store.writer(uri, kind="rollouts", stage="rollout")
    writer.write_table("rollouts.parquet", table)
    writer.commit(config={}, inputs={}, metrics={})
    return uri


def grpo_spec(cfg: RunConfig, store: ObjectStore, output_uri: str, inputs: dict[str, str], iteration: int = 0) -> str:
    from forge_core.config import config_to_dict

    spec = StageSpec(stage="grpo", config=config_to_dict(cfg), inputs=inputs, output_uri=output_uri,
                     params={"iteration": iteration})
    return write_spec(store, spec)


def read_policy_weights(store: ObjectStore, stage_uri: str, local_dir: Path) -> dict[str, torch.Tensor]:
    from forge_core.artifacts.policy import download_policy
    from forge_core.models import load_hf_folder

    return load_hf_folder(download_policy(store, stage_uri, local_dir))[0]
