"""The GRPO learning check's pipeline, in one process: prepare the demo data, run the SFT stage, then GRPO
iterations with one vLLM engine kept up (weights reloaded in place after every update) and one GRPOTrainer
(one AdamW across iterations), measuring held-out greedy accuracy and reward before and after.

Every piece is the stage code: `prepare_data`, `forge_core.run.sft.main`, the rollout stage's prompt choice
and scoring (`iteration_prompts`, `RewardSet`, `rollout_table`), `rollouts_to_rl_batch` + `GRPOTrainer.fit`,
and `forge_core.rollout.evaluate` for the accuracy."""

from __future__ import annotations

import json
import time
from pathlib import Path

from forge_core.artifacts.policy import download_policy
from forge_core.config import RunConfig, config_to_dict, load_config, replace
from forge_core.config.schema import RewardComponentConfig
from forge_core.data import prepare_data
from forge_core.engine import Engine, destroy_distributed
from forge_core.losses.grpo import build_policy_loss
from forge_core.models import write_hf_folder
from forge_core.rewards import RewardSet
from forge_core.rollout import (
    EngineOptions,
    Generator,
    RolloutLineage,
    evaluate,
    evaluation_sampling,
    rollout_table,
)
from forge_core.rollout.prompts import prompts_from_table
from forge_core.run.grpo import plan_seed
from forge_core.run.rollout import iteration_prompts
from forge_core.run.scaffold import run_spec
from forge_core.run.spec import StageSpec
from forge_core.storage import ObjectStore
from forge_core.trainers.grpo import GRPOTrainer, rollouts_to_rl_batch, steps_per_batch

REWARDS = {
    "exact": [RewardComponentConfig(name="exact_answer", weight=1.0)],
    "mix": [RewardComponentConfig(name="exact_answer", weight=0.5), RewardComponentConfig(name="per_digit", weight=0.5)],
}


def learning_config(
    tmp: Path, seed: int, sft_steps: int, lr: float, reward: str = "mix", prompts: int = 32, group: int = 8,
    mini: int = 256, epochs: int = 1, num_eval: int = 300, num_sft: int = 1000, num_digits: int = 3,
) -> RunConfig:
    cfg = load_config(
        None,
        [
            f"seed={seed}",
            "training.device=cpu",
            f"storage.root=file://{tmp}/store",
            "data.demo.num_eval=500",
            f"data.demo.num_sft={num_sft}",
            f"data.demo.num_digits={num_digits}",
            f"data.demo.num_rl={min(20000, 10 ** (2 * num_digits) - num_sft - 500)}",
            f"sft.steps={sft_steps}",
            f"sft.checkpoint_every={sft_steps}",
            "sft.eval_every=0",
            f"rollout.prompts_per_iteration={prompts}",
            f"rollout.sampling.group_size={group}",
            "rollout.sampling.max_new_tokens=16",
            "rollout.engine_in_process=true",
            f"grpo.mini_batch_size={mini}",
            "grpo.micro_batch_size=128",
            f"grpo.epochs={epochs}",
            f"grpo.optimizer.lr={lr}",
            f"eval.num_prompts={num_eval}",
            "logging.wandb_mode=disabled",
            f"logging.dir={tmp}/runs",
        ],
    )
    return replace(cfg, rollout=replace(cfg.rollout, rewards=REWARDS[reward]))


def _sft_policy(cfg: RunConfig, store: ObjectStore, data_uri: str) -> str:
    sft_uri = store.artifact_uri("sft", f"seed{cfg.seed}-d{cfg.data.demo.num_digits}-sft{cfg.data.demo.num_sft}-steps{cfg.sft.steps}")
    if store.is_committed(sft_uri):
        return sft_uri
    spec = StageSpec(stage="sft", config=config_to_dict(cfg), inputs={"data": data_uri}, output_uri=sft_uri)
    try:
        run_spec(spec)
    finally:
        destroy_distributed()
    return sft_uri


def _held_out(generator: Generator, prompts, cfg: RunConfig) -> dict[str, float]:
    """Greedy exact-match accuracy and mean reward (the training rewards) on the held-out prompts."""
    rewards = RewardSet.from_config(cfg.rollout.rewards)
    outcome = evaluate(generator, prompts, rewards, evaluation_sampling(cfg.eval, cfg.rollout.sampling), seed=cfg.seed)
    return {"accuracy": outcome.metrics["accuracy"], "reward": outcome.metrics["mean_reward"]}


