"""Benchmark: seconds per GRPO optimizer step, forgeflow's GRPOTrainer vs TRL's GRPOTrainer, same model, same
rollout batch, same loss.

    python -m bench.grpo_step            # writes bench/results/grpo_step.json, prints it last
    python -m bench.grpo_step --quick    # fewer repeats (smoke run)

Workload (the demo defaults): llama3 `tiny` initialised from one HF folder on both sides, a rollout batch of
32 demo prompts x 8 completions (1..16 tokens, generator logprobs from the same weights, 0/1 rewards), one
optimizer step per batch in 4 micro-batches of 64, the DAPO token-mean clipped surrogate (clip 0.2 / 0.28,
ratio against the stored generator logprobs, no KL), fused AdamW, gradient clipping at 1.0.

Ours: `GRPOTrainer.fit` on the batch (`rollouts_to_rl_batch`): the exact path of the GRPO stage (world size 1:
the torchtitan model as one fp32 rank trains it, plain; per-micro-batch padding trim, no-grad entropy, metric
reduction).
Baseline: TRL's `GRPOTrainer` (loss_type="dapo", beta=0, epsilon 0.2, epsilon_high 0.28, num_generations 8,
per_device_train_batch_size 64 x gradient_accumulation_steps 4) on a transformers Llama loaded from the same
HF folder; each step runs TRL's own `compute_loss` on its micro-batch dicts (left-padded prompts, right-padded
completions, our advantages, `old_per_token_logps` = the generator logprobs), `accelerator.backward`,
`clip_grad_norm_` and the optimizer/scheduler step - Trainer's inner loop without generation, which both
sides leave out. The first step's losses must agree (same loss on the same batch), else the run fails.

TRL is not a forgeflow dependency: the benchmark installs trl==1.16.0 and accelerate==1.15.0 (their other
requirements are already in the project venv) with `pip install --no-deps --target ~/.cache/forgeflow/
bench-trl-1.16.0` on first use and imports them from there, so both sides run in this one process.
Target: ours / TRL seconds per step < 1.

The GRPO family (`bench/results/grpo_step.family.json`): on the same engine and batch, one optimizer step of
every other loss (clipped_seq_mean, clipped_fixed_horizon, gspo, cispo) and of every mismatch correction
(tis, mis, geo_mask, icepop, each on the token-mean loss) against the token-mean loss without correction,
plus the corrections' extra no-grad forward (`GRPOTrainer.score_logprobs` over the whole rollout batch), all
interleaved round by round (bench.harness.interleave). The extra forward runs once per rollout batch, so a
correction's step time is its step + extra forward / (steps the batch feeds): reported at the default
grpo.epochs (2 passes over the batch; the value) and at one step per batch (the worst case, in details).
Value = the slowest variant's seconds per step, baseline = token-mean's; target: every variant <= 1.25x.

The output layer (`bench/results/grpo_step.output_layer.json`): one optimizer step of the token-mean loss where
the trainer runs the vocabulary projection, log-softmax and entropy at the loss (completion) positions alone,
against the same trainer running them at every position (prompt and padding included), alternated on one engine
and batch. Workload: the llama3 `medium` body with a 16k vocabulary (the output layer is a quarter of the
model's matrix work, as in Qwen3-0.6B), 32 completions of 8..88 tokens after 48-token prompts, 2 micro-batches
of 16. The arithmetic expects a ratio near 1 - share x skipped positions = 1 - 0.235 x 0.59 = 0.86; target:
<= 0.93, at least half that saving. Details give each side's positions and logits per micro-batch, and the
output layer's share for Qwen3-0.6B, Qwen3-1.7B and Llama-3.1-8B by the same arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from bench.harness import alternate, interleave, median, summarize, write_result

TRL_PINS = ("trl==1.16.0", "accelerate==1.15.0")
TRL_SITE = Path(os.environ.get("FORGE_BENCH_TRL_SITE", Path.home() / ".cache/forgeflow/bench-trl-1.16.0"))
# GRPOConfig settings that make TRL compute our GRPO loss and optimizer step (DAPO token mean, clip 0.2 / 0.28,
# no KL, fused AdamW 0.9 / 0.95, clipping at 1.0, constant LR) on CPU in fp32, with nothing saved or reported.
TRL_MATCHED_ARGS = {
    "beta": 0.0,
    "loss_type": "dapo",
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "constant",
    "optim": "adamw_torch_fused",
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "save_strategy": "no",
}
PROMPTS, GROUP, MAX_NEW, MICRO = 32, 8, 16, 64
LR = 5e-4
BASELINE_VARIANT = "clipped_token_mean"
# name -> (grpo.loss.type, grpo.correction.type): the family measured against BASELINE_VARIANT.
FAMILY = {
    BASELINE_VARIANT: ("clipped_token_mean", "none"),
    "clipped_seq_mean": ("clipped_seq_mean", "none"),
    "clipped_fixed_horizon": ("clipped_fixed_horizon", "none"),
    "gspo": ("gspo", "none"),
    "cispo": ("cispo", "none"),
    "tis": ("clipped_token_mean", "tis"),
    "mis": ("clipped_token_mean", "mis"),
    "geo_mask": ("clipped_token_mean", "geo_mask"),
    "icepop": ("clipped_token_mean", "icepop"),
}
FAMILY_TARGET = 1.25
# The output-layer comparison: a model and batch where the vocabulary projection is a realistic share.
OUTPUT_VOCAB, OUTPUT_ROWS, OUTPUT_PROMPT, OUTPUT_RESPONSES, OUTPUT_MICRO = 16384, 32, 48, (8, 88), 16
OUTPUT_TARGET = 0.93


def ensure_trl() -> str:
    """Import path for TRL: the installed one if it is the pinned version, else the benchmark's own copy."""
    wanted = TRL_PINS[0].split("==")[1]
    try:
        import trl

        if trl.__version__ == wanted:
            return "installed"
    except ImportError:
        pass
    if not (TRL_SITE / "trl").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TRL_SITE), *TRL_PINS],
            check=True,
        )
    sys.path.insert(0, str(TRL_SITE))
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    return str(TRL_SITE)


