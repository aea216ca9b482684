"""Work pools as forgeflow uses them: a process pool, its GPU limit, one work queue per worker and the pool's stage
deployment (`forgeflow pools create`), and what a node's worker ensures at its start (`forgeflow worker start`).
"""

from __future__ import annotations

POOL_TYPE = "process"


async def ensure_work_pool(client, name: str) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    try:
        await client.create_work_pool(WorkPoolCreate(name=name, type=POOL_TYPE))
        print(f"work pool {name!r} created (type {POOL_TYPE})")
    except ObjectAlreadyExists:
        existing = await client.read_work_pool(name)
        if existing.type != POOL_TYPE:
            raise ValueError(
                f"work pool {name!r} exists with type {existing.type!r}; forgeflow stages need a "
                f"{POOL_TYPE!r} pool: pick another name or delete it (prefect work-pool delete {name})"
            ) from None
        print(f"work pool {name!r} exists (type {POOL_TYPE})")


async def ensure_gpu_limit(client, name: str, gpus: int) -> None:
    """The pool's GPU capacity as a global concurrency limit of the same name, set to exactly `gpus`."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    try:
        existing = await client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        await client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=gpus))
        print(f"global concurrency limit {name!r} = {gpus} GPUs created")
        return
    if existing.limit == gpus:
        print(f"global concurrency limit {name!r} = {gpus} GPUs exists")
        return
    await client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=gpus))
    print(f"global concurrency limit {name!r} changed from {existing.limit} to {gpus} GPUs")


async def ensure_worker_queue(client, pool: str, worker: str) -> None:
    """The worker's own work queue in `pool`, named after it: placement pins a node run to a worker through it
    (`forgeflow worker start <pool> --name <worker>` creates it too; a Prefect worker does not)."""
    from prefect.exceptions import ObjectAlreadyExists

    try:
        await client.create_work_queue(name=worker, work_pool_name=pool)
        print(f"work queue {worker!r} created in pool {pool!r}")
    except ObjectAlreadyExists:
        print(f"work queue {worker!r} exists in pool {pool!r}")


async def create_pool(name: str, gpus: int, workers: list[str]) -> None:
    from prefect.client.orchestration import get_client

    from flows.stage_deployment import ensure_stage_deployment

    async with get_client() as client:
        await ensure_work_pool(client, name)
        if gpus > 0:
            await ensure_gpu_limit(client, name, gpus)
        for worker in workers:
            await ensure_worker_queue(client, name, worker)
        # Stages placed on this pool (launch.placement=pool) run as runs of its stage deployment.
        await ensure_stage_deployment(client, name)
