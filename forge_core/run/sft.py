"""The SFT stage (one process per rank under torchrun, or one plain process):

    torchrun --standalone --nproc-per-node 2 -m forge_core.run sft --spec <output_uri>/_specs/<attempt>.json
    python -m forge_core.run sft --spec <output_uri>/_specs/<attempt>.json          # world size 1

Inputs: `data`, a committed `data` artifact (sft.parquet + tokenizer/), checked by the scaffold. Optional
`model.hf_path` (local folder or storage URI of an HF folder) to start from instead of random init.
Output: `<output_uri>/policy` (a committed `policy` artifact: HF folder with the tokenizer files), in-stage
checkpoints under `<output_uri>/_checkpoints/step-<N>`, and finally the `sft` artifact at `<output_uri>`
(train_summary.json; manifest metrics: final loss, eval loss, tokens/s, steps, wall time, policy URI).
A rerun resumes from the newest committed checkpoint; an already committed output is left alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from forge_core.config import RunConfig
from forge_core.run.scaffold import StageContext
from forge_core.run.training import TrainingRun, training_process_group
from forge_core.storage import ArtifactError, ObjectStore
from forge_core.trainers.sft import SFTData, SFTTrainer

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
        table = reader.read_table(SFT_TABLE, columns=["input_ids", "loss_mask"])
        tokenizer_dir = reader.download_dir(TOKENIZER_DIR, ctx.workdir / TOKENIZER_DIR)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.data={data_uri}: cannot read the data artifact: {exc}") from exc
    return SFTInputs(data_uri, table, tokenizer_dir, _tokenizer_vocab_size(tokenizer_dir))


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


def _vocab_size(cfg: RunConfig, inputs: SFTInputs, init_dir: str | None) -> int:
    """The embedding size: the tokenizer's, or the starting checkpoint's (which may pad it)."""
    if init_dir is None:
        return inputs.tokenizer_vocab_size
    hf_vocab = int(json.loads((Path(init_dir) / "config.json").read_text())["vocab_size"])
    if hf_vocab < inputs.tokenizer_vocab_size:
        raise ValueError(
            f"model.hf_path={cfg.model.hf_path}: vocab_size {hf_vocab} is smaller than the data tokenizer's "
            f"{inputs.tokenizer_vocab_size}; use the tokenizer the checkpoint was trained with"
        )
    return hf_vocab


def train(ctx: StageContext) -> None:
    """Train, export `<output_uri>/policy`, commit the `sft` artifact (see the module docstring)."""
    cfg = ctx.cfg
    inputs = _read_data_artifact(ctx)
    data = SFTData.from_table(inputs.table, cfg.sft.eval_rows, cfg.seed, where=f"{inputs.data_uri}/{SFT_TABLE}")
    init_dir = _initial_weights_dir(cfg, ctx.store, ctx.workdir)
    vocab_size = _vocab_size(cfg, inputs, init_dir)
    with training_process_group(ctx) as dist:
        run = TrainingRun(ctx, dist, lineage=ctx.inputs, run_name=f"{cfg.name}-{ctx.stage.name}")
        engine = run.engine(vocab_size, cfg.sft.optimizer, cfg.sft.steps, init_dir)
        trainer = SFTTrainer(
            engine, data, cfg.sft, seed=cfg.seed, log_every=cfg.logging.log_every, **run.trainer_parts(engine)
        )
        try:
            run.finish(trainer, trainer.fit().as_metrics(), str(inputs.tokenizer_dir))
        finally:
            trainer.close()