# ---- the shared workload ------------------------------------------------------------------------------------


def make_workload(workdir: Path):
    """(run config, HF folder of the starting policy, vocab size, rollout table)."""
    from forge_core.config import load_config
    from forge_core.data.demo import ALPHABET, AdditionExample
    from forge_core.data.tokenizer import train_demo_tokenizer
    from forge_core.models import build_model, init_weights, model_logprobs, write_hf_folder

    cfg = load_config(
        None,
        [
            f"storage.root=file://{workdir}/store",
            f"rollout.prompts_per_iteration={PROMPTS}",
            f"rollout.sampling.group_size={GROUP}",
            f"rollout.sampling.max_new_tokens={MAX_NEW}",
            f"grpo.mini_batch_size={PROMPTS * GROUP}",
            "grpo.epochs=1",  # one optimizer step per batch, whatever the demo's default
            f"grpo.micro_batch_size={MICRO}",
            f"grpo.optimizer.lr={LR}",
            # TRL's dapo normaliser counts the tokens of zero-variance groups too.
            "grpo.advantage.drop_zero_variance_groups=false",
            "logging.wandb_mode=disabled",
        ],
    )
    rng = random.Random(0)
    examples = [AdditionExample(rng.randrange(1000), rng.randrange(1000), 3) for _ in range(PROMPTS)]
    tokenizer = train_demo_tokenizer(
        (e.prompt + e.completion for e in examples * 8), vocab_size=64, model_max_length=256, alphabet=ALPHABET
    )
    tokenizer.save(str(workdir / "tokenizer"))
    vocab = tokenizer.vocab_size
    model = build_model(cfg.model, vocab, device="meta", attention="sdpa")
    init_weights(model, seed=0, device="cpu")
    hf_dir = write_hf_folder(model.state_dict(), cfg.model, vocab, workdir / "policy", tokenizer_dir=workdir / "tokenizer")

    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_logprobs", "group_id", "reward", "finish_reason")}
    for group, example in enumerate(examples):
        prompt = tokenizer.backend.encode(example.prompt).ids
        for _ in range(GROUP):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, MAX_NEW))]
            tokens = torch.tensor([prompt + response])
            with torch.no_grad():
                logprobs = model_logprobs(model, tokens[:, :-1], tokens[:, 1:])[0, len(prompt) - 1 :]
            rows["prompt_ids"].append(prompt)
            rows["response_ids"].append(response)
            rows["response_logprobs"].append(logprobs.tolist())
            rows["group_id"].append(group)
            rows["reward"].append(float(rng.random() < 0.5))
            rows["finish_reason"].append("length" if len(response) == MAX_NEW else "stop")
    return cfg, Path(hf_dir), vocab, pa.table(rows)


