from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
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
