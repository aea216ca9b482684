"""What a finished pipeline shows its user: a stage table, the learning curve and a reward/accuracy plot,
all rebuilt from the committed manifests:

    print(format_table(stage_table(records, store)))

    print(format_learning(evals, rollout_rewards))   # accuracy after SFT and after every GRPO iteration
    summary = finish_run(summary, cfg, started)      # the end of every run, whichever entry point started it
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from forge_core.metrics.key_metrics import fmt as _fmt
from forge_core.metrics.phases import phase_seconds
from forge_core.stages import stage_of_kind
from forge_core.storage import Manifest, ObjectStore


@dataclass
class StageRecord:
    label: str  # e.g. "sft", "rollout-1", "eval-grpo-2"
    uri: str
    seconds: float  # wall time of the task as the flow saw it (0 when skipped quickly)


def no_learning_signal(metrics: Mapping) -> str | None:
    """Why a GRPO iteration's manifest metrics show no learning signal (no optimizer step, or no reward
    variance), or None."""
    reasons = []
    if metrics.get("train/steps") == 0:
        reasons.append("it made no optimizer step")
    if metrics.get("advantage/zero_variance_frac") == 1.0 or metrics.get("reward/std") == 0.0:
        reasons.append(f"its rollouts carried no reward variance (every group scored {_fmt(metrics.get('reward/mean'))})")
    return " and ".join(reasons) or None


def no_signal_fix(max_iterations: int) -> str:
    """What to change when GRPO iterations carry no learning signal."""
    return (
        "Check that rollout.rewards can score this data (forgeflow validate dry-runs them on the references), "
        "raise rollout.sampling.temperature or group_size so samples differ, or start from a policy that solves "
        f"some prompts (grpo.max_no_signal_iterations={max_iterations} bounds how many such iterations in a row "
        "run; 0 = never stop)"
    )


def key_metric(manifest: Manifest) -> str:
    """The artifact's stage `key_metric` line ("" for a kind without one)."""
    stage = stage_of_kind(manifest.kind)
    return stage.describe_metrics(manifest.metrics) if stage is not None else ""


def stage_table(records: list[StageRecord], store: ObjectStore) -> list[dict]:
    """One row per stage run: stage, duration (s), key metric, warning, phases, where it ran, artifact URI."""
    rows = []
    for record in records:
        manifest = store.read_manifest(record.uri)
        rows.append(
            {
                "stage": record.label,
                "duration_s": round(record.seconds, 1),
                "key metric": key_metric(manifest),
                "warning": _warning(manifest),
                "phases": phase_text(manifest.metrics),
                "where": where_it_ran(manifest),
                "artifact": record.uri,
            }
        )
    return rows


def phase_text(metrics: Mapping) -> str:
    """The phases that took >= 0.05 s, as "load 0.8s, steps 8.6s"; "" for a stage that records none."""
    shown = [f"{name} {seconds:.1f}s" for name, seconds in phase_seconds(metrics).items() if seconds >= 0.05]
    return ", ".join(shown)


def _warning(manifest: Manifest) -> str:
    """A GRPO iteration's no-learning-signal warning, else ""."""
    no_signal = no_learning_signal(manifest.metrics) if manifest.kind == "grpo" else None
    return f"no learning signal: {no_signal}" if no_signal else ""


def _placed(manifest: Manifest) -> dict | None:
    """The placement record of a stage run on the Ray cluster, or None."""
    placement = manifest.placement
    return placement if placement and "pool" in placement else None


def _node_name(placement: dict, node: dict) -> str:
    """A Ray node as the tables show it: its id, and what ran there for the stage (the trainer group, an engine)."""
    if placement.get("served_by") == "trainer":
        role = " (trainer group)"
    elif placement.get("served_by") == "engines":
        role = f" (engine {node.get('node_rank')})"
    else:
        role = ""
    return f"{str(node.get('node_id', ''))[:8]}{role}"


def where_it_ran(manifest: Manifest) -> str:
    """`<pool>: <Ray node>[, ...]` in node-rank order, or `local (<host>)` without a placement record."""
    placement = _placed(manifest)
    if not placement:
        return f"local ({manifest.host})"
    nodes = ", ".join(_node_name(placement, node) for node in placement.get("nodes", []))
    return f"{placement.get('pool') or 'ray'}: {nodes}"


