"""Builders for the SFT/TitanTrainer tests: a tiny CPU config, synthetic token rows, a committed demo `data`
artifact written by the real prepare stage, and a gloo rank's worker for spawned two-rank tests. Plain functions,
imported by the test modules (and by the spawned ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forge_core.config import RunConfig, config_to_dict, load_config
from forge_core.data import prepare_data
from forge_core.engine import Engine
from forge_core.run.spec import StageSpec, write_spec
from forge_core.storage import ObjectStore
from forge_core.trainers import TitanTrainer

VOCAB = 40


def sft_test_config(tmp_path: Path, *overrides: str) -> RunConfig:
    """Tiny llama3 on CPU; 6 SFT steps of 16 rows in micro-batches of 4, warmup + cosine LR."""
    return load_config(
        None,
        [
            "training.device=cpu",
            f"storage.root=file://{tmp_path}/store",
            "model.max_seq_len=64",
            "data.max_seq_len=64",
            "data.demo.num_sft=120",
            "data.demo.num_rl=8",
            "data.demo.num_eval=8",
            "sft.steps=6",
            "sft.batch_size=16",
            "sft.micro_batch_size=4",
            "sft.eval_rows=16",
            "sft.eval_every=3",
            "sft.checkpoint_every=2",
            "sft.optimizer.warmup_steps=2",
            "sft.optimizer.decay=cosine",
            "logging.wandb_mode=disabled",
            f"logging.dir={tmp_path}/runs",
            "logging.log_every=1",
            *overrides,
        ],
    )


def token_rows(n: int, seed: int = 0, vocab: int = VOCAB) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random rows of 6-13 tokens whose second half is the completion (loss_mask = 1)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length = int(rng.integers(6, 14))
        mask = np.zeros(length, np.int8)
        mask[length // 2 :] = 1
        rows.append((rng.integers(1, vocab, length), mask))
    return rows


def tiny_trainer(cfg: RunConfig, steps: int = 10, **kwargs) -> TitanTrainer:
    engine = Engine.Config.from_run_config(cfg, VOCAB, cfg.sft.optimizer, total_steps=steps).build()
    return TitanTrainer(engine, **kwargs)


def committed_data_artifact(cfg: RunConfig) -> str:
    store = ObjectStore.from_config(cfg.storage)
    uri = store.artifact_uri("data", "demo")
    if not store.is_committed(uri):
        prepare_data(cfg, uri, store)
    return uri


def sft_spec(cfg: RunConfig, data_uri: str, key: str) -> str:
    """Write the spec of an SFT stage run into `<root>/sft/<key>`; returns the spec URI."""
    store = ObjectStore.from_config(cfg.storage)
    spec = StageSpec(
        stage="sft",
        config=config_to_dict(cfg),
        inputs={"data": data_uri},
        output_uri=store.artifact_uri("sft", key),
    )
    return write_spec(store, spec)


@pytest.fixture(autouse=False)
def one_intra_op_thread():
    """Run torch on one intra-op thread during a test: on the shared 2-core CI box, OpenMP spin-waiting with 2
    threads per process makes tiny CPU steps up to 40x slower when other processes compete for the cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def reshard_policy_worker(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks: 3 steps of 2 micro-batches of this rank's rows under each reshard-after-forward
    policy (`default`, `never`), counting FSDP's all-gathers and gradient reductions; rank 0 saves {policy: steps,
    weights, gathers, reduces, the policy the engine reports} to `out_dir`/policies.pt."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from forge_core.losses import TokenCrossEntropy
    from forge_core.trainers import pad_token_rows

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        results = {}
        for policy in ("default", "never"):
            cfg = sft_test_config(Path(out_dir) / policy, f"training.parallelism.reshard_after_forward={policy}")
            trainer = tiny_trainer(cfg)
            batches = [pad_token_rows(token_rows(8, seed=10 * step + rank)) for step in range(3)]
            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                steps = [trainer.train_step(batch.split(4), TokenCrossEntropy()) for batch in batches]
            events = [event.name for event in profiled.events()]
            gathers = sum(1 for name in events if name.startswith("FSDP::all_gather") and "copy_out" not in name)
            reduces = sum(1 for name in events if name.startswith("FSDP::post_backward_reduce"))
            results[policy] = {
                "steps": [(m["loss"], m["grad_norm"]) for m in steps],
                "weights": trainer.engine.full_state_dict(),
                "gathers": gathers,
                "reduces": reduces,
                "reported": trainer.engine.describe()["reshard_after_forward"],
            }
        if rank == 0:
            torch.save(results, Path(out_dir) / "policies.pt")
    finally:
        dist.destroy_process_group()
