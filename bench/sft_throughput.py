"""Benchmark: SFTTrainer training tokens/s vs a minimal hand-written PyTorch loop on the same model and data.

    python -m bench.sft_throughput            # writes bench/results/sft_throughput.json, prints it last
    python -m bench.sft_throughput --quick    # fewer steps (smoke run)

Ours: `SFTTrainer` on the demo task's real `sft.parquet` (prepare stage), world size 1: every optimizer step
samples its global batch, pads micro-batches, runs the engine (the torchtitan model as one fp32 rank trains
it: plain, since FSDP2 wraps it only to shard or cast; fused AdamW, LR schedule, torchtitan's grad clipping)
and reduces metrics - the exact path of the SFT stage.
Baseline: the same torchtitan model unwrapped, the same initial weights, `torch.optim.AdamW(fused=True)`
with the same hyper-parameters, the same micro-batches (pre-padded, so the baseline pays no data cost),
`log_softmax` + masked token mean, backward, `clip_grad_norm_`, step. Both run in this process, alternating
after warm-up (bench.harness.alternate). Target: ratio of tokens/s >= 0.95.

Workloads: `demo` (the headline: llama3 `tiny`, batch 128 in micro-batches of 64, the demo defaults) and
`small` (llama3 `small`, ~5M parameters, batch 32 in micro-batches of 16) in details. Peak memory: process
RSS high-water mark and, on GPU, the torch allocator peak.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from bench.harness import alternate, median, summarize, write_result
from forge_core.config import RunConfig, load_config
from forge_core.data import prepare_data
from forge_core.engine import Engine
from forge_core.models import build_model, forward_logits, init_weights, token_logprobs
from forge_core.storage import ObjectStore
from forge_core.trainers.sampler import GlobalBatchSampler
from forge_core.trainers.sft import SFTData, SFTTrainer, micro_batches

STEPS_PER_ROUND = 5


@dataclass
class Workload:
    name: str
    flavor: str
    batch_size: int
    micro_batch_size: int


WORKLOADS = [Workload("demo", "tiny", 128, 64), Workload("small", "small", 32, 16)]


def _config(workdir: Path, w: Workload) -> RunConfig:
    return load_config(
        None,
        [
            f"storage.root=file://{workdir}/store",
            f"model.flavor={w.flavor}",
            f"sft.batch_size={w.batch_size}",
            f"sft.micro_batch_size={w.micro_batch_size}",
            "sft.steps=100000",
            "sft.eval_rows=0",
            "sft.select=last",  # no validation rows: nothing to select or stop on
            "sft.target=null",
            "logging.wandb_mode=disabled",
        ],
    )


def _sft_data(cfg: RunConfig) -> tuple[SFTData, int]:
    store = ObjectStore.from_config(cfg.storage)
    uri = store.artifact_uri("data", "bench")
    if not store.is_committed(uri):
        prepare_data(cfg, uri, store)
    reader = store.reader(uri)
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = reader.download_dir("tokenizer", tmp)
        vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return SFTData.from_table(reader.read_table("sft.parquet"), eval_rows=0, seed=cfg.seed), vocab


class HandWrittenLoop:
    """The baseline: what one would write by hand for the same SFT step."""

    def __init__(self, cfg: RunConfig, vocab: int, micro_batches_per_step: list[list]) -> None:
        self.model = build_model(cfg.model, vocab, device="meta", attention="sdpa")
        init_weights(self.model, seed=cfg.seed, device="cpu")
        opt = cfg.sft.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            fused=True,
        )
        self.grad_clip = opt.grad_clip
        self.steps = micro_batches_per_step
        self.cursor = 0

    def step(self) -> float:
        step_batches = self.steps[self.cursor % len(self.steps)]
        self.cursor += 1
        tokens = sum(int(mb.loss_mask_BL.sum()) for mb in step_batches)
        for mb in step_batches:
            logp = token_logprobs(forward_logits(self.model, mb.input_ids_BL), mb.target_ids_BL)
            loss = -(logp * mb.loss_mask_BL).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_workload(w: Workload, workdir: Path, repeats: int) -> dict:
    cfg = _config(workdir, w)
    data, vocab = _sft_data(cfg)
    rss_start = _rss_mib()
    engine = Engine.Config.from_run_config(cfg, vocab, cfg.sft.optimizer, cfg.sft.steps).build()
    trainer = SFTTrainer(engine, data, cfg.sft, seed=cfg.seed)
    rss_ours = _rss_mib() - rss_start
    # The baseline trains on the same global batches, drawn by an identical sampler and pre-padded.
    sampler = GlobalBatchSampler(len(data.train_rows), w.batch_size, 1, 0, cfg.seed)
    prebuilt = [
        micro_batches([data.train_rows[i] for i in sampler.next_global_rows()], w.micro_batch_size)
        for _ in range(4 * STEPS_PER_ROUND)
    ]
    rss_before_baseline = _rss_mib()
    baseline = HandWrittenLoop(cfg, vocab, prebuilt)
    rss_baseline = _rss_mib() - rss_before_baseline

    tokens_per_step = [sum(mb.num_tokens() for mb in step) for step in prebuilt]
    mean_tokens = sum(tokens_per_step) / len(tokens_per_step)

    def ours() -> None:
        for _ in range(STEPS_PER_ROUND):
            trainer.train_step(trainer.next_micro_batches(), trainer.loss)

    def base() -> None:
        for _ in range(STEPS_PER_ROUND):
            baseline.step()

    ours_s, base_s = alternate(ours, base, warmup=1, repeats=repeats)
    ours_tps = mean_tokens * STEPS_PER_ROUND / median(ours_s)
    base_tps = mean_tokens * STEPS_PER_ROUND / median(base_s)
    peak = {
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_added_by_trainer_mib": rss_ours,
        "rss_added_by_baseline_mib": rss_baseline,
    }
    if torch.cuda.is_available():
        peak["cuda_allocator_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return {
        "tokens_per_s": ours_tps,
        "baseline_tokens_per_s": base_tps,
        "ratio": ours_tps / base_tps,
        "params": engine.num_params,
        "tokens_per_step": mean_tokens,
        "ours_round_s": summarize(ours_s),
        "baseline_round_s": summarize(base_s),
        "memory": peak,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    # One intra-op thread on both sides: what each rank gets under torchrun (OMP_NUM_THREADS=1), and on a
    # shared machine 2 OpenMP threads per process spin-wait each other into noise.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed rounds instead of 7")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        results = {w.name: run_workload(w, Path(tmp), repeats) for w in WORKLOADS}
    headline = results["demo"]
    write_result(
        "sft_throughput",
        value=headline["tokens_per_s"],
        baseline=headline["baseline_tokens_per_s"],
        target=">=0.95",
        unit="tokens/s",
        details={
            "workloads": results,
            "note": "world size 1 on CPU; ours = SFTTrainer.train_step incl. sampling/padding, baseline = "
            "hand-written loop on pre-padded batches; tokens = real (non-pad) input tokens",
        },
    )


if __name__ == "__main__":
    main()
