"""The training engine: everything a trainer needs below the loss, built in one place.

    engine = Engine.Config(model=cfg.model, vocab_size=64, training=cfg.training,
                           optimizer=cfg.sft.optimizer, total_steps=cfg.sft.steps, seed=cfg.seed).build()
    # or: Engine.Config.from_run_config(cfg, vocab_size, cfg.sft.optimizer, cfg.sft.steps).build()

Build order (torchtitan's): process group + device -> ParallelDims meshes -> model on `meta` ->
parallelize (TP, activation checkpointing, compile, FSDP2) -> init from the seed -> optional HF weights ->
AdamW + LR schedule. Works as a single process and under torchrun with N ranks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.config import Configurable

from forge_core.config.schema import ModelConfig, OptimizerConfig, RunConfig, TrainingConfig
from forge_core.engine.checkpoint import ModelState
from forge_core.engine.distributed import DistContext, full_tensors, init_distributed, run_on_rank0
from forge_core.engine.optim import clip_gradients, current_lr
from forge_core.engine.parallel import (
    ParallelPlan,
    accumulates_unsharded,
    add_tp_sharding,
    build_parallel_dims,
    defer_gradient_sync,
    dp_group,
    dp_mesh_info,
    parallelize_model,
    resolve_reshard_after_forward,
)
from forge_core.engine.preflight import HostDevices, training_device_problems
from forge_core.engine.rng import seed_everything
from forge_core.models import (
    Architecture,
    HFModelInfo,
    attention_choice,
    build_model_config,
    flops_per_token,
    init_weights,
    length_bucket,
    load_hf_folder,
    num_params,
)
from forge_core.models.flavors import flavor_architecture, from_scratch_flavor

log = logging.getLogger(__name__)

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_param_dtype(mixed_precision: str, device_type: str) -> torch.dtype:
    """Compute dtype of the parameters in forward/backward (master weights and reductions stay fp32)."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if mixed_precision not in _PARAM_DTYPES:
        raise ValueError(
            f"training.mixed_precision={mixed_precision!r}: unknown; use 'auto', 'fp32' or 'bf16'"
        )
    return _PARAM_DTYPES[mixed_precision]


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a model tensor (its storage: writing it writes the model)."""
    return value.to_local() if isinstance(value, DTensor) else value


def _gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None  # no meaningful peak for CPUs: MFU is reported on GPU only
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(torch.cuda.get_device_name(device)))


class Engine(Configurable):
    """Owns the distributed context, the parallelized model, the optimizer and the LR schedule."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        model: ModelConfig
        vocab_size: int
        total_steps: int
        training: TrainingConfig = field(default_factory=TrainingConfig)
        optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
        seed: int = 0
        # Local HF folder to start from (download storage URIs first; rank 0 reads it); None = random init.
        init_weights_dir: str | None = None
        # What that folder's config.json says (forge_core.models.read_hf_info; every rank needs it): the model
        # is built with its architecture (`model.flavor: auto`, or a flavor that must match) and exports keep
        # its facts (context length, RoPE, generation config).
        checkpoint: HFModelInfo | None = None

        @classmethod
        def from_run_config(
            cls,
            cfg: RunConfig,
            vocab_size: int,
            optimizer: OptimizerConfig,
            total_steps: int,
            init_weights_dir: str | None = None,
            checkpoint: HFModelInfo | None = None,
        ) -> Engine.Config:
            return cls(
                model=cfg.model,
                vocab_size=vocab_size,
                total_steps=total_steps,
                training=cfg.training,
                optimizer=optimizer,
                seed=cfg.seed,
                init_weights_dir=init_weights_dir,
                checkpoint=checkpoint,
            )

    def __init__(self, config: Config) -> None:
        self.config = config
        self.dist: DistContext = init_distributed(config.training.device)
        self.device = self.dist.device
        if self.dist.device_type == "cpu":
            # bf16 with training.device=auto would otherwise train on CPU in bf16 without a word.
            problems = training_device_problems(config.training, HostDevices.probe())
            if problems:
                raise ValueError("; ".join(problems))
        self.attention, self.attention_reason = attention_choice(self.dist.device_type)
        if self.dist.is_rank0:
            log.info("attention: %s (%s)", self.attention, self.attention_reason)
        seed_everything(config.seed, self.dist.rank)
        self.parallel_dims = build_parallel_dims(
            config.training.parallelism, self.dist.world_size, self.dist.device_type
        )
        self.dp_degree, self.dp_rank = dp_mesh_info(self.parallel_dims)
        self.dp_group = dp_group(self.parallel_dims)
        self.plan = ParallelPlan(
            device_type=self.dist.device_type,
            param_dtype=resolve_param_dtype(config.training.mixed_precision, self.dist.device_type),
            activation_checkpoint=config.training.activation_checkpoint,
            compile=config.training.compile,
            reshard_after_forward=resolve_reshard_after_forward(
                config.training.parallelism.reshard_after_forward, self.dist.device_type
            ),
        )
        self.model_config = self._build_model_config()
        self.model = self._build_model()
        self.num_params = num_params(self.model)
        self.optimizers, self.lr_schedulers = config.optimizer.build(
            self.model, self.dist.device_type, config.total_steps
        )
        self.peak_flops = _gpu_peak_flops(self.device)
        self.accumulates_unsharded = accumulates_unsharded(
            self.model, self.parallel_dims, self.plan.reshard_after_forward
        )
        self.restarted = False  # True once `restart` made it another stage's engine

    # ---- a kept engine for the next stage ---------------------------------------------------------------------

    def restarts_as(self, config: Config) -> bool:
        """Whether `restart(config)` gives what `config.build()` would: the same model, layout, precision and
        seed (the optimizer, the schedule's length and the weights folder may differ)."""
        mine, theirs = self.config, config
        return (mine.model, mine.vocab_size, mine.training, mine.seed, mine.checkpoint) == (
            theirs.model, theirs.vocab_size, theirs.training, theirs.seed, theirs.checkpoint
        )

    def restart(self, config: Config) -> Engine:
        """Collective: this engine as `config.build()` would build it from an export of its current weights:
        weights rounded through the export dtype, a fresh optimizer and LR schedule, gradients cleared, RNG
        reseeded. Needs `restarts_as(config)`. Returns this engine."""
        self._begin_from_export(config)
        self.optimizers, self.lr_schedulers = config.optimizer.build(
            self.model, self.dist.device_type, config.total_steps
        )
        return self

    def go_on(self, config: Config) -> Engine:
        """Collective: as `restart`, but AdamW keeps its moments and step counts (its hyperparameters and a new LR
        schedule from `config`): what `config.build()` then `carry_optimizer` of this engine's saved optimizer
        state gives. Needs `restarts_as(config)`. Returns this engine."""
        self._begin_from_export(config)
        self.carry_optimizer()
        return self

    def carry_optimizer(self) -> None:
        """After its optimizer state was loaded (a checkpoint's `optimizer` component): AdamW's hyperparameters
        and a new LR schedule from the config, the loaded moments and step counts kept."""
        self.lr_schedulers = self.config.optimizer.reschedule(self.optimizers, self.config.total_steps)

    def _begin_from_export(self, config: Config) -> None:
        assert self.restarts_as(config), "restart needs an engine built from the same model config"
        with torch.no_grad():
            for value in self.model.state_dict().values():
                local = _local(value)
                if local.is_floating_point() and local.dtype != self.export_dtype:
                    local.copy_(local.to(self.export_dtype))
        self.model.zero_grad(set_to_none=True)
        self.config = config
        self.restarted = True
        seed_everything(config.seed, self.dist.rank)

    def optimizer_steps(self) -> int:
        """How many steps AdamW's moments have taken (0 before the first)."""
        for optimizer in self.optimizers.optimizers:
            for state in optimizer.state.values():
                if "step" in state:
                    return int(state["step"])
        return 0

    # ---- build steps --------------------------------------------------------------------------------------

    @property
    def architecture(self) -> Architecture | None:
        """The checkpoint's architecture the model is built with (None: the configured flavor's)."""
        return self.config.checkpoint.architecture if self.config.checkpoint is not None else None

    def _build_model_config(self):
        cfg = self.config
        if cfg.checkpoint is not None:
            problem = cfg.checkpoint.context_problem(cfg.model.max_seq_len, "its config.json")
            if problem:
                raise ValueError(problem)
        model_config = build_model_config(
            cfg.model, cfg.vocab_size, attention=self.attention, architecture=self.architecture
        )
        if self.parallel_dims.tp_enabled:
            add_tp_sharding(model_config, cfg.model.family)
        return model_config

    def _build_model(self) -> torch.nn.Module:
        with torch.device("meta"):
            model = self.model_config.build()
        parallelize_model(model, self.parallel_dims, self.plan)
        # Materialise shards and buffers. DTensor random ops on CPU meshes draw per shard, so these values
        # depend on the world size; the weights are then replaced by rank 0's unsharded initialisation (or
        # its HF checkpoint), which makes 1 rank and N ranks start from the same model.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators")
            init_weights(model, seed=self.config.seed, device=self.device)
        initial = run_on_rank0(self._initial_full_weights, self.dist)
        self.load_full_state_dict(initial, model)
        model.train()
        return model

    def _initial_full_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the unsharded starting weights (HF checkpoint, or random init from the seed) on CPU."""
        if self.config.init_weights_dir is not None:
            return self._read_hf_weights(self.config.init_weights_dir)
        cpu_config = build_model_config(
            self.config.model, self.config.vocab_size, attention="sdpa", architecture=self.architecture
        )
        with torch.device("meta"):
            unsharded = cpu_config.build()
        init_weights(unsharded, seed=self.config.seed, device="cpu")
        return unsharded.state_dict()

    def _read_hf_weights(self, folder: str) -> dict[str, torch.Tensor]:
        state_dict, info = load_hf_folder(folder)
        # The model was built from `checkpoint` (or the flavor); the weights must be that folder's own.
        model = self.config.model
        built = self.architecture or flavor_architecture(model.family, from_scratch_flavor(model.flavor))
        found, expected = (info.architecture, info.vocab_size), (built, self.config.vocab_size)
        if found != expected:
            raise ValueError(
                f"model.hf_path={folder}: holds architecture/vocab {found}, but the model was built as "
                f"{expected}; pass the folder's own read_hf_info as Engine.Config.checkpoint"
            )
        return state_dict

    # ---- training-step helpers ----------------------------------------------------------------------------

    def micro_batch_passes(self, count: int) -> Iterator[int]:
        """The indices 0..count-1 of one optimizer step's micro-batches, to run each one's forward and backward
        in. When the engine `accumulates_unsharded` (one data-parallel rank, or several that keep the gathered
        parameters through a step: `reshard_after_forward` never) the gradients accumulate in the unsharded model
        and are reduced once, after the last micro-batch; otherwise every micro-batch's gradients are reduced as
        they come, so that no rank holds the whole model's gradients. The gradients are the same either way (on
        several ranks up to rounding).
        """
        if not self.accumulates_unsharded:
            yield from range(count)
            return
        try:
            for index in range(count):
                defer_gradient_sync(self.model, defer=index < count - 1)
                yield index
        finally:
            defer_gradient_sync(self.model, defer=False)  # a step that failed midway leaves nothing deferred

    def clip_gradients(self) -> float:
        """Total gradient norm over all ranks before clipping (clipped to optimizer.grad_clip when > 0)."""
        return clip_gradients(self.model, self.config.optimizer.grad_clip)

    def step_optimizer(self) -> None:
        """Apply the accumulated gradients, advance the LR schedule, clear gradients."""
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()

    @property
    def lr(self) -> float:
        return current_lr(self.optimizers)

    def flops_per_token(self, seq_len: int) -> int:
        return flops_per_token(self.model_config, seq_len)

    def padded_length(self, length: int) -> int:
        """The length to run a batch of `length` positions at: its `length_bucket` when the model is
        compiled (so it meets a few shapes, not one per batch length), else `length`."""
        if not self.plan.compile:
            return length
        return length_bucket(length, self.config.model.max_seq_len)

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype exported weights are written in: the training compute dtype (the fp32 master weights
        stay in the checkpoints)."""
        return self.plan.param_dtype

    def checkpoint_components(self) -> dict[str, Stateful]:
        """What a checkpoint holds besides step, data cursor and RNG."""
        return {
            "model": ModelState(self.model),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
        }

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Collective: the unsharded state dict (torchtitan keys; master dtype, or `dtype` such as
        `self.export_dtype`) on CPU, on rank 0 only; other ranks get an empty dict. Tensors are gathered a bucket
        at a time (`full_tensors`), so beyond what rank 0 returns, peak memory is one bucket."""
        full = {}
        live = self.model.state_dict()
        for key, value in full_tensors(live.items()):
            if self.dist.is_rank0:
                # A gathered tensor is new already; a local one is copied, never aliasing the live parameters.
                gathered = isinstance(live[key], DTensor)
                full[key] = value.detach().to("cpu", dtype=dtype or value.dtype, copy=not gathered)
        return full

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor] | None, model: torch.nn.Module | None = None
    ) -> None:
        """Collective: load an unsharded state dict held by rank 0 (other ranks pass None) into the sharded
        model. Raises ValueError on rank 0 when it lacks model weights."""
        model = self.model if model is None else model
        targets = model.state_dict()
        if self.dist.is_rank0:
            missing = sorted(set(targets) - set(state_dict))
            if missing:
                raise ValueError(f"state dict lacks {len(missing)} model weights, e.g. {missing[:5]}")
        loaded = {}
        for key, target in targets.items():
            if self.dist.is_rank0:
                source = state_dict[key].to(device=self.device, dtype=target.dtype)
            else:
                source = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            if isinstance(target, DTensor):
                source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=0)
            elif self.dist.world_size > 1:
                torch.distributed.broadcast(source, src=0)
            loaded[key] = source
        model.load_state_dict(loaded)

    def local_weights(self) -> dict[str, torch.Tensor]:
        """A host-memory copy of this rank's part of every model weight, for `load_local_weights`."""
        return {key: _local(value).detach().to("cpu", copy=True) for key, value in self.model.state_dict().items()}

    def load_local_weights(self, saved: dict[str, torch.Tensor]) -> None:
        """Put back, in place, what `local_weights` copied on this rank (no collective)."""
        with torch.no_grad():
            for key, value in self.model.state_dict().items():
                _local(value).copy_(saved[key])

    def describe(self) -> dict:
        return {
            "world_size": self.dist.world_size,
            "device": str(self.device),
            "dp_degree": self.dp_degree,
            "tp": self.parallel_dims.tp,
            "param_dtype": str(self.plan.param_dtype).removeprefix("torch."),
            "reshard_after_forward": self.plan.reshard_after_forward,
            "attention": self.attention,
            "attention_reason": self.attention_reason,
            "compile": self.plan.compile,
            "num_params": self.num_params,
            "model": self.config.model.model_dump(),
        }
