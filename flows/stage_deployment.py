"""The stage deployment of a pool: `stage-node/<pool>`, whose runs are the node runs of placed stage attempts.

    forgeflow pools create gpu-a --gpus 8           # the pool, its GPU limit and this deployment
    FORGE_NODE_ADDRESS=10.0.0.7 forgeflow worker start gpu-a --name node-7      # node 7's worker (flows/node_worker.py)

With `launch.placement: pool` a stage task starts one run of its pool's stage deployment per node
(forge_core.run.placement.PoolRunner through tasks/placement.py); the run executes `stage_node` on the worker
that took it: the node's part of the attempt, exactly the stage worker a local launch would run (torchrun for a
distributed stage), joined to its peers by the rendezvous the attempt arranges in the store
(forge_core.run.placement.run_node); or, for a flow lifetime, the run's resident that holds its engines or its
trainer job on this worker until the flow ends (forge_core.run.resident.run_resident). Its only parameter is the node order (URIs, names, numbers: nothing
secret); credentials come from the worker's environment. The result goes to the store; the run itself ends
Failed when the node's part failed, so the UI shows it under the stage task.

The entrypoint is a module path (`flows.stage_deployment.stage_node`): the worker's environment imports it
(forgeflow installed there), so the deployment needs no pull step and each node run works in a folder of its
own node: FORGE_NODE_DIR when the worker sets it (relative paths of the config, such as logging.dir, land
there), else the process worker's temporary folder.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger

from forge_core.launch import install_sigterm_handler, reap_orphaned_launches
from forge_core.run.placement import NodeOrder, run_node
from forge_core.run.resident import run_resident
from tasks.placement import STAGE_FLOW_NAME

ENTRYPOINT = "flows.stage_deployment.stage_node"
NODE_DIR_ENV = "FORGE_NODE_DIR"
WORKER_NAME_ENV = "PREFECT__WORKER_NAME"  # set by the Prefect worker in every run it starts


class NodeFailed(RuntimeError):
    """This node's part of the attempt did not succeed (the attempt reads why from the store)."""


@flow(name=STAGE_FLOW_NAME, log_prints=True)
def stage_node(order: dict) -> dict:
    """One node's part of a placed stage attempt (module docstring); returns its outcome."""
    logger = get_run_logger()
    install_sigterm_handler()  # a cancelled node run takes its launch down with it
    node_dir = os.environ.get(NODE_DIR_ENV)
    if node_dir:
        os.makedirs(node_dir, exist_ok=True)
        os.chdir(node_dir)
    ended = reap_orphaned_launches()
    if ended:
        logger.warning("ended %d processes an earlier node run on this machine left running: %s", len(ended), ended)
    node_order = NodeOrder.from_params(order)
    run = run_resident if node_order.resident else run_node
    result = run(node_order, logger.info, worker=os.environ.get(WORKER_NAME_ENV))
    if not result.ok:
        raise NodeFailed(f"node {node_order.node_rank} of {node_order.stage}: {result.outcome.value}: {result.reason}")
    return {"outcome": result.outcome.value, "node_rank": node_order.node_rank}


async def ensure_module_deployment(client, flow_fn, name: str, pool: str, entrypoint: str, description: str = ""):
    """Create (or update) the deployment `<flow_fn's name>/<name>` on `pool` that runs `entrypoint`, a module
    path the workers import (no pull step: forgeflow is installed on every node)."""
    flow_id = await client.create_flow_from_name(flow_fn.name)
    return await client.create_deployment(
        flow_id=flow_id,
        name=name,
        work_pool_name=pool,
        entrypoint=entrypoint,
        parameter_openapi_schema=flow_fn.parameters.model_dump_for_openapi(),
        enforce_parameter_schema=False,
        description=description,
        tags=["forgeflow"],
    )


async def ensure_stage_deployment(client, pool: str) -> None:
    """Create (or update) `stage-node/<pool>` on `pool` (`forgeflow pools create` calls it)."""
    description = f"Node runs of forgeflow stages placed on pool {pool!r} (launch.placement=pool)."
    await ensure_module_deployment(client, stage_node, pool, pool, ENTRYPOINT, description)
    print(f"stage deployment '{STAGE_FLOW_NAME}/{pool}' ready (entrypoint {ENTRYPOINT})")
