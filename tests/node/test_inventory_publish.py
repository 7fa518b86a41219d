"""The inventory on a real API server: published from the simulated backend, withdrawn when a GPU goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import NodeCondition, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node

from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, simulated_uuid
from gpufrac.node.mps.mode import capability_for

READY = "gpu-fractioning.nvidia.com/Ready"


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def node_name(client: AsyncClient) -> AsyncIterator[str]:
    """A Node as a kubelet registers it: its own labels and its own Ready condition."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await client.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    await client.patch(
        Node.Status,
        name,
        {
            "status": NodeStatus(
                conditions=[NodeCondition(type="Ready", status="True", reason="KubeletReady")]
            ).to_dict()
        },
    )
    yield name
    await client.delete(Node, name)


def condition(node: Node, type_: str) -> NodeCondition:
    assert node.status is not None
    return next(c for c in node.status.conditions or [] if c.type == type_)


def published_gpus(node: Node) -> list[dict[str, object]]:
    assert node.metadata is not None and node.metadata.annotations is not None
    return json.loads(node.metadata.annotations["gpufrac.io/gpus"])


def publisher(client: AsyncClient, name: str, backend: SimulatedInventory, **kwargs) -> InventoryPublisher:  # type: ignore[no-untyped-def]
    return InventoryPublisher(
        client=client,
        node_name=name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        **kwargs,
    )


async def test_simulated_gpus_are_published_on_the_node(client: AsyncClient, node_name: str) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("2xH100-80GB"))
    await publisher(client, node_name, backend).publish_once()

    node = await client.get(Node, node_name)
    assert published_gpus(node) == [
        {
            "uuid": simulated_uuid(node_name, 0),
            "index": 0,
            "model": "H100-80GB",
            "mib": 81559,
            "mode": "fractions",
        },
        {
            "uuid": simulated_uuid(node_name, 1),
            "index": 1,
            "model": "H100-80GB",
            "mib": 81559,
            "mode": "fractions",
        },
    ]
    assert node.metadata is not None and node.metadata.labels is not None
    node_labels = node.metadata.labels
    assert node_labels["gpufrac.io/managed"] == "true"
    assert node_labels["gpu-fractioning.kai.scheduler/nvidia-driver-version.major"] == "615"
    assert node_labels["gpufrac.io/compute-mode.time-slicing"] == "true"
    assert node_labels["gpufrac.io/compute-mode.sm-sharing"] == "true"
    assert node_labels["kubernetes.io/hostname"] == node_name  # the kubelet's labels are left alone
    assert node.spec is not None and any(
        (t.key, t.value, t.effect) == ("gpufrac.io/managed", "true", "NoSchedule")
        for t in node.spec.taints or []
    )
    ready = condition(node, READY)
    assert (ready.status, ready.reason) == ("True", "GpuFractioningReady")
    assert "2 GPU(s) (H100-80GB)" in (ready.message or "")
    assert condition(node, "Ready").reason == "KubeletReady"  # the kubelet's condition is left alone


async def test_a_gpu_that_goes_away_is_withdrawn(client: AsyncClient, node_name: str) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("3xL4-24GB"))
    pub = publisher(client, node_name, backend, interval_s=0.05)
    task = asyncio.create_task(pub.run())
    try:
        await eventually(lambda: pub.publishes >= 1)
        gone = simulated_uuid(node_name, 1)
        backend.remove_gpu(gone)  # taken out
        backend.set_lost(2)  # fell off the bus
        await eventually(lambda: pub.published is not None and len(pub.published.gpus) == 1)

        node = await client.get(Node, node_name)
        assert [g["uuid"] for g in published_gpus(node)] == [simulated_uuid(node_name, 0)]
        assert node.metadata is not None and node.metadata.labels is not None
        assert node.metadata.labels["gpufrac.io/gpu-count"] == "1"
        ready = condition(node, READY)
        assert ready.status == "True"
        assert f"({gone}) withdrawn: it is gone" in (ready.message or "")
        assert "GPU 2" in (ready.message or "") and "fell off the bus" in (ready.message or "")

        backend.remove_gpu(0)
        backend.remove_gpu(2)
        await eventually(lambda: pub.published is not None and not pub.published.gpus)
        node = await client.get(Node, node_name)
        assert published_gpus(node) == []
        assert (condition(node, READY).status, condition(node, READY).reason) == ("False", "NoUsableGpus")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_nri_disconnected_and_agent_stopped_make_the_node_not_ready(
    client: AsyncClient, node_name: str
) -> None:
    connected = False
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    pub = publisher(client, node_name, backend, nri_connected=lambda: connected)
    await pub.publish_once()
    ready = condition(await client.get(Node, node_name), READY)
    assert (ready.status, ready.reason) == ("False", "NriPluginNotConnected")
    assert "NRI" in (ready.message or "")

    connected = True
    await pub.publish_once()
    ready = condition(await client.get(Node, node_name), READY)
    assert ready.status == "True"

    await pub.mark_stopped()
    ready = condition(await client.get(Node, node_name), READY)
    assert (ready.status, ready.reason) == ("False", "NodeAgentStopped")
    assert published_gpus(await client.get(Node, node_name)) != []  # the GPUs are still there


async def eventually(check, *, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
