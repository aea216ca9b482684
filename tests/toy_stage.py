"""A stage added to forgeflow through the stage registry alone: this module (its body) and its one record.

`toy_count` reads the SFT table of a committed `data` artifact and commits a `toy_counts` artifact with the row
count and the longest row. Nothing else in forgeflow names it: the planner, the worker dispatcher
(`python -m forge_core.run toy_count`, which finds this module through FORGE_STAGE_MODULES), the worker
scaffold, the runners and the generic Prefect task (`tasks.stage_task`) all read the record.
"""

from __future__ import annotations

import pyarrow.compute as pc

from forge_core.stages import Stage, StageInput, register_stage

TOY = register_stage(
    Stage(
        name="toy_count",
        kind="toy_counts",
        entry="tests.toy_stage:count_rows",
        inputs=(StageInput("data", ("data",), "a committed data artifact (sft.parquet)"),),
        key_sections=("seed", "data"),
        description="counts the SFT rows of a data artifact",
        key_metric="tests.toy_stage:rows_line",
    )
)


def rows_line(metrics) -> str:
    """Its line in the stage table."""
    return f"rows {metrics.get('rows')}, longest {metrics.get('longest')}"


def count_rows(ctx) -> None:
    """The stage body (ctx: forge_core.run.scaffold.StageContext): read, write, commit."""
    table = ctx.store.reader(ctx.input("data")).read_table("sft.parquet", columns=["input_ids"])
    lengths = pc.list_value_length(table.column("input_ids"))
    counts = {"rows": table.num_rows, "longest": int(pc.max(lengths).as_py())}
    writer = ctx.writer()
    writer.write_json("counts.json", counts)
    writer.commit(config=ctx.config, inputs=ctx.inputs, metrics={**counts, "wall_s": ctx.wall_s()})