def placement_table(records: list[StageRecord], store: ObjectStore) -> list[dict]:
    """Where every stage ran, one row per node: stage, pool, node rank, Ray node, host, GPUs; one "local" row
    for a manifest without a placement record."""
    rows = []
    for record in records:
        manifest = store.read_manifest(record.uri)
        placement = _placed(manifest)
        if not placement:
            rows.append({"stage": record.label, "pool": "local", "node": 0, "ray node": "", "host": manifest.host,
                         "gpus": ""})
            continue
        for node in placement.get("nodes", []):
            rows.append(
                {
                    "stage": record.label,
                    "pool": placement.get("pool") or "ray",
                    "node": node.get("node_rank"),
                    "ray node": _node_name(placement, node),
                    "host": node.get("host"),
                    "gpus": ",".join(node.get("gpus") or []),
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table for the console."""
    if not rows:
        return ""
    headers = list(rows[0])
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in headers}
    line = "  ".join(h.ljust(widths[h]) for h in headers)
    body = ["  ".join(str(r[h]).ljust(widths[h]) for h in headers) for r in rows]
    return "\n".join([line, "-" * len(line), *body])


def format_learning(evals: list[Mapping], rollout_rewards: list[float]) -> str:
    """Held-out accuracy per policy, its change from SFT and the mean reward of the rollouts each iteration
    trained on. `evals` are PipelineSummary.evals as dicts."""
    if not evals:
        return ""
    base = evals[0]["accuracy"]
    lines = ["policy      accuracy   vs SFT   mean reward   rollout reward"]
    for index, point in enumerate(evals):
        delta = "" if index == 0 else f"{100 * (point['accuracy'] - base):+6.1f} pt"
        trained_on = f"{rollout_rewards[index - 1]:.3f}" if 0 < index <= len(rollout_rewards) else ""
        lines.append(
            f"{point['label']:<10}  {100 * point['accuracy']:6.1f}%   {delta:>8}   "
            f"{point['mean_reward']:11.3f}   {trained_on:>14}"
        )
    return "\n".join(lines)


def format_tool_use(evals: list[Mapping], eval_metrics: list[Mapping]) -> str:
    """Per evaluated policy of a multi-turn run: held-out success, tool-call rate, tool errors, turns per
    episode (from the evaluate stage's `env/*` metrics)."""
    lines = ["policy      success   tool-call rate   tool errors   turns/episode"]
    for point, metrics in zip(evals, eval_metrics):
        lines.append(
            f"{point['label']:<10}  {100 * point['accuracy']:6.1f}%   {100 * metrics.get('env/tool_call_rate', 0.0):13.1f}%"
            f"   {int(metrics.get('env/tool_errors', 0)):11d}   {metrics.get('env/turns_mean', 0.0):13.2f}"
        )
    return "\n".join(lines)


def plot_curves(labels: list[str], accuracy: list[float], rollout_reward: list[float], path: Path) -> Path:
    """Held-out accuracy per policy and mean rollout reward per GRPO iteration, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or worker nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(range(len(accuracy)), accuracy, marker="o", label="held-out accuracy")
    if rollout_reward:
        # Iteration k's rollouts were generated by policy k-1 (index k-1 on the x axis).
        ax.plot(range(len(rollout_reward)), rollout_reward, marker="s", label="mean rollout reward")
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("policy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _new_wandb_runs(log_dir: Path, since: float) -> list[Path]:
    """The wandb offline runs this run wrote (a skipped stage writes none)."""
    return sorted(p for p in log_dir.glob("*/wandb/offline-run-*") if p.stat().st_mtime >= since)


def _rollout_rewards(summary: Mapping, store: ObjectStore) -> list[float]:
    return [float(store.read_manifest(uri).metrics["reward_mean"]) for uri in summary["rollouts"]]


def finish_run(summary: dict, cfg, started: float, config: str | None = None) -> dict:
    """The end of every run: record it (flows.last_run) and print its tables, results and where they are.

    `summary` is the flow's PipelineSummary as a dict, `started` the run's time.time() start. Returns
    `summary` with `summary_path`, the recorded file.
    """
    from flows.last_run import record_run

    store = ObjectStore.from_config(cfg.storage)
    summary = {**summary, "summary_path": str(record_run(summary, cfg, config))}
    print("\n" + format_table(summary["stages"]))
    _print_learning(summary, cfg, store)
    _print_whereabouts(summary, cfg, store, started)
    return summary


def _print_learning(summary: Mapping, cfg, store: ObjectStore) -> None:
    """Held-out accuracy per policy (and tool use), the gain over SFT, why GRPO stopped early."""
    evals = summary["evals"]
    print("\nHeld-out exact match (greedy) after SFT and after each GRPO iteration:")
    print(format_learning(evals, _rollout_rewards(summary, store)))
    if cfg.rollout.env.enabled:
        print(f"\nTool use on the held-out prompts ({cfg.rollout.env.name}: {', '.join(cfg.rollout.env.tools)}):")
        print(format_tool_use(evals, [store.read_manifest(e["eval_uri"]).metrics for e in evals]))
    if len(evals) > 1:
        gain = 100 * (evals[-1]["accuracy"] - evals[0]["accuracy"])
        print(f"GRPO changed held-out accuracy by {gain:+.1f} points over the SFT policy.")
    if summary.get("stopped"):
        print(f"\nGRPO stopped early: {summary['stopped']}")


def _print_whereabouts(summary: Mapping, cfg, store: ObjectStore, started: float) -> None:
    """Where the run's results are: the final policy and its export command, plot, flow run, summary, wandb."""
    from flows.export import export_command

    policy = store.join(summary["final_policy_uri"], "policy")
    log_dir = Path(cfg.logging.dir).resolve()
    print(f"\nfinal policy:  {policy}")
    print(f"export it:     {export_command(policy, cfg)}  (a verified, plain HF folder)")
    print(f"plot:          {summary['plot_path']}  (also on the Prefect flow run as an image artifact)")
    print(f"flow run:      {summary['flow_run_id']}  (browse it: .venv/bin/prefect server start)")
    print(f"summary:       {summary['summary_path']}")
    runs = _new_wandb_runs(log_dir, started)
    if cfg.logging.wandb_mode == "disabled":
        print("wandb:         off (logging.wandb_mode: disabled)")
    elif runs:
        print(f"wandb:         {len(runs)} offline runs under {log_dir}")
        print(f"               upload later: .venv/bin/wandb sync {log_dir}/*/wandb/offline-run-*")
    else:
        print(f"wandb:         no new runs (every training stage was already committed); see {log_dir}")
    print(f"total:         {time.time() - started:.0f}s")
