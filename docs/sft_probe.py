"""Probes the demo's SFT budgets in one process: held-out accuracy along the way, without the flow.

    .venv/bin/python docs/sft_probe.py --seeds 1,3 --at 300,400 data.demo.num_sft=1500 sft.steps=500

Runs the real prepare stage into a temporary store, then the real `SFTTrainer` on one CPU rank (the same global
batch and sampler as the demo's 2 ranks) and, at each `--at` step and at the end, greedy exact match on the
held-out prompts, decoded with plain torch forward passes (no vLLM). It prints one JSON line per seed. It is how
the demo's `data.demo.num_sft` and `sft.steps` were chosen (README, "Does it learn?"): a run takes about 100 s
for 400 steps, and its accuracies track the flow's SFT evaluation within about 12 points (floating-point
reduction order differs between 1 and 2 ranks, and the moment the model starts to add is sensitive to it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import pyarrow.parquet as pq
import torch

from forge_core.config import load_config
from forge_core.data import demo, prepare_data
from forge_core.data.tokenizer import load_tokenizer
from forge_core.engine import Engine
from forge_core.models.logprobs import forward_logits
from forge_core.storage import ObjectStore
from forge_core.trainers.sft import SFTData, SFTTrainer

# `<answer>` + 3 digits + `</answer>` + EOS fit in far fewer tokens; extra tokens are ignored by the checker.
MAX_NEW_TOKENS = 12


def greedy_accuracy(model: torch.nn.Module, tokenizer, examples: list[demo.AdditionExample]) -> float:
    """Exact match of greedy completions; every prompt of a difficulty has the same token length."""
    prompts = [tokenizer.backend.encode(e.prompt).ids for e in examples]
    assert len({len(p) for p in prompts}) == 1, "demo prompts of one difficulty tokenize to one length"
    ids_BL = torch.tensor(prompts)
    model.eval()
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            next_B1 = forward_logits(model, ids_BL)[:, -1].argmax(-1, keepdim=True)
            ids_BL = torch.cat([ids_BL, next_B1], dim=1)
    model.train()
    texts = [tokenizer.backend.decode(row[len(prompts[0]) :].tolist()) for row in ids_BL]
    return sum(demo.check_answer(t, e.ground_truth) for t, e in zip(texts, examples)) / len(examples)


def probe(seed: int, probe_steps: set[int], overrides: list[str]) -> dict:
    workdir = tempfile.mkdtemp(prefix="sft-probe-")
    cfg = load_config(
        None,
        [
            "training.device=cpu",
            f"storage.root=file://{workdir}/store",
            "logging.wandb_mode=disabled",
            f"logging.dir={workdir}/runs",
            f"seed={seed}",
            *overrides,
        ],
    )
    store = ObjectStore.from_config(cfg.storage)
    data_uri = store.artifact_uri("data", "probe")
    prepare_data(cfg, data_uri, store)
    local = store.reader(data_uri).download_dir("", f"{workdir}/data")
    tokenizer = load_tokenizer(str(local / "tokenizer"))
    data = SFTData.from_table(pq.read_table(local / "sft.parquet"), cfg.sft.eval_rows, cfg.seed)
    settings = cfg.data.demo
    held_out = demo.generate_splits(
        settings.num_digits, settings.num_sft, settings.num_rl, settings.num_eval, cfg.seed
    )["eval"]
    engine = Engine.Config.from_run_config(
        cfg, tokenizer.vocab_size, cfg.sft.optimizer, total_steps=cfg.sft.steps
    ).build()
    trainer = SFTTrainer(engine, data, cfg.sft, seed=cfg.seed, log_every=cfg.sft.steps + 1)
    start = time.perf_counter()
    accuracy_at = {}
    while trainer.step < cfg.sft.steps:
        trainer.train_step(trainer.next_micro_batches(), trainer.loss)
        if trainer.step in probe_steps or trainer.step == cfg.sft.steps:
            accuracy_at[trainer.step] = greedy_accuracy(engine.model, tokenizer, held_out)
    return {
        "seed": seed,
        "overrides": overrides,
        "accuracy_at_step": accuracy_at,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_int_list, default=[0, 1, 2], help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--at", type=_int_list, default=[], help="also evaluate after these steps, e.g. 300,400")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for flows.demo")
    args = parser.parse_args(argv)
    # One intra-op thread: two probes then run side by side on 2 cores without slowing each other down.
    torch.set_num_threads(1)
    for seed in args.seeds:
        print(json.dumps(probe(seed, set(args.at), args.overrides)), flush=True)


if __name__ == "__main__":
    main()
