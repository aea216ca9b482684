"""Worker entry point of the prepare stage (one plain process, no torchrun):

    python -m forge_core.run prepare --spec <output_uri>/_spec.json

Reads the RunConfig from the spec, builds the store from its `storage` section and runs
`forge_core.data.prepare_data`, which commits the `data` artifact at `spec.output_uri`.
"""

from __future__ import annotations

import logging

from forge_core.data.pipeline import prepare_data
from forge_core.run.external import verify_external_inputs
from forge_core.run.spec import StageSpec
from forge_core.storage import ObjectStore


def main(spec: StageSpec) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = spec.run_config()
    store = ObjectStore.from_config(cfg.storage)
    verify_external_inputs(spec, cfg, store)  # data.source and the tokenizer are what the key was made from
    manifest = prepare_data(cfg, spec.output_uri, store)
    logging.getLogger(__name__).info(
        "committed %s: rows %s, rejects %s", spec.output_uri, manifest.metrics["rows"],
        manifest.metrics["rejects_by_reason"],
    )
