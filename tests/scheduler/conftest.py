from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import ReplicaSet
from lightkube.resources.core_v1 import Namespace
from lightkube.resources.scheduling_v1 import PriorityClass
from sched_harness import Pool, delete_nodes, new_pool


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def pool(client: AsyncClient) -> AsyncIterator[Pool]:
    """A fresh namespace, scheduler name and node label; the pool's nodes are deleted afterwards."""
    p = new_pool()
    await client.create(Namespace(metadata=ObjectMeta(name=p.namespace)))
    try:
        yield p
    finally:
        await delete_nodes(client, p)


@pytest.fixture
async def priorities(client: AsyncClient, pool: Pool) -> AsyncIterator[dict[str, str]]:
    """Three PriorityClasses of this pool: low (5), mid (10), high (1000)."""
    names = {level: f"{level}-{pool.id}" for level in ("low", "mid", "high")}
    for level, value in (("low", 5), ("mid", 10), ("high", 1000)):
        await client.create(PriorityClass(metadata=ObjectMeta(name=names[level]), value=value))
    try:
        yield names
    finally:
        for name in names.values():
            with contextlib.suppress(Exception):
                await client.delete(PriorityClass, name)


@pytest.fixture
async def replicaset(client: AsyncClient, pool: Pool) -> AsyncIterator[ReplicaSet]:
    """A ReplicaSet that owns the movable pods (no controller runs: the test recreates its pods)."""
    rs = ReplicaSet.from_dict(
        {
            "metadata": {"name": "serve", "namespace": pool.namespace},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "serve"}},
                "template": {
                    "metadata": {"labels": {"app": "serve"}},
                    "spec": {"containers": [{"name": "app", "image": "busybox"}]},
                },
            },
        }
    )
    created = await client.create(rs)
    try:
        yield created
    finally:
        with contextlib.suppress(Exception):
            await client.delete(ReplicaSet, "serve", namespace=pool.namespace)
