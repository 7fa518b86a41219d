"""The node agent heartbeats through its node's Lease and leaves the Node alone (real API server).

Before, the agent re-wrote its Node condition every ``heartbeat_s``: at scale that is a Node write per
node per minute, each one re-sent to every Node watcher. Now the Lease moves and the Node does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Node

from gpufrac.contract import keys
from gpufrac.node.agent import NodeAgent
from gpufrac.node.config import load_settings


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def node_name(client: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await client.create(Node(metadata=ObjectMeta(name=name)))
    yield name
    await client.delete(Node, name)


@pytest.fixture
async def lease_namespace(client: AsyncClient) -> AsyncIterator[str]:
    name = f"leases-{uuid.uuid4().hex[:8]}"
    await client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    await client.delete(Namespace, name)


async def test_the_agent_renews_its_lease_without_writing_its_node(
    client: AsyncClient, node_name: str, lease_namespace: str, tmp_path: Path
) -> None:
    settings = load_settings(
        None,
        node_name=node_name,
        backend="simulated",
        sim_gpus="1xH100-80GB",
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        heartbeat_s=0.1,
        publish_interval_s=0.05,
        lease_namespace=lease_namespace,
    )
    agent = NodeAgent(settings=settings, client=client)
    assert agent.publisher is not None and agent.lease is not None
    publishing = asyncio.create_task(agent.publisher.run())
    renewing = asyncio.create_task(agent.lease.run())
    try:
        while agent.publisher.published is None:
            await asyncio.sleep(0.02)
        written = (await client.get(Node, node_name)).metadata.resourceVersion
        first = agent.lease.renewals
        while agent.lease.renewals < first + 10:  # ten heartbeats, many publisher intervals
            await asyncio.sleep(0.02)
        assert (await client.get(Node, node_name)).metadata.resourceVersion == written
        lease = await client.get(Lease, node_name, namespace=lease_namespace)
        assert lease.spec is not None and lease.spec.holderIdentity == node_name
        assert lease.spec.leaseDurationSeconds == agent.lease.duration_s
    finally:
        for task in (publishing, renewing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_the_default_lease_namespace_is_the_contracts() -> None:
    settings = load_settings(None, node_name="n", backend="simulated", sim_gpus="1xL4-24GB")
    assert settings.lease_namespace == keys.NODE_LEASE_NAMESPACE
