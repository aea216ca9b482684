"""The one worker scaffold: what every stage run does around its body, wherever it runs.

    run_spec(spec)                  # a worker: config validated from the spec (a process boundary)
    run_spec(spec, cfg)             # the task's process: the task's RunConfig object, not validated again
    run_spec(spec, process_group=dist, started=t0)   # a trainer rank: its process group stays up
    ctx = stage_context(spec)       # tests and tools: the checked context alone (None when committed)

`run_spec` (1) starts the stage's clock (the manifest's `wall_s`), (2) has the config and builds the store,
(3) ends at once when the output is already committed, (4) verifies external inputs against their planned
fingerprints, (5) checks every declared input: required ones given, each a committed artifact of an accepted
kind, (6) gives the body a private work folder, removed afterwards, (7) calls the stage's entry with a
`StageContext`, and (8) counts a lost commit race as done: outputs are content-addressed, so the loser's work
is the winner's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_core.artifacts.inputs import committed_kind
from forge_core.config import RunConfig, config_to_dict
from forge_core.run.external import verify_external_inputs
from forge_core.run.spec import StageSpec
from forge_core.stages import Stage, StageInput, stage_named
from forge_core.storage import ArtifactAlreadyCommitted, ArtifactWriter, ObjectStore

if TYPE_CHECKING:
    from forge_core.engine.checkpoint import PendingSave

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class HeldPolicy:
    """What a long-lived trainer rank keeps of its last training stage: the engine and the artifact that
    committed its weights, for a weight push (forge_core.run.weight_sync) and for the next GRPO stage to train on.
    A stage takes or drops it before building its own engine, so a rank never holds two models.

    `save_group`: a process group of the trainer's ranks for checkpoints saved behind a stage's commit (None: a
    stage saves in line). The save still running is `pending`; it writes the held engine's own tensors, which is
    why taking or dropping the engine waits for it first (and the next stage's first step starts with the last
    stage's state committed).

    `push`: this rank's part in pushing the running stage's policy to the engines as it is exported (a
    forge_core.run.weight_sync.WeightPush, set by its order; None: no push); the stage sets `push_failed` to why
    that part failed.
    """

    def __init__(self, save_group: Any = None) -> None:
        self.engine: Any = None
        self.stage_uri: str | None = None
        self.save_group = save_group
        self.pending: PendingSave | None = None
        self.push: Any = None
        self.push_failed: str | None = None

    def keep(self, engine: Any, stage_uri: str, pending: PendingSave | None = None) -> None:
        """Hold `engine`, whose weights `stage_uri` committed, and start writing `pending` (its stage's state)."""
        assert self.pending is None, "a save is still pending: take or drop the held engine first"
        self.engine, self.stage_uri, self.pending = engine, stage_uri.rstrip("/"), pending
        if pending is not None:
            pending.start()

    def holds(self, stage_uri: str) -> bool:
        """Whether the held engine holds the weights `stage_uri` committed."""
        return self.engine is not None and self.stage_uri == stage_uri.rstrip("/")

    def settle(self) -> None:
        """Wait for the pending save; raises its failure."""
        pending, self.pending = self.pending, None
        if pending is not None:
            ref = pending.wait()
            log.info("checkpoint %s committed behind its stage", ref.uri)

    def drop(self) -> None:
        """Hold nothing, once the pending save has ended (raising its failure)."""
        self.engine = self.stage_uri = None
        self.settle()

    def take(self, stage_uri: str) -> Any:
        """The held engine when it holds the weights `stage_uri` committed, else None; nothing is held afterwards.
        Waits for the pending save first (raising its failure)."""
        engine = self.engine if self.holds(stage_uri) else None
        self.drop()
        return engine


@dataclass(frozen=True)
class StageContext:
    """One stage run, checked and ready for its body."""

    spec: StageSpec
    stage: Stage
    cfg: RunConfig
    store: ObjectStore
    started: float  # time.perf_counter() when the run began: the manifest's wall_s counts from here
    input_kinds: dict[str, str]  # {input name: the kind of the committed artifact given for it}
    work_folder: Path | None = None  # set by run_spec: private, removed when the body returns
    # A process group a trainer rank keeps up across its stages; None = the stage makes its own if it needs one.
    process_group: Any = None
    # Where such a rank keeps the policy its last stage trained (HeldPolicy); None = nothing outlives the stage.
    held: HeldPolicy | None = None

    @property
    def output_uri(self) -> str:
        return self.spec.output_uri

    @property
    def inputs(self) -> dict[str, str]:
        """{input name: URI} as given (each committed and of an accepted kind)."""
        return dict(self.spec.inputs)

    @property
    def params(self) -> dict:
        return self.spec.params

    @functools.cached_property
    def config(self) -> dict:
        """The run's config as plain data: what manifests, checkpoints and metric sinks record."""
        return config_to_dict(self.cfg)

    @property
    def workdir(self) -> Path:
        assert self.work_folder is not None, "no work folder: the stage body runs through run_spec"
        return self.work_folder

    def input(self, name: str) -> str:
        """The URI of input `name`; a required input (forge_core.stages) is always there."""
        uri = self.spec.inputs.get(name)
        if not uri:
            raise KeyError(f"the {self.stage.name} stage was given no input {name!r}; see optional_input()")
        return uri

    def optional_input(self, name: str) -> str | None:
        return self.spec.inputs.get(name) or None

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def writer(self) -> ArtifactWriter:
        """A writer of this stage's output artifact (its kind and stage name from the registry)."""
        return self.store.writer(self.output_uri, kind=self.stage.kind, stage=self.stage.name)


def stage_context(
    spec: StageSpec,
    cfg: RunConfig | None = None,
    *,
    started: float | None = None,
    process_group: Any = None,
    held: HeldPolicy | None = None,
) -> StageContext | None:
    """The checked context of a stage run (steps 1-5 of the module docstring); None when its output is already
    committed. `cfg`: the RunConfig object the task holds (not validated again); None = validate the spec's."""
    cfg = spec.run_config() if cfg is None else cfg
    store = ObjectStore.from_config(cfg.storage)
    if store.is_committed(spec.output_uri):
        log.info("%s is already committed; nothing to do", spec.output_uri)
        return None
    return checked_context(spec, cfg, store, started=started, process_group=process_group, held=held)


def checked_context(
    spec: StageSpec,
    cfg: RunConfig,
    store: ObjectStore,
    *,
    started: float | None = None,
    process_group: Any = None,
    held: HeldPolicy | None = None,
) -> StageContext:
    """The checked context of a stage run whether or not its output is committed: a committed stage runs again
    through it to rebuild what it saved outside its artifact (a GRPO stage's final optimizer state)."""
    started = time.perf_counter() if started is None else started
    stage = stage_named(spec.stage)
    if stage.external:
        verify_external_inputs(spec, cfg, store)  # what the key was made from is what the stage reads
    for declared in stage.inputs:  # what the spec lacks first, then what it names
        if declared.required:
            required_input(spec, declared)
    kinds = {
        declared.name: committed_kind(store, uri, declared.name, declared.kinds, declared.what)
        for declared in stage.inputs
        if (uri := spec.inputs.get(declared.name))
    }
    return StageContext(
        spec=spec, stage=stage, cfg=cfg, store=store, started=started, input_kinds=kinds,
        process_group=process_group, held=held,
    )  # fmt: skip


def required_input(spec: StageSpec, declared: StageInput) -> str:
    """The URI the spec gives for a required input; ValueError naming what it should be otherwise."""
    uri = spec.inputs.get(declared.name)
    if not uri:
        raise ValueError(
            f"stage spec {spec.output_uri}: inputs has no {declared.name!r} entry (got {sorted(spec.inputs)}); "
            f"the {spec.stage} stage needs the URI of {declared.what}"
        )
    return uri


def run_spec(
    spec: StageSpec,
    cfg: RunConfig | None = None,
    *,
    started: float | None = None,
    process_group: Any = None,
    held: HeldPolicy | None = None,
) -> None:
    """Run the stage `spec` names, with the scaffold around its body."""
    ctx = stage_context(spec, cfg, started=started, process_group=process_group, held=held)
    if ctx is None:
        return
    body = stage_body(ctx.stage)
    try:
        with tempfile.TemporaryDirectory(prefix=f"forge-{ctx.stage.name}-") as folder:
            body(dataclasses.replace(ctx, work_folder=Path(folder)))
    except ArtifactAlreadyCommitted as exc:
        if exc.uri.rstrip("/") != spec.output_uri.rstrip("/"):
            raise  # some other artifact: not this stage's race
        log.info("%s: %s; keeping theirs (same content key)", spec.stage, exc)


def stage_body(stage: Stage) -> Callable[[StageContext], None]:
    """The stage's entry function, imported now (its module may import torch or vLLM)."""
    module_name, _, function = stage.entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the stage exists but one of its own imports is missing: show that error as it is
        raise ValueError(
            f"stage {stage.name!r}: its entry {stage.entry} names module {module_name}, which is not installed"
        ) from exc
    body = getattr(module, function, None)
    if not callable(body):
        raise ValueError(f"stage {stage.name!r}: {module_name} defines no function {function}(ctx)")  # noqa: TRY004
    return body


def worker_process_setup(stage: str) -> None:
    """Set up a launched worker process: log format on stderr, the stage name FORGE_FAULT's `@<stage>` matches,
    and under forge_core.launch the owner guard (the launch ends itself once the launching process is gone, and
    no commit is published meanwhile)."""
    from forge_core.faults import set_current_stage
    from forge_core.launch.guard import guard_launched_worker
    from forge_core.launch.owner import check_owner_alive
    from forge_core.storage.writer import add_pre_commit_check

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    set_current_stage(stage)
    if guard_launched_worker():
        add_pre_commit_check(check_owner_alive)
