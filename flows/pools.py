"""Work pools as forgeflow uses them (`forgeflow pools create`): a process pool for the flow's deployment. The
stages' pools are Ray's (the label forgeflow.pool=<pool> of their nodes; Ray accounts their GPUs)."""

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


async def create_pool(name: str) -> None:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        await ensure_work_pool(client, name)
