"""The prepare stage (one plain process, no torchrun): commits the `data` artifact via prepare_data.

    python -m forge_core.run prepare --spec <output_uri>/_specs/<attempt>.json
"""

from __future__ import annotations

import logging

from forge_core.data.pipeline import prepare_data
from forge_core.run.scaffold import StageContext

log = logging.getLogger(__name__)


def prepare(ctx: StageContext) -> None:
    manifest = prepare_data(ctx.cfg, ctx.output_uri, ctx.store)
    log.info(
        "committed %s: rows %s, rejects %s", ctx.output_uri, manifest.metrics["rows"],
        manifest.metrics["rejects_by_reason"],
    )  # fmt: skip
