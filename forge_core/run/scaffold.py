"""What every stage run shares, wherever it runs (a launched worker or a thread of the task's process).

    run_spec(stage_main, spec)      # the stage body on its spec; a lost commit race counts as done

Two attempts of one stage can race (two runs of one config, a zombie of a dead flow, an in-process stage past
its deadline): the storage layer lets exactly one commit win (forge_core.storage: exclusive manifests). The
output is content-addressed, so the loser's work is the winner's: its stage ends as done, not failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from forge_core.run.spec import StageSpec
from forge_core.storage import ArtifactAlreadyCommitted

log = logging.getLogger(__name__)


def run_spec(stage_main: Callable[[StageSpec], None], spec: StageSpec) -> None:
    """Run `stage_main(spec)`; another attempt's commit of the same output ends it as done."""
    try:
        stage_main(spec)
    except ArtifactAlreadyCommitted as exc:
        if exc.uri.rstrip("/") != spec.output_uri.rstrip("/"):
            raise  # some other artifact: not this stage's race
        log.info("%s: %s; keeping theirs (same content key)", spec.stage, exc)
