"""The DRA ResourceSlice on a real API server: it says what the inventory says, and follows it.

The session's control plane runs with the embedded cluster's feature gates (``local.featuregates``:
``DRAConsumableCapacity`` on); one test starts a control plane without them, as a 1.34 cluster is by
default, to show that the agent notices the dropped ``allowMultipleAllocations`` instead of claiming
to share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.node.dra.slices import ResourceSlicePublisher, device_name, mib_quantity, slice_name
from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, simulated_uuid
from gpufrac.node.mps.mode import capability_for

DRIVER = keys.DRA_DRIVER_NAME


async def make_node(client: AsyncClient) -> str:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await client.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    return name


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = await make_node(akube)
    yield name
    await akube.delete(Node, name)


class Mps:
    """Whether the (simulated) MPS daemon serves: the capability's input the test flips."""

    running = True


def publisher(
    client: AsyncClient, name: str, backend: SimulatedInventory, mps: Mps | None = None, **kwargs: Any
) -> InventoryPublisher:
    state = mps or Mps()
    return InventoryPublisher(
        client=client,
        node_name=name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=state.running),
        slices=ResourceSlicePublisher(client=client, node_name=name),
        **kwargs,
    )


async def stored(client: AsyncClient, node: str) -> dict[str, Any]:
    obj = await client.get(ResourceSlice, slice_name(node))
    return obj.to_dict()


async def eventually(check: Callable[[], Any], *, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


async def test_the_slice_publishes_each_usable_gpu_as_a_shareable_device(
    akube: AsyncClient, node_name: str
) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("2xH100-80GB"))
    # Every poll is a re-sync: the stored slice is read back and compared each time.
    pub = publisher(akube, node_name, backend, resync_s=0.0)
    await pub.publish_once()

    obj = await stored(akube, node_name)
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRIVER, node_name)
    assert spec["pool"] == {"name": node_name, "generation": 1, "resourceSliceCount": 1}
    node = await akube.get(Node, node_name)
    assert node.metadata is not None and node.metadata.annotations is not None
    annotated = json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
    # The slice and the Node's inventory annotation say the same GPUs with the same usable MiB.
    assert [
        (d["attributes"]["uuid"]["string"], d["capacity"]["memory"]["value"]) for d in spec["devices"]
    ] == [(g["uuid"], f"{g['mib']}Mi") for g in annotated]
    first = spec["devices"][0]
    assert first["name"] == simulated_uuid(node_name, 0).lower()
    assert first["allowMultipleAllocations"] is True  # kept: the gate is on at this server
    assert first["capacity"]["memory"]["requestPolicy"] == {
        "default": "81559Mi",
        "validRange": {"min": "1Mi", "step": "1Mi"},
    }
    # Percent of the SMs: sm-sharing portions sum to at most 100; a claim naming none consumes nothing.
    assert first["capacity"]["compute"] == {
        "value": "100",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }
    assert first["attributes"] == {
        "model": {"string": "H100-80GB"},
        "uuid": {"string": simulated_uuid(node_name, 0)},
        "index": {"int": 0},
        "driverMajor": {"int": 615},
        "timeSlicing": {"bool": True},
        "smSharing": {"bool": True},
    }
    owner = obj["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", node_name, node.metadata.uid)
    assert pub._slices is not None and pub._slices.consumable_capacity is True

    # Nothing changed: the next polls write nothing, though they compare with what the server stored
    # (the pool generation stays 1, so the scheduler's view is not invalidated for nothing).
    await pub.publish_once()
    await pub.publish_once()
    assert (await stored(akube, node_name))["spec"]["pool"]["generation"] == 1
    assert pub._slices.writes == 1


async def test_the_slice_follows_the_inventory_and_the_capability(akube: AsyncClient, node_name: str) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("3xL4-24GB"))
    mps = Mps()
    pub = publisher(akube, node_name, backend, mps, interval_s=0.05)
    task = asyncio.create_task(pub.run())

    async def devices() -> list[dict[str, Any]]:
        return list((await stored(akube, node_name))["spec"].get("devices") or [])

    try:

        async def three() -> bool:
            with contextlib.suppress(Exception):
                return len(await devices()) == 3
            return False

        await eventually(three)
        gone = simulated_uuid(node_name, 1)
        backend.remove_gpu(gone)  # fell off the bus
        backend.set_mig(2)  # an operator enabled MIG on another

        async def one() -> bool:
            return [d["attributes"]["uuid"]["string"] for d in await devices()] == [
                simulated_uuid(node_name, 0)
            ]

        await eventually(one)
        assert (await stored(akube, node_name))["spec"]["pool"]["generation"] >= 2

        mps.running = False  # the MPS daemon stopped: sm-sharing can no longer be enforced
        pub.poke()

        async def no_sm_sharing() -> bool:
            return [d["attributes"]["smSharing"]["bool"] for d in await devices()] == [False]

        await eventually(no_sm_sharing)
        assert (await devices())[0]["attributes"]["timeSlicing"] == {"bool": True}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_deleted_slice_is_recreated_at_the_resync(akube: AsyncClient, node_name: str) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xA100-40GB"))
    pub = publisher(akube, node_name, backend, interval_s=0.05, resync_s=0.2)
    await pub.publish_once()
    await akube.delete(ResourceSlice, slice_name(node_name))
    task = asyncio.create_task(pub.run())
    try:

        async def back() -> bool:
            with contextlib.suppress(Exception):
                return len((await stored(akube, node_name))["spec"]["devices"]) == 1
            return False

        await eventually(back)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_without_the_gate_the_agent_reports_that_gpus_cannot_be_shared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An API server without consumable capacity: 1.34/1.35 as they come (alpha, off), or a newer one
    # with the beta gate turned off.
    with ControlPlane(feature_gates={"DRAConsumableCapacity": False}) as cp:
        client = cp.async_client()
        try:
            name = await make_node(client)
            backend = SimulatedInventory(node_name=name, spec=parse_flag("1xH100-80GB"))
            pub = publisher(client, name, backend, resync_s=0.0)
            await pub.publish_once()
            spec = (await stored(client, name))["spec"]
            assert "allowMultipleAllocations" not in spec["devices"][0]
            assert pub._slices is not None and pub._slices.consumable_capacity is False
            assert "DRAConsumableCapacity" in caplog.text
            # Heartbeats there (every poll is one here) do not rewrite the slice the server keeps
            # without the gated fields.
            await pub.publish_once()
            await pub.publish_once()
            assert (await stored(client, name))["spec"]["pool"]["generation"] == 1
        finally:
            await client.close()


def test_device_names_come_from_the_uuid_and_are_dns_labels() -> None:
    gpu = GpuInfo(uuid="GPU-8F1C2D3E-0000-1111-2222-333344445555", index=3, minor=3, model="H100", mib=81559)
    assert device_name(gpu) == "gpu-8f1c2d3e-0000-1111-2222-333344445555"
    odd = GpuInfo(uuid="MIG/GPU_x", index=1, minor=1, model="H100", mib=1)
    assert device_name(odd) == "mig-gpu-x"


def test_slice_names_stay_dns_subdomains_for_long_node_names() -> None:
    long = "n" * 250
    name = slice_name(long)
    assert len(name) <= 253 and name.endswith(DRIVER)
    assert slice_name(long) != slice_name("n" * 249 + "m")


def test_mib_are_written_in_the_servers_canonical_form() -> None:
    assert [mib_quantity(m) for m in (81559, 24576, 1024 * 1024, 1)] == ["81559Mi", "24Gi", "1Ti", "1Mi"]
