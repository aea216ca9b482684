"""The SFT stage (one process per rank under torchrun, or one plain process):

    torchrun --standalone --nproc-per-node 2 -m forge_core.run sft --spec <output_uri>/_specs/<attempt>.json

Input: `data`, a committed `data` artifact (sft.parquet + tokenizer/); optional `model.hf_path` (local folder or
storage URI of an HF folder) to start from instead of random init.
Output: `<output_uri>/policy` (a committed `policy` artifact with the tokenizer files) holding the weights
`sft.select` chose (last step or best validation), checkpoints under `_checkpoints/step-<N>`, and the `sft`
artifact (train_summary.json; metrics include the selected step and `selected_by`: last / best / early_stop).
Validation rows are `sft.eval_rows` rows of sft.parquet held out from training; exact match is decided by
`sft.verifier` against ground_truth, scored in isolated reward workers as the rollout stages do.
A rerun resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from forge_core.config import RunConfig
from forge_core.config.schema import RewardComponentConfig
from forge_core.data.tokenizer import load_tokenizer
from forge_core.models import HFModelInfo, read_hf_info
from forge_core.rewards import RewardSet
from forge_core.rewards.isolation import RewardIsolation
from forge_core.run.scaffold import StageContext
from forge_core.run.training import TrainingRun, training_process_group
from forge_core.storage import ArtifactError, ObjectStore
from forge_core.trainers.sft import GROUND_TRUTH_COLUMN, SFTData, SFTTrainer
from forge_core.trainers.validation import GreedyExactMatch

log = logging.getLogger(__name__)

SFT_TABLE = "sft.parquet"
TOKENIZER_DIR = "tokenizer"


@dataclass
class SFTInputs:
    data_uri: str
    table: pa.Table  # sft.parquet: input_ids, loss_mask
    tokenizer_dir: Path
    tokenizer_vocab_size: int


def _read_data_artifact(ctx: StageContext) -> SFTInputs:
    """Verified reads of sft.parquet and tokenizer/ from the committed data artifact."""
    data_uri = ctx.input("data")
    try:
        reader = ctx.store.reader(data_uri)
        table = reader.read_table(SFT_TABLE)
        tokenizer_dir = reader.download_dir(TOKENIZER_DIR, ctx.workdir / TOKENIZER_DIR)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.data={data_uri}: cannot read the data artifact: {exc}") from exc
    wanted = ["input_ids", "loss_mask"] + ([GROUND_TRUTH_COLUMN] if ctx.cfg.sft.verifier else [])
    table = table.select([c for c in wanted if c in table.column_names])
    return SFTInputs(data_uri, table, tokenizer_dir, _tokenizer_vocab_size(tokenizer_dir))


def _exact_match(cfg: RunConfig, data: SFTData, inputs: SFTInputs) -> GreedyExactMatch | None:
    """The validation's exact-match scorer, or None without sft.verifier or validation rows."""
    if cfg.sft.verifier is None or not data.eval_rows:
        return None
    if data.eval_ground_truths is None:
        raise ValueError(
            f"sft.verifier={cfg.sft.verifier!r}: {inputs.data_uri}/{SFT_TABLE} has no {GROUND_TRUTH_COLUMN} column "
            "(a data artifact written before SFT validation existed); delete that artifact's prefix so the prepare "
            "stage writes it again, or set sft.verifier=null, sft.select_metric=loss and sft.target=null"
        )
    tokenizer = load_tokenizer(str(inputs.tokenizer_dir))
    verifier = RewardComponentConfig(name=cfg.sft.verifier, kwargs=dict(cfg.sft.verifier_kwargs))
    isolation = RewardIsolation.from_config(cfg.rollout)
    rewards = RewardSet.from_config([verifier], section="sft.verifier", isolation=isolation)
    prompts, references = data.validation_prompts()
    return GreedyExactMatch(
        prompts,
        references,
        data.eval_ground_truths,
        lambda ids: tokenizer.backend.decode(ids, skip_special_tokens=True),
        tokenizer.eos_id,
        rewards,
        micro_batch_size=cfg.sft.micro_batch_size,
        max_seq_len=cfg.model.max_seq_len,
    )


def _tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    path = tokenizer_dir / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{path}: the data artifact's tokenizer/ has no tokenizer.json")
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def _initial_weights_dir(cfg: RunConfig, store: ObjectStore, workdir: Path) -> str | None:
    """model.hf_path as a local folder: used as is when local, downloaded (verified) when a storage URI."""
    hf_path = cfg.model.hf_path
    if hf_path is None:
        return None
    if "://" not in hf_path or hf_path.startswith("file://"):
        local = Path(hf_path.removeprefix("file://"))
        if not (local / "config.json").is_file():
            raise ValueError(f"model.hf_path={hf_path}: not an HF model folder (no config.json there)")
        return str(local)
    try:
        return str(store.reader(hf_path).download_dir("", workdir / "init_weights"))
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"model.hf_path={hf_path}: cannot read the HF folder artifact: {exc}") from exc


def _vocab_size(cfg: RunConfig, inputs: SFTInputs, checkpoint: HFModelInfo | None) -> int:
    """The embedding size: the tokenizer's, or the starting checkpoint's (which may pad it)."""
    if checkpoint is None:
        return inputs.tokenizer_vocab_size
    hf_vocab = checkpoint.vocab_size
    if hf_vocab < inputs.tokenizer_vocab_size:
        raise ValueError(
            f"model.hf_path={cfg.model.hf_path}: vocab_size {hf_vocab} is smaller than the data tokenizer's "
            f"{inputs.tokenizer_vocab_size}; use the tokenizer the checkpoint was trained with"
        )
    return hf_vocab


def train(ctx: StageContext) -> None:
    """Train, export `<output_uri>/policy`, commit the `sft` artifact."""
    cfg = ctx.cfg
    inputs = _read_data_artifact(ctx)
    data = SFTData.from_table(inputs.table, cfg.sft.eval_rows, cfg.seed, where=f"{inputs.data_uri}/{SFT_TABLE}")
    init_dir = _initial_weights_dir(cfg, ctx.store, ctx.workdir)
    # Its config.json decides the architecture (model.flavor: auto, any size) and what the export keeps.
    checkpoint = read_hf_info(init_dir) if init_dir is not None else None
    vocab_size = _vocab_size(cfg, inputs, checkpoint)
    with training_process_group(ctx) as dist:
        run = TrainingRun(ctx, dist, lineage=ctx.inputs, run_name=f"{cfg.name}-{ctx.stage.name}")
        engine = run.engine(vocab_size, cfg.sft.optimizer, cfg.sft.steps, init_dir, checkpoint)
        trainer = SFTTrainer(
            engine,
            data,
            cfg.sft,
            seed=cfg.seed,
            log_every=cfg.logging.log_every,
            exact_match=_exact_match(cfg, data, inputs),
            **run.trainer_parts(engine),
        )
        try:
            run.finish(trainer, trainer.fit().as_metrics(), str(inputs.tokenizer_dir))
        finally:
            trainer.close()