# ---- ours ---------------------------------------------------------------------------------------------------


class Ours:
    def __init__(self, cfg, hf_dir: Path, vocab: int, table: pa.Table) -> None:
        from forge_core.engine import Engine
        from forge_core.losses.grpo import build_policy_loss
        from forge_core.trainers.grpo import GRPOTrainer, rollouts_to_rl_batch

        engine = Engine.Config.from_run_config(
            cfg, vocab, cfg.grpo.optimizer, total_steps=10_000, init_weights_dir=str(hf_dir)
        ).build()
        self.trainer = GRPOTrainer(engine, cfg.grpo, build_policy_loss(cfg.grpo.loss, MAX_NEW))
        rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage)
        self.batch = rollouts.batch
        self.advantages_B = rollouts.batch.advantages_B
        self.losses: list[float] = []

    def step(self) -> None:
        history = self.trainer.fit(self.batch, seed=0)
        assert len(history) == 1, "one optimizer step per rollout batch"
        self.losses.append(history[0]["loss"])

    def family_step(self, cfg, loss_type: str, correction: str):
        """One optimizer step with another loss or correction on this trainer and batch (a correction's batch
        carries old logprobs, scored once up front: its extra forward is timed on its own)."""
        from forge_core.config import replace
        from forge_core.config.schema import CorrectionConfig
        from forge_core.losses.grpo import build_policy_loss

        loss = build_policy_loss(
            replace(cfg.grpo.loss, type=loss_type), MAX_NEW, CorrectionConfig(type=correction)
        )
        batch = self.batch
        if correction != "none":
            batch = dataclasses.replace(batch, old_logprobs_BL=self.trainer.score_logprobs(batch))

        def step() -> None:
            self.trainer.loss = loss
            history = self.trainer.fit(batch, seed=0)
            assert len(history) == 1 and "skipped" not in history[0], "one optimizer step per rollout batch"

        return step

    def extra_forward(self) -> None:
        """The corrections' extra no-grad forward: the batch scored under the current weights (in sync mode,
        the sampler's)."""
        self.trainer.score_logprobs(self.batch)


EXTRA_FORWARD = "extra_forward"


def measure_family(ours: Ours, cfg, repeats: int) -> dict:
    """Seconds per step of every FAMILY variant and of the extra forward, interleaved on one engine and
    batch; each variant's ratio to token-mean at the default epochs and at one step per rollout batch."""
    saved = ours.trainer.loss
    try:
        sides = {name: ours.family_step(cfg, *spec) for name, spec in FAMILY.items()}
        times = interleave({**sides, EXTRA_FORWARD: ours.extra_forward}, warmup=2, repeats=repeats)
    finally:
        ours.trainer.loss = saved
    from forge_core.config.schema import GRPOConfig as ForgeGRPOConfig

    base, forward = median(times[BASELINE_VARIANT]), median(times[EXTRA_FORWARD])
    epochs = ForgeGRPOConfig().epochs  # the default passes over a rollout batch
    family = {}
    for name, (_, correction) in FAMILY.items():
        extra = forward if correction != "none" else 0.0
        step = median(times[name])
        family[name] = {
            "per_step_s": step + extra / epochs,
            "ratio": (step + extra / epochs) / base,
            "ratio_one_step_per_batch": (step + extra) / base,
            "step_s": summarize(times[name]),
        }
    return {"variants": family, "extra_forward_s": summarize(times[EXTRA_FORWARD]), "epochs": epochs}


