"""GPU faults on a real API server: a fatal XID or a GPU fallen off the bus (both SIMULATED, as NVML would
report them) withdraws the GPU from what the scheduler reads, its pods get an Event, and it comes back
once healthy. The publisher runs at its production interval (5 s) so the detection time printed is the
one a user sees (``-s`` shows it; docs/node-agent.md quotes it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, NodeCondition, NodeStatus, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod

from gpufrac.contract import keys
from gpufrac.kube.events import EventRecorder
from gpufrac.node.gpu_faults import REASON_FAULT, REASON_RECOVERED, GpuFaultNotifier
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, simulated_uuid
from gpufrac.node.mapping import AllocationRecord, MappingStore
from gpufrac.node.mps.mode import capability_for
from gpufrac.scheduler.objects import node_spec


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await akube.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    await akube.patch(
        Node.Status,
        name,
        {"status": NodeStatus(conditions=[NodeCondition(type="Ready", status="True")]).to_dict()},
    )
    yield name
    await akube.delete(Node, name)


async def offered(akube: AsyncClient, node: str) -> list[str]:
    """The GPU UUIDs the scheduler would place on (its own reading of the Node)."""
    return [g.uuid for g in node_spec(await akube.get(Node, node)).gpus]


async def until(check: Callable[[], object], *, timeout_s: float = 30.0) -> float:
    """Polls the async ``check`` until it is truthy; returns the seconds it took."""
    start = time.monotonic()
    while not await check():  # type: ignore[misc]
        assert time.monotonic() - start < timeout_s, "not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def events(akube: AsyncClient, namespace: str, name: str) -> list[tuple[str, str, str]]:
    return [
        (e.type, e.reason, e.message)
        async for e in akube.list(Event, namespace=namespace)
        if e.involvedObject.name == name
    ]


async def test_an_xid_or_a_lost_gpu_is_withdrawn_its_pods_are_told_and_it_comes_back(
    akube: AsyncClient, node_name: str, namespace: str, tmp_path: Path
) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("2xH100-80GB"))
    gpu0, gpu1 = simulated_uuid(node_name, 0), simulated_uuid(node_name, 1)
    store = MappingStore(directory=tmp_path / "mapping")
    for pod, device in (("on-gpu0", gpu0), ("on-gpu1", f"nvidia.com/gpu={gpu1}")):
        await akube.create(
            Pod(
                metadata=ObjectMeta(name=pod, namespace=namespace),
                spec=PodSpec(containers=[Container(name="app", image="x")], nodeName=node_name),
            )
        )
        store.put(
            AllocationRecord(
                container_id=f"{pod}-c".ljust(64, "0"),
                pod_namespace=namespace,
                pod_name=pod,
                pod_uid=f"uid-{pod}",
                container_name="app",
                devices=(device,),
                request_mib=1024,
                limit_mib=1024,
                mode="time-slicing",
                portion=None,
            )
        )
    recorder = EventRecorder(client=akube, component="gpufrac-node-agent", instance=node_name, workers=1)
    publisher = InventoryPublisher(
        client=akube,
        node_name=node_name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        taint=False,
        on_inventory=GpuFaultNotifier(node_name=node_name, store=store, recorder=recorder).observe,
    )  # interval_s: the production 5 s
    tasks = [asyncio.create_task(recorder.run()), asyncio.create_task(publisher.run())]
    try:
        await until(lambda: _eq(offered(akube, node_name), [gpu0, gpu1]))

        # An application's XID (13: graphics engine exception) is not the GPU's fault: nothing changes.
        backend.set_xid(0, 13)
        # A fatal XID (79: fell off the bus as the driver reports it; 48: double-bit ECC is the same).
        backend.set_xid(0, 48)
        xid_detected = await until(lambda: _eq(offered(akube, node_name), [gpu1]))

        async def says_withdrawn() -> bool:
            # The condition is a write of its own after the annotation's: under load it comes a moment later.
            node = await akube.get(Node, node_name)
            ready = next(c for c in node.status.conditions if c.type == keys.NODE_READY_CONDITION)
            return f"GPU 0 ({gpu0}) withdrawn: XID 48" in (ready.message or "")

        await until(says_withdrawn)
        await until(lambda: events(akube, namespace, "on-gpu0"))
        ((kind, reason, message),) = await events(akube, namespace, "on-gpu0")
        assert (
            (kind, reason) == ("Warning", REASON_FAULT) and "XID 48" in message and "container app" in message
        )
        assert await events(akube, namespace, "on-gpu1") == []  # its GPU is fine

        # The GPU is reset: offered again, and the Node says so.
        backend.reset_gpu(0)
        await until(lambda: _eq(offered(akube, node_name), [gpu0, gpu1]))
        await until(lambda: _has(events(akube, "default", node_name), REASON_RECOVERED))

        # GPU 1 falls off the bus: NVML answers GPU_IS_LOST for it.
        backend.set_lost(1)
        lost_detected = await until(lambda: _eq(offered(akube, node_name), [gpu0]))
        await until(lambda: events(akube, namespace, "on-gpu1"))
        ((_, reason, message),) = await events(akube, namespace, "on-gpu1")
        assert reason == REASON_FAULT and "fell off the bus" in message  # matched through its CDI name
        backend.set_lost(1, lost=False)
        await until(lambda: _eq(offered(akube, node_name), [gpu0, gpu1]))
        print(
            f"\ndetection (publish interval 5 s): XID {xid_detected:.2f}s, off the bus {lost_detected:.2f}s"
        )
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        store.close()


async def _eq(got, expected) -> bool:  # type: ignore[no-untyped-def]
    return await got == expected


async def _has(got, reason: str) -> bool:  # type: ignore[no-untyped-def]
    return any(r == reason for _, r, _ in await got)
