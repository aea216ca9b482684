"""Worker entry point of the SFT stage (one process per rank under torchrun, or one plain process):

    torchrun --standalone --nproc-per-node 2 -m forge_core.run sft --spec <output_uri>/_spec.json
    python -m forge_core.run sft --spec <output_uri>/_spec.json          # world size 1

Inputs: `spec.inputs["data"]`, a committed `data` artifact (sft.parquet + tokenizer/). Optional
`model.hf_path` (local folder or storage URI of an HF folder) to start from instead of random init.
Output: `<output_uri>/policy` (a committed `policy` artifact: HF folder with the tokenizer files), in-stage
checkpoints under `<output_uri>/_checkpoints/step-<N>`, and finally the `sft` artifact at `<output_uri>`
(train_summary.json; manifest metrics: final loss, eval loss, tokens/s, steps, wall time, policy URI).
A rerun resumes from the newest committed checkpoint; an already committed output is left alone.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from forge_core.config import RunConfig, config_to_dict
from forge_core.engine import Checkpointer, Engine, destroy_distributed
from forge_core.engine.distributed import run_on_rank0
from forge_core.metrics import build_sinks
from forge_core.run.external import verify_external_inputs
from forge_core.run.spec import StageSpec
from forge_core.storage import ArtifactError, ObjectStore
from forge_core.trainers.base import ArtifactContext
from forge_core.trainers.sft import SFTData, SFTTrainer
from forge_core.trainers.stage import commit_stage, export_policy

log = logging.getLogger(__name__)

STAGE = "sft"
DATA_INPUT = "data"
SFT_TABLE = "sft.parquet"
TOKENIZER_DIR = "tokenizer"


@dataclass
class SFTInputs:
    data_uri: str
    table: pa.Table  # sft.parquet: input_ids, loss_mask
    tokenizer_dir: Path
    tokenizer_vocab_size: int


def _read_data_artifact(store: ObjectStore, spec: StageSpec, workdir: Path) -> SFTInputs:
    """Verified reads of sft.parquet and tokenizer/ from the committed data artifact."""
    data_uri = spec.inputs.get(DATA_INPUT)
    if not data_uri:
        raise ValueError(
            f"stage spec {spec.output_uri}: inputs has no {DATA_INPUT!r} entry (got {sorted(spec.inputs)}); "
            "the SFT stage needs the URI of a committed data artifact from the prepare stage"
        )
    try:
        reader = store.reader(data_uri)
        table = reader.read_table(SFT_TABLE, columns=["input_ids", "loss_mask"])
        tokenizer_dir = reader.download_dir(TOKENIZER_DIR, workdir / TOKENIZER_DIR)
    except (ArtifactError, FileNotFoundError) as exc:
        raise ValueError(f"inputs.{DATA_INPUT}={data_uri}: cannot read the data artifact: {exc}") from exc
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


def main(spec: StageSpec) -> None:
    """Train, export `<output_uri>/policy`, commit the `sft` artifact (see the module docstring)."""
    started = time.perf_counter()  # the manifest's wall_s: the stage body, without interpreter start-up
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = spec.run_config()
    store = ObjectStore.from_config(cfg.storage)
    if store.is_committed(spec.output_uri):
        log.info("%s is already committed; nothing to do", spec.output_uri)
        return
    verify_external_inputs(spec, cfg, store)  # model.hf_path is the folder the key was computed from
    config = config_to_dict(cfg)
    with tempfile.TemporaryDirectory(prefix="forge-sft-") as tmp:
        workdir = Path(tmp)
        inputs = _read_data_artifact(store, spec, workdir)
        data = SFTData.from_table(
            inputs.table, cfg.sft.eval_rows, cfg.seed, where=f"{inputs.data_uri}/{SFT_TABLE}"
        )
        init_dir = _initial_weights_dir(cfg, store, workdir)
        engine_cfg = Engine.Config.from_run_config(
            cfg,
            _vocab_size(cfg, inputs, init_dir),
            cfg.sft.optimizer,
            cfg.sft.steps,
            init_weights_dir=init_dir,
        )
        engine = engine_cfg.build()
        rank = engine.dist.rank
        trainer = SFTTrainer(
            engine,
            data,
            cfg.sft,
            seed=cfg.seed,
            log_every=cfg.logging.log_every,
            sink=build_sinks(cfg.logging, f"{cfg.name}-{STAGE}", rank, config=config),
            checkpointer=Checkpointer(
                store, spec.output_uri, engine.dist, stage=STAGE, config=config, inputs=dict(spec.inputs)
            ),
            artifacts=ArtifactContext(store, STAGE, config, dict(spec.inputs)),
        )
        try:
            summary = trainer.fit()
            metrics = summary.as_metrics()
            policy_uri = export_policy(trainer, spec.output_uri, str(inputs.tokenizer_dir), metrics)
            layout = {k: v for k, v in engine.describe().items() if not isinstance(v, dict)}
            wall_s = time.perf_counter() - started
            stage_metrics = {**metrics, "policy_uri": policy_uri, **layout, "wall_s": wall_s}
            trainer.sink.summary(metrics)
            run_on_rank0(
                lambda: commit_stage(
                    store, spec.output_uri, STAGE, config, dict(spec.inputs), stage_metrics, stage_metrics
                ),
                engine.dist,
            )
            log.info("committed %s (policy %s)", spec.output_uri, policy_uri)
        finally:
            trainer.close()
            destroy_distributed()