# ---- the output layer at the loss positions ------------------------------------------------------------------


# (hidden, layers, attention width, key/value width, FFN width, vocabulary) of public models, for the output
# layer's share of the matrix work per token (`output_share`).
PUBLIC_SHAPES = {
    "Qwen3-0.6B": (1024, 28, 2048, 1024, 3072, 151936),
    "Qwen3-1.7B": (2048, 28, 2048, 1024, 6144, 151936),
    "Llama-3.1-8B": (4096, 32, 4096, 1024, 14336, 128256),
}


def output_share(hidden: int, layers: int, attention: int, kv: int, ffn: int, vocab: int) -> float:
    """The output layer's share of a decoder's matrix multiply-adds per token (attention scores left out)."""
    per_layer = hidden * attention * 2 + hidden * kv * 2 + hidden * ffn * 3
    return hidden * vocab / (layers * per_layer + hidden * vocab)


def output_layer_sides(workdir: Path) -> tuple[Any, Any, Any, dict]:
    """(the trainer, the same engine's trainer running the output layer at every position, the batch, the
    workload's facts) for the output-layer comparison."""
    from forge_core.config import load_config
    from forge_core.engine import Engine
    from forge_core.losses import ModelOutputs
    from forge_core.losses.grpo import build_policy_loss
    from forge_core.models import token_entropy, token_logprobs
    from forge_core.trainers.grpo import GRPOTrainer, rollouts_to_rl_batch

    class EveryPositionTrainer(GRPOTrainer):
        """The trainer as it was: logits, log-softmax and entropy at every position, the loss masking them."""

        def _model_outputs(self, batch, with_entropy):
            logits_BLV = self.logits(batch.input_ids_BL, batch.positions_BL)
            entropy_BL = None
            if with_entropy:
                with torch.no_grad():
                    entropy_BL = token_entropy(logits_BLV.detach())
            return ModelOutputs(token_logprobs(logits_BLV, batch.target_ids_BL), entropy_BL)

    shortest, longest = OUTPUT_RESPONSES
    cfg = load_config(
        None,
        [
            f"storage.root=file://{workdir}/store",
            "model.flavor=medium",
            f"rollout.sampling.max_new_tokens={longest}",
            f"grpo.mini_batch_size={OUTPUT_ROWS}",
            "grpo.epochs=1",
            f"grpo.micro_batch_size={OUTPUT_MICRO}",
            f"grpo.optimizer.lr={LR}",
            "grpo.advantage.drop_zero_variance_groups=false",
            "logging.wandb_mode=disabled",
        ],
    )
    engine = Engine.Config.from_run_config(cfg, OUTPUT_VOCAB, cfg.grpo.optimizer, total_steps=10_000).build()
    loss = build_policy_loss(cfg.grpo.loss, longest)
    at_loss, everywhere = GRPOTrainer(engine, cfg.grpo, loss), EveryPositionTrainer(engine, cfg.grpo, loss)
    rng = random.Random(1)
    group = cfg.rollout.sampling.group_size
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_logprobs", "group_id", "reward", "finish_reason")}
    for index in range(OUTPUT_ROWS):
        if index % group == 0:
            prompt = [rng.randrange(3, OUTPUT_VOCAB) for _ in range(OUTPUT_PROMPT)]
        response = [rng.randrange(3, OUTPUT_VOCAB) for _ in range(rng.randint(shortest, longest))]
        rows["prompt_ids"].append(prompt)
        rows["response_ids"].append(response)
        rows["response_logprobs"].append([0.0] * len(response))
        rows["group_id"].append(index // group)
        rows["reward"].append(float(rng.random() < 0.5))
        rows["finish_reason"].append("length" if len(response) == longest else "stop")
    batch = rollouts_to_rl_batch(pa.table(rows), cfg.grpo.advantage).batch
    batch = dataclasses.replace(batch, generator_logprobs_BL=at_loss.score_logprobs(batch))  # sampled on-policy
    step = at_loss.plan(batch.batch_size, 0)[0]
    micro = at_loss.micro_batches(batch, step)
    hidden, out = engine.model.lm_head.weight.shape[1], engine.model.lm_head.weight.numel()
    body = sum(p.numel() for name, p in engine.model.named_parameters() if name.startswith("layers.") and p.dim() == 2)
    positions = sum(m.input_ids_BL.numel() for m in micro)
    facts = {
        "workload": (
            f"llama3 medium body (hidden {hidden}) with a {OUTPUT_VOCAB}-token vocabulary, {OUTPUT_ROWS} completions "
            f"of {shortest}..{longest} tokens after {OUTPUT_PROMPT}-token prompts, {len(micro)} micro-batches of "
            f"{OUTPUT_MICRO}, token-mean loss, entropy logged"
        ),
        "positions_per_step": {"every": positions, "at_loss": batch.num_loss_tokens()},
        "fp32_logits_gb_per_micro_batch": {
            "every": max(m.input_ids_BL.numel() for m in micro) * OUTPUT_VOCAB * 4 / 1e9,
            "at_loss": max(m.num_loss_tokens() for m in micro) * OUTPUT_VOCAB * 4 / 1e9,
        },
        "expected_ratio": round(1 - out / (body + out) * (1 - batch.num_loss_tokens() / positions), 3),
        "output_layer_share": {
            "this workload": round(out / (body + out), 3),
            **{name: round(output_share(*shape), 3) for name, shape in PUBLIC_SHAPES.items()},
        },
    }
    return at_loss, everywhere, batch, facts


def measure_output_layer(workdir: Path, repeats: int) -> dict:
    """Seconds per step with the output layer at the loss positions and at every position, alternated."""
    at_loss, everywhere, batch, facts = output_layer_sides(workdir)

    def step(trainer) -> Callable[[], None]:
        return lambda: trainer.fit(batch, seed=0)

    selected_s, every_s = alternate(step(at_loss), step(everywhere), warmup=1, repeats=repeats)
    return {"at_loss_s": selected_s, "every_s": every_s, **facts}


# ---- TRL ----------------------------------------------------------------------------------------------------


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def _right_pad(rows: list[list], pad, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    values = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        values[i, : len(row)] = torch.tensor(row, dtype=dtype)
        mask[i, : len(row)] = 1
    return values, mask


class TRLBaseline:
    def __init__(self, hf_dir: Path, table: pa.Table, advantages_B: torch.Tensor, workdir: Path) -> None:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        args = GRPOConfig(
            output_dir=str(workdir / "trl"),
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
            num_generations=GROUP,
            max_completion_length=MAX_NEW,
            learning_rate=LR,
            **TRL_MATCHED_ARGS,
            logging_steps=10_000,
        )
        dataset = Dataset.from_dict({"prompt": ["Q: 000+000=? A: "] * PROMPTS})
        self.trainer = GRPOTrainer(
            model=self.model,
            reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        self.trainer.create_optimizer_and_scheduler(num_training_steps=10_000)
        # Set by Trainer's training loop, which we do not enter (it would generate).
        self.trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self.model.train()
        self.micro_batches = self._micro_batches(table, advantages_B, tokenizer.pad_token_id)
        self.losses: list[float] = []

    @staticmethod
    def _micro_batches(table: pa.Table, advantages_B: torch.Tensor, pad: int) -> list[dict]:
        prompts = table.column("prompt_ids").to_pylist()
        responses = table.column("response_ids").to_pylist()
        logprobs = table.column("response_logprobs").to_pylist()
        num_items = torch.tensor(float(sum(map(len, responses))))
        batches = []
        for start in range(0, len(prompts), MICRO):
            rows = slice(start, start + MICRO)
            prompt_ids, prompt_mask = _left_pad(prompts[rows], pad)
            completion_ids, completion_mask = _right_pad(responses[rows], pad, torch.long)
            old_logps, _ = _right_pad(logprobs[rows], 0.0, torch.float32)
            batches.append({
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids,
                "completion_mask": completion_mask,
                "advantages": advantages_B[rows].clone(),
                "old_per_token_logps": old_logps,
                "num_items_in_batch": num_items,
            })
        return batches

    def step(self) -> None:
        trainer = self.trainer
        total = 0.0
        for inputs in self.micro_batches:
            loss = trainer.compute_loss(self.model, inputs)
            trainer.accelerator.backward(loss)
            total += float(loss.detach())
        trainer.accelerator.clip_grad_norm_(self.model.parameters(), trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad()
        self.losses.append(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = parser.parse_args()
    trl_source = ensure_trl()
    import trl

    from forge_core.engine import destroy_distributed

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="forge-bench-grpo-") as tmp:
        workdir = Path(tmp)
        cfg, hf_dir, vocab, table = make_workload(workdir)
        ours = Ours(cfg, hf_dir, vocab, table)
        baseline = TRLBaseline(hf_dir, table, ours.advantages_B, workdir)
        try:
            ours_s, trl_s = alternate(ours.step, baseline.step, warmup=2, repeats=5 if args.quick else 15)
            family = measure_family(ours, cfg, repeats=5 if args.quick else 30)
            output_layer = measure_output_layer(workdir, repeats=3 if args.quick else 7)
        finally:
            destroy_distributed()
    load = {"before": list(load_before), "after": list(os.getloadavg()), "cpus": os.cpu_count()}
    first_ours, first_trl = ours.losses[0], baseline.losses[0]
    if abs(first_ours - first_trl) > 1e-4 * max(1.0, abs(first_trl)):
        raise SystemExit(
            f"the two sides do not compute the same loss on the first step: ours {first_ours!r}, TRL {first_trl!r}"
        )
    write_result(
        "grpo_step",
        median(ours_s),
        median(trl_s),
        target="<1.0",
        unit="s/step",
        details={
            "workload": f"llama3 tiny, {PROMPTS}x{GROUP} rollouts of 1..{MAX_NEW} tokens, 4 micro-batches of {MICRO}",
            "threads": torch.get_num_threads(),
            "ours_s": summarize(ours_s),
            "trl_s": summarize(trl_s),
            "first_step_loss": {"ours": first_ours, "trl": first_trl},
            "trl_version": trl.__version__,
            "trl_source": trl_source,
            "load_avg": load,
        },
    )
    variants = family["variants"]
    slowest = max(variants, key=lambda name: variants[name]["ratio"])
    write_result(
        "grpo_step.family",
        variants[slowest]["per_step_s"],
        variants[BASELINE_VARIANT]["per_step_s"],
        target=f"<={FAMILY_TARGET}",
        unit="s/step",
        details={
            "slowest": slowest,
            "ratios": {name: round(v["ratio"], 4) for name, v in variants.items()},
            "ratios_one_step_per_batch": {
                name: round(v["ratio_one_step_per_batch"], 4) for name, v in variants.items()
            },
            "epochs": family["epochs"],
            "workload": (
                f"llama3 tiny, {PROMPTS}x{GROUP} rollouts of 1..{MAX_NEW} tokens, 4 micro-batches of {MICRO}; a "
                f"correction's extra forward over the batch spread over grpo.epochs={family['epochs']} steps"
            ),
            "extra_forward_s": family["extra_forward_s"],
            "step_s": {name: v["step_s"] for name, v in variants.items()},
            "threads": torch.get_num_threads(),
            "load_avg": load,
        },
    )
    at_loss_s, every_s = output_layer.pop("at_loss_s"), output_layer.pop("every_s")
    write_result(
        "grpo_step.output_layer",
        median(at_loss_s),
        median(every_s),
        target=f"<={OUTPUT_TARGET}",
        unit="s/step",
        details={
            **output_layer,
            "at_loss_s": summarize(at_loss_s),
            "every_s": summarize(every_s),
            "threads": torch.get_num_threads(),
            "load_avg": load,
        },
    )

if __name__ == "__main__":
    main()
