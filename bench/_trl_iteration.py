"""TRL's side of the GRPO-iteration benchmark: wall seconds per iteration of TRL's own `GRPOTrainer.train()`.

    python -m bench._trl_iteration --smoke           # tiny llama3 + demo prompts, 3 iterations (about a minute)
    python -m bench._trl_iteration --smoke --24m     # the same on a 24M Llama (dim 512, 8 layers)

`time_trl_iterations` runs TRL 1.16's `GRPOTrainer.train()` in this process (fp32, CPU, transformers
`generate`, no vLLM) with one generation of `prompts_per_iteration x group_size` completions per optimizer step
and one pass over it, and times every optimizer step with a `TrainerCallback`: `on_step_begin` to
`on_step_end`. In TRL 1.16 the generation of a step runs inside that window: transformers' `Trainer` fires
`on_step_begin` before the step's first micro-batch, whose `training_step` calls `GRPOTrainer._prepare_inputs`,
which generates and scores the whole batch (`_generate_and_score_completions`: tokenize, `generate`, decode,
reward, group advantages) and buffers its micro-batch slices for the other accumulation steps;
`on_step_end` fires after the optimizer and scheduler step. Outside the window are only the dataloader fetch of
the step's prompt rows (no tokenization, TRL's collator is the identity) and Trainer's log/save check, both
tiny; `TRLRun.between_ends_s` (on_step_end to on_step_end, the first from `on_train_begin`) includes them.

With num_iterations=1 and steps_per_generation = gradient_accumulation_steps (TRL's default), TRL does not run
an extra no-grad forward for the old log-probabilities: `old_per_token_logps` is None and the loss uses the
detached current ones (ratio 1), so an iteration is "generate + reward + one forward/backward per micro-batch
+ one optimizer step", like ours. Each forward also computes the entropy (TRL logs it), under the graph, and
every micro-batch is padded to the longest prompt and completion of the whole generation batch (TRL pads once,
before splitting), where ours trims padding per micro-batch. Generation is one `generate` call over all
prompts_per_iteration x group_size sequences, which runs until every sequence has hit EOS or the length cap.

TRL is not a forgeflow dependency; `bench.grpo_step.ensure_trl` provides the pinned trl 1.16.0 / accelerate.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.grpo_step import TRL_MATCHED_ARGS, ensure_trl
from bench.harness import summarize


@dataclass
class TRLRun:
    """One `GRPOTrainer.train()` run; every list has one entry per optimizer step (iteration), none dropped."""

    iteration_s: list[float]  # on_step_begin -> on_step_end: generate + reward + train + optimizer step
    between_ends_s: list[float]  # on_step_end -> next on_step_end (first: on_train_begin -> first on_step_end)
    generate_s: list[float]  # on_step_begin -> reward call: tokenize prompts + `generate` + decode
    reward_mean: list[float]  # mean exact_answer reward of the iteration's completions
    completion_len_mean: list[float]  # mean completion tokens (EOS included when sampled, as vLLM counts)
    trl_version: str
    threads: int  # torch intra-op threads

    def as_details(self) -> dict:
        details = asdict(self)
        details["iteration_summary"] = summarize(self.iteration_s)
        return details


def time_trl_iterations(
    hf_dir: Path,
    prompts: list[str],
    ground_truths: list[str],
    *,
    prompts_per_iteration: int = 16,
    group_size: int = 8,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    micro_batch_size: int,
    lr: float,
    iterations: int,
    seed: int,
    workdir: Path,
    overlong_window: int = 0,
) -> TRLRun:
    """Run `iterations` GRPO iterations of TRL's `GRPOTrainer.train()` on the HF folder `hf_dir` (weights and
    tokenizer) and time each one.

    Iteration k uses prompts[k * prompts_per_iteration : (k + 1) * prompts_per_iteration] (plain text, in the given
    order: no shuffling) with their ground truths, samples `group_size` completions of up to `max_new_tokens` tokens
    each (temperature as given, top_p 1, no top-k, stop at the tokenizer's EOS), scores them with forgeflow's
    `exact_answer` reward plus its `overlong` penalty (window `overlong_window` tokens before the cap; 0 = none) on
    the completion's token count, and takes one optimizer step over all of them in micro-batches of
    `micro_batch_size` sequences, with the loss of bench/grpo_step.py (DAPO token mean, clip 0.2 / 0.28, no KL,
    fused AdamW with betas 0.9 / 0.95, gradient clipping at 1.0, constant `lr`).
    """
    per_iteration = prompts_per_iteration * group_size
    if len(prompts) != len(ground_truths):
        raise ValueError(f"{len(prompts)} prompts but {len(ground_truths)} ground truths")
    if len(prompts) < prompts_per_iteration * iterations:
        raise ValueError(f"{iterations} iterations need {prompts_per_iteration * iterations} prompts, got {len(prompts)}")
    if per_iteration % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide {prompts_per_iteration}x{group_size}")
    _import_trl()
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from forge_core.rewards.builtin import exact_answer, overlong

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # TRL would fall back to pad = EOS, and then pad positions of the prompts look like ends of text.
        raise ValueError(f"{hf_dir}: tokenizer needs distinct pad and EOS tokens, has {tokenizer.special_tokens_map}")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)

    reward_means: list[float] = []
    lengths: list[float] = []
    reward_calls: list[float] = []

    def exact_answer_reward(completions, ground_truth, completion_ids, **_):
        reward_calls.append(time.perf_counter())
        rewards = [exact_answer(c, t) for c, t in zip(completions, ground_truth, strict=True)]
        if overlong_window:
            rewards = [
                reward + overlong(c, t, response_len=len(ids), max_new_tokens=max_new_tokens, window=overlong_window)
                for reward, c, t, ids in zip(rewards, completions, ground_truth, completion_ids, strict=True)
            ]
        reward_means.append(statistics.mean(rewards))
        lengths.append(statistics.mean(map(len, completion_ids)))
        return rewards

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.train_begin = 0.0
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=per_iteration // micro_batch_size,
        num_generations=group_size,
        num_iterations=1,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        learning_rate=lr,
        warmup_steps=0,
        fp16=False,
        max_steps=iterations,
        shuffle_dataset=False,
        seed=seed,
        **TRL_MATCHED_ARGS,
        logging_steps=10_000,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict(
        {"prompt": list(prompts[: prompts_per_iteration * iterations]),
         "ground_truth": list(ground_truths[: prompts_per_iteration * iterations])}
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_answer_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    if tokenizer.eos_token_id not in trainer.eos_token_ids or trainer.generation_config.pad_token_id != tokenizer.pad_token_id:
        raise RuntimeError(
            f"TRL generates with EOS {trainer.eos_token_ids} and pad {trainer.generation_config.pad_token_id}, "
            f"the tokenizer has EOS {tokenizer.eos_token_id} and pad {tokenizer.pad_token_id}"
        )
    if args.steps_per_generation != args.gradient_accumulation_steps:
        raise RuntimeError(f"one generation per optimizer step expected, got {args.steps_per_generation} steps")
    trainer.train()

    if not (len(timer.begins) == len(timer.ends) == len(reward_means) == iterations):
        raise RuntimeError(
            f"{iterations} iterations asked, timed {len(timer.begins)}/{len(timer.ends)}, scored {len(reward_means)}"
        )
    ends = [timer.train_begin, *timer.ends]
    return TRLRun(
        iteration_s=[end - begin for begin, end in zip(timer.begins, timer.ends, strict=True)],
        between_ends_s=[b - a for a, b in itertools.pairwise(ends)],
        generate_s=[call - begin for begin, call in zip(timer.begins, reward_calls, strict=True)],
        reward_mean=reward_means,
        completion_len_mean=lengths,
        trl_version=trl.__version__,
        threads=torch.get_num_threads(),
    )


def _import_trl() -> None:
    """Put the pinned TRL and accelerate on the path, also when transformers was imported before them."""
    import sys

    ensure_trl()
    from transformers.utils import import_utils

    # transformers caches "accelerate is not installed" from its first check (an lru_cache), and the
    # modules it imported meanwhile skipped their accelerate imports: forget the one, refuse the other.
    import_utils.is_accelerate_available.cache_clear()
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is not None and not hasattr(trainer_module, "Accelerator"):
        raise RuntimeError(
            "transformers.trainer was imported before accelerate was on the path: call "
            "bench.grpo_step.ensure_trl() before anything imports transformers' Trainer"
        )


# ---- smoke entry --------------------------------------------------------------------------------------------


def _smoke_model(workdir: Path, medium: bool) -> Path:
    """The tiny llama3 HF folder of bench/grpo_step.py, or a 24M Llama (dim 512, 8 layers) with the demo
    tokenizer (bench/rollout_throughput.py)."""
    if not medium:
        from bench.grpo_step import make_workload

        return make_workload(workdir)[1]
    from bench.rollout_throughput import demo_tokenizer, write_model

    tokenizer, _ = demo_tokenizer(workdir / "tokenizer")
    params = write_model(workdir / "policy-24m", workdir / "tokenizer", tokenizer, dim=512, layers=8)
    print(f"24M model: {params / 1e6:.1f}M parameters")
    return workdir / "policy-24m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="run 3 iterations on a generated model")
    parser.add_argument("--24m", dest="medium", action="store_true", help="a 24M Llama instead of llama3 tiny")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    if not args.smoke:
        parser.error("only --smoke is runnable on its own; bench/grpo_iteration.py imports time_trl_iterations")
    from forge_core.data.demo import AdditionExample

    rng = random.Random(0)
    examples = [AdditionExample(rng.randrange(1000), rng.randrange(1000), 3) for _ in range(16 * args.iterations)]
    with tempfile.TemporaryDirectory(prefix="forge-bench-trl-") as tmp:
        workdir = Path(tmp)
        hf_dir = _smoke_model(workdir, args.medium)
        run = time_trl_iterations(
            hf_dir,
            [e.prompt for e in examples],
            [e.ground_truth for e in examples],
            micro_batch_size=32,
            lr=1e-5,
            iterations=args.iterations,
            seed=0,
            workdir=workdir,
        )
    for k, (s, gap, gen, reward, length) in enumerate(
        zip(run.iteration_s, run.between_ends_s, run.generate_s, run.reward_mean, run.completion_len_mean, strict=True)
    ):
        print(
            f"iteration {k}: {s:.2f}s (generate {gen:.2f}s; end to end {gap:.2f}s), reward {reward:.3f}, "
            f"completion {length:.1f} tokens"
        )
    print(f"trl {run.trl_version}, {run.threads} threads")


if __name__ == "__main__":
    main()
