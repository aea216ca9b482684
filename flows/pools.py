"""Work pools as forgeflow uses them (`forgeflow pools create`): a process pool for the flow's deployment and its
GPU limit, the capacity of the GPUs the stages take on the flow's machine (launch.placement=local). On the Ray
cluster (placement=pool) a pool is the label forgeflow.pool=<pool> of its nodes and Ray accounts their GPUs.
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


async def create_pool(name: str, gpus: int) -> None:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        await ensure_work_pool(client, name)
        if gpus > 0:
            await ensure_gpu_limit(client, name, gpus)
