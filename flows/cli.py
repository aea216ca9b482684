"""The `forgeflow` command line: the common paths around the Prefect flows.

forgeflow run configs/demo_cpu.yaml sft.steps=100 grpo.iterations=2   # run the pipeline now
forgeflow validate configs/qwen3_1_7b_gsm8k.yaml [--here]              # check a config, its inputs and pools
forgeflow status [--config my.yaml] [storage.root=...]                 # recent runs, artifacts (last run's store)
forgeflow export last ./my-model [--push-to-hub me/my-model]           # a trained policy as an HF folder
forgeflow pools create forgeflow                                         # a process work pool for the deployment
forgeflow drill configs/drills/ci.yaml [--out DIR] [--judge drill.json]    # fault drills on a ladder of clusters
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from flows.local_prefect import use_local_server_settings
from forge_core.config import ConfigError, load_config
from forge_core.credentials import hide_credentials_in_overrides
from forge_core.stages import all_stages


def _cmd_run(args: argparse.Namespace) -> int:
    """Exit status 1 when GRPO stopped early for lack of learning signal (the ending says why)."""
    from flows.post_train import post_train
    from flows.report import finish_run

    cfg = load_config(args.config, args.overrides)
    started = time.time()
    # Prefect records the flow's parameters: a tokenised URL in an override goes in redacted.
    summary = post_train(args.config, hide_credentials_in_overrides(args.overrides))
    return 1 if finish_run(summary, cfg, started, args.config).get("stopped") else 0


def _cmd_validate(args: argparse.Namespace) -> int:
    """The config, then what a flow start checks before its first stage (--here: this host for every stage)."""

    from flows.preflight import check_run

    cfg = load_config(args.config, args.overrides)
    host = check_run(cfg, here=args.here)
    where = f", and this host can run it ({host.describe()})" if host is not None else ""
    print(f"{args.config}: valid{where}")
    return 0


async def _recent_flow_runs(limit: int) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    async with get_client() as client:
        return await client.read_flow_runs(limit=limit, sort=FlowRunSort.START_TIME_DESC)


def _cmd_status(args: argparse.Namespace) -> int:
    from flows.last_run import status_store

    cfg = load_config(args.config, args.overrides)
    named = args.config is not None or any(o.startswith("storage.") for o in args.overrides)
    store, origin = status_store(cfg, store_named=named)
    print(f"store {store.root}: {origin}; read another with --config <yaml> or storage.root=<uri>")
    for run in asyncio.run(_recent_flow_runs(args.limit)):
        state = run.state.name if run.state else "?"
        print(f"{run.id}  {run.name:<28} {state:<12} {run.start_time or ''}")
    for kind in dict.fromkeys(stage.kind for stage in all_stages()):  # every registered stage's kind
        uris = store.list_committed(kind)
        print(f"{kind:<9} {len(uris)} committed" + (f", newest {uris[-1]}" if uris else ""))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from flows.export import export

    export(args.source, args.target, load_config(args.config, args.overrides), hub_repo=args.push_to_hub)
    return 0


def _cmd_pools_create(args: argparse.Namespace) -> int:
    from flows.pools import create_pool

    asyncio.run(create_pool(args.name))
    return 0


def _cmd_drill(args: argparse.Namespace) -> int:
    """Exit status 1 when the drill fails its verdict (each problem printed)."""
    from flows.drill import DrillFailed, drill
    from forge_core.drills.plan import load_plan
    from forge_core.drills.report import judge

    if args.judge:
        import json
        from pathlib import Path

        problems = judge(json.loads(Path(args.judge).read_text()), load_plan(args.plan, args.overrides))
    else:
        try:
            record = drill(args.plan, args.overrides, args.out)
            problems = record["problems"]
        except DrillFailed as exc:
            problems = str(exc).splitlines()[1:]
    for problem in problems:
        print(f"drill problem: {problem}", file=sys.stderr)
    print(f"drill {'failed' if problems else 'passed'}")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgeflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the post-training pipeline now")
    run.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. sft.steps=100")
    run.set_defaults(handler=_cmd_run)

    validate = sub.add_parser("validate", help="validate a config and its overrides")
    validate.add_argument("config")
    validate.add_argument("overrides", nargs="*")
    validate.add_argument(
        "--here",
        action="store_true",
        help="check this host's GPUs and vLLM build for every stage, also those placed on pools",
    )
    validate.set_defaults(handler=_cmd_validate)

    status = sub.add_parser("status", help="recent flow runs and committed artifacts")
    status.add_argument(
        "--config", default=None,
        help="the store of this YAML (default: the store of the last run recorded in logging.dir, ./.forge-runs)",
    )
    status.add_argument("--limit", type=int, default=10)
    status.add_argument("overrides", nargs="*", help="key=value overrides, e.g. storage.root=s3://bucket/x")
    status.set_defaults(handler=_cmd_status)

    export = sub.add_parser(
        "export", help="copy a committed policy (verified) to a plain HF folder that transformers loads"
    )
    export.add_argument(
        "source",
        help="`last` (the last run's final policy, recorded in logging.dir), a flow run id, or the URI of a "
        "policy or of an sft/grpo artifact (s3://..., file://... or a local path)",
    )
    export.add_argument("target", help="a new or empty folder")
    export.add_argument(
        "--config", default=None, help="the run's YAML: its logging.dir and store settings (default: the defaults)"
    )
    export.add_argument(
        "--push-to-hub", metavar="REPO_ID", default=None,
        help="then upload the folder to this Hugging Face model repo (private when created; needs HF_TOKEN)",
    )
    export.add_argument("overrides", nargs="*", help="key=value overrides, e.g. logging.dir=/runs")
    export.set_defaults(handler=_cmd_export)

    pools = sub.add_parser("pools", help="Prefect work pools for the flow's deployment")
    pools_sub = pools.add_subparsers(dest="pools_command", required=True)
    create = pools_sub.add_parser(
        "create",
        help="create a process work pool for the flow's deployment (the stages' pools are Ray node labels)",
    )
    create.add_argument("name")
    create.set_defaults(handler=_cmd_pools_create)

    drill = sub.add_parser("drill", help="fault drills on a ladder of cluster sizes, judged and reported")
    drill.add_argument("plan", help="drill plan, e.g. configs/drills/ci.yaml")
    drill.add_argument("overrides", nargs="*", help="key=value plan overrides, e.g. 'steps=[{nodes: 3}]'")
    drill.add_argument("--out", default=None, help="report folder (default: <logging.dir>/drills/<name>-<time>)")
    drill.add_argument("--judge", metavar="DRILL_JSON", default=None,
                       help="judge a recorded drill.json against the plan instead of running it")
    drill.set_defaults(handler=_cmd_drill)
    return parser


def main(argv: list[str] | None = None) -> int:
    use_local_server_settings()  # before any command imports Prefect
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, ValueError) as error:
        print(f"forgeflow: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