def prepare_and_sft(cfg: RunConfig) -> tuple[ObjectStore, str, str]:
    """The data artifact and the SFT policy (each skipped when already committed): (store, data, sft)."""
    store = ObjectStore.from_config(cfg.storage)
    data_uri = store.artifact_uri("data", f"seed{cfg.seed}-d{cfg.data.demo.num_digits}-sft{cfg.data.demo.num_sft}")
    if not store.is_committed(data_uri):
        prepare_data(cfg, data_uri, store)
    return store, data_uri, _sft_policy(cfg, store, data_uri)


def grpo_from_sft(
    cfg: RunConfig, store: ObjectStore, data_uri: str, sft_uri: str, workdir: Path, iterations: int, eval_every: int = 0
) -> dict:
    """Held-out greedy accuracy and mean reward of the SFT policy and after `iterations` GRPO iterations (plus
    every `eval_every` iterations), the training reward, and where the time went."""
    reader = store.reader(data_uri)
    rl_table = reader.read_table("rl_prompts.parquet")
    eval_prompts = prompts_from_table(reader.read_table("eval.parquet").slice(0, cfg.eval.num_prompts))
    policy_dir = download_policy(store, sft_uri, workdir / "policy")
    vocab_size = json.loads((policy_dir / "config.json").read_text())["vocab_size"]
    rewards = RewardSet.from_config(cfg.rollout.rewards)
    sampling = cfg.rollout.sampling
    timings: dict[str, float] = {}
    start = time.perf_counter()
    engine_options = EngineOptions.from_config(cfg.rollout, seed=cfg.seed)
    generator = Generator(policy_dir, engine_options, policy_version="sft")
    timings["vllm_start_s"] = time.perf_counter() - start
    curve = []
    try:
        curve.append((0, _held_out(generator, eval_prompts, cfg)))
        samples_per_batch = cfg.rollout.prompts_per_iteration * sampling.group_size
        engine = Engine.Config.from_run_config(
            cfg, vocab_size, cfg.grpo.optimizer, iterations * steps_per_batch(cfg.grpo, samples_per_batch),
            init_weights_dir=str(policy_dir),
        ).build()
        trainer = GRPOTrainer(engine, cfg.grpo, build_policy_loss(cfg.grpo.loss, sampling.max_new_tokens))
        split = {"generate_s": 0.0, "train_s": 0.0, "reload_s": 0.0}
        rewards_seen = []
        for iteration in range(iterations):
            t = time.perf_counter()
            prompts = iteration_prompts(rl_table, cfg.rollout.prompts_per_iteration, iteration, cfg.seed)
            samples = generator.generate(prompts, sampling, seed=cfg.seed)
            scored = rewards.score(
                [s.response_text for s in samples], [s.ground_truth for s in samples], [s.ref for s in samples]
            )
            lineage = RolloutLineage(str(policy_dir), "in-process", iteration, cfg.seed, "{}", "{}")
            table = rollout_table(samples, scored, lineage)
            split["generate_s"] += time.perf_counter() - t
            t = time.perf_counter()
            rollouts = rollouts_to_rl_batch(table, cfg.grpo.advantage)
            rewards_seen.append(rollouts.stats["reward/mean"])
            trainer.fit(rollouts.batch, plan_seed(cfg.seed, iteration))
            split["train_s"] += time.perf_counter() - t
            t = time.perf_counter()
            write_hf_folder(engine.full_state_dict(), cfg.model, vocab_size, policy_dir, tokenizer_dir=policy_dir)
            generator.reload(policy_dir, f"grpo-{iteration + 1}")  # weights rewritten in place
            split["reload_s"] += time.perf_counter() - t
            if eval_every and (iteration + 1) % eval_every == 0 and iteration + 1 < iterations:
                curve.append((iteration + 1, _held_out(generator, eval_prompts, cfg)))
        curve.append((iterations, _held_out(generator, eval_prompts, cfg)))
        timings.update(split)
    finally:
        generator.close()
        destroy_distributed()
    return {
        "sft": curve[0][1],
        "grpo": curve[-1][1],
        "curve": curve,
        "train_reward_first5": sum(rewards_seen[:5]) / max(len(rewards_seen[:5]), 1),
        "train_reward_last5": sum(rewards_seen[-5:]) / max(len(rewards_seen[-5:]), 1),
        "timings": timings,
    }
