"""Probes the demo's SFT settings without the flow: the real SFT stage, its validation curve and selection, and
the held-out accuracy of the policy it exports.

    .venv/bin/python docs/sft_probe.py --seeds 0,3 sft.steps=1000 sft.target=0.4
    .venv/bin/python docs/sft_probe.py --seeds 0 sft.select=last sft.eval_every=25    # the whole curve

Per seed: the real prepare stage into a temporary store, then the real SFT stage under torchrun with the ranks
of `launch.sft` (the demo's 2, so the numbers are the flow's: floating-point reduction order differs between 1
and 2 ranks, and the moment the model starts to add is sensitive to it), then greedy exact match of the exported
policy on the first `eval.num_prompts` prompts of the eval split, scored by the run's primary reward, decoded
in torch (forge_core.trainers.validation.greedy_decode) rather than by vLLM: the flow's eval-sft stage, up to
vLLM's own kernels. It prints one JSON line per seed: the validation curve (step, loss, exact match), the
selected step and why, steps run, the held-out accuracy and the wall time. This is how the demo's SFT settings
were chosen (docs/getting-started.md, "Does it learn?"); a 500-step run takes about 2 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from forge_core.config import RunConfig, config_to_dict, load_config
from forge_core.data import prepare_data
from forge_core.data.tokenizer import load_tokenizer
from forge_core.engine import Engine
from forge_core.rewards import RewardSet
from forge_core.rollout.table import PASS_THRESHOLD
from forge_core.run.spec import StageSpec, write_spec
from forge_core.storage import ObjectStore
from forge_core.trainers import TitanTrainer
from forge_core.trainers.validation import greedy_decode

REPO = Path(__file__).resolve().parents[1]


def run_sft_stage(cfg: RunConfig, store: ObjectStore, data_uri: str, log_file: Path) -> str:
    """The SFT stage on `data_uri` under torchrun with launch.sft's ranks; returns its committed URI."""
    output_uri = store.artifact_uri("sft", "probe")
    spec_uri = write_spec(
        store, StageSpec(stage="sft", config=config_to_dict(cfg), inputs={"data": data_uri}, output_uri=output_uri)
    )
    ranks = cfg.launch.for_stage("sft").nproc_per_node
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "forge_core.run", "sft", "--spec", spec_uri]
    with log_file.open("w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the SFT stage failed (exit {done.returncode}); see {log_file}")
    return output_uri


def held_out_accuracy(cfg: RunConfig, store: ObjectStore, data_uri: str, policy_uri: str, workdir: Path) -> float:
    """Greedy exact match of the policy at `policy_uri` on the eval split, as the evaluate stage scores it."""
    policy = store.reader(policy_uri).download_dir("", workdir / "policy")
    tokenizer = load_tokenizer(str(policy))
    vocab_size = json.loads((policy / "config.json").read_text())["vocab_size"]
    engine = Engine.Config.from_run_config(
        cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps, init_weights_dir=str(policy)
    ).build()
    table = store.reader(data_uri).read_table("eval.parquet").slice(0, cfg.eval.num_prompts)
    prompts = table.column("prompt_ids").to_pylist()
    completions = greedy_decode(TitanTrainer(engine), prompts, cfg.eval.max_new_tokens, tokenizer.eos_id, 256)
    texts = [tokenizer.backend.decode([t for t in c if t != tokenizer.eos_id], skip_special_tokens=True)
             for c in completions]
    rewards = RewardSet.from_config(cfg.rollout.rewards)
    scored = rewards.score(texts, table.column("ground_truth").to_pylist(), [str(i) for i in range(len(texts))])
    return sum(v >= PASS_THRESHOLD for v in scored.columns[rewards.primary_column]) / len(texts)


def probe(seed: int, overrides: list[str], logs: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="sft-probe-"))
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
    start = time.perf_counter()
    sft_uri = run_sft_stage(cfg, store, data_uri, logs / f"sft-probe-seed-{seed}.log")
    wall_s = time.perf_counter() - start
    metrics = store.read_manifest(sft_uri).metrics
    return {
        "seed": seed,
        "overrides": overrides,
        "validation": [
            [p["step"], p["loss"], p.get("exact_match")] for p in metrics.get("validation", [])
        ],
        "selected_step": metrics["selected_step"],
        "selected_by": metrics["selected_by"],
        "steps": metrics["steps"],
        "held_out_accuracy": held_out_accuracy(cfg, store, data_uri, metrics["policy_uri"], workdir),
        "sft_wall_s": round(wall_s, 1),
        "train_tokens_per_s": round(metrics["tokens_per_s"]),
    }


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_int_list, default=[0, 1, 2, 3, 4], help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()), help="where the SFT logs go")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, as for flows.demo")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for seed in args.seeds:
        print(json.dumps(probe(seed, args.overrides, args.logs)), flush=True)


if __name__ == "__main__":
    main()
