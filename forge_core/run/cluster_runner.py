"""A stage attempt on the Ray cluster: one torchrun node per Ray node of its pool.

    runner = runner_for(cfg, "sft")                 # a ClusterRunner for every stage with a launch of its own
    result = runner.run(plan, log, cancel)          # the runner interface: deadline, cancel, classification

The attempt is a `forge_core.compute.gang.Gang` of `launch.<stage>.nnodes` nodes of `launch.<stage>.pool` (any
node when the pool is null or the cluster embedded), waiting up to `launch.pool_wait_s`; each node runs the
worker launch under torchrun. A lost node ends the attempt retryably; the retry resumes from the newest committed
checkpoint. Every rank gets the attempt's placement in `FORGE_PLACEMENT`, which its committed manifest records.
"""

from __future__ import annotations

import json

from forge_core.compute.gang import Gang, GangRequest, NodePlace
from forge_core.config import RunConfig
from forge_core.faults import fault_environment
from forge_core.launch import LaunchResult, add_stop
from forge_core.launch.owner import FLOW_OWNER_ENV, Owner
from forge_core.run.plan import StagePlan, launch_spec_for
from forge_core.run.resources import FlowResources
from forge_core.run.runner import Attempt, LogSink, Runner
from forge_core.storage.manifest import PLACEMENT_ENV


def placement_record(pool: str | None, attempt: str, places: list[NodePlace], node_rank: int) -> dict:
    """What a manifest committed by node `node_rank` of an attempt records under `placement`."""
    nodes = [place.record() for place in places]
    return {
        "placement": "ray",
        "pool": pool or "",
        "attempt": attempt,
        "nodes": nodes,
        "committed_by": nodes[node_rank],
    }


class ClusterRunner(Runner):
    """A stage-lifetime stage as a gang on the Ray cluster."""

    def __init__(self, cfg: RunConfig, stage: str) -> None:
        super().__init__(cfg, stage)
        pool = self.resources.pool
        self.where = f"pool {pool!r} of the Ray cluster" if pool else "the Ray cluster"

    def start(self, plan: StagePlan, log: LogSink) -> Attempt:
        resources = self.resources
        cluster = FlowResources.of(self.cfg).cluster()  # joined (or started) by the run's first placed stage
        pool = None if cluster.embedded else resources.pool
        request = GangRequest(pool, nnodes=resources.nnodes, gpus_per_node=resources.gpus_per_node)
        log(f"{plan.stage}: waiting for {request.describe()} (up to launch.pool_wait_s={self.cfg.launch.pool_wait_s:g} s)")

        def node_env(places: list[NodePlace], node_rank: int) -> dict[str, str]:
            record = placement_record(pool, plan.spec.attempt, places, node_rank)
            return {PLACEMENT_ENV: json.dumps(record, sort_keys=True)}

        # A Ray node's processes have that node's environment, not this one's: what a launch must see from here
        # (faults, this process as the launch's owner) travels in its spec.
        gang = Gang(
            cluster,
            request,
            launch_spec_for(
                plan, self.cfg, extra_env={**fault_environment(), FLOW_OWNER_ENV: str(Owner.this_process(True))}
            ),
            log,
            wait_s=self.cfg.launch.pool_wait_s,
            name=plan.stage,
            node_env=node_env,
        )
        attempt = _GangAttempt(gang)  # the flow's cancel reaches it while it waits for its placement too
        try:
            gang.start()
        except BaseException:
            attempt.unregister()
            raise
        placed = ", ".join(f"node {p.node_rank} on {p.node_id[:8]} ({p.address})" for p in gang.placement)
        log(f"{plan.stage}: placed {placed}" if placed else f"{plan.stage}: stopped before it was placed")
        return attempt


class _GangAttempt:
    """A running gang that the flow's cancel or crash (forge_core.launch.terminate_all_live) also stops."""

    launch_id = ""

    def __init__(self, gang: Gang) -> None:
        self.gang = gang
        self.unregister = add_stop(gang.stop)

    def wait(self, timeout: float) -> LaunchResult | None:
        return self._ended(self.gang.wait(timeout))

    def stop(self, reason: str) -> LaunchResult | None:
        return self._ended(self.gang.stop(reason))

    def _ended(self, result: LaunchResult | None) -> LaunchResult | None:
        if result is not None:
            self.unregister()
        return result
