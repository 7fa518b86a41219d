"""Usable GPU memory (KAI Scheduler #2212) end to end on a real API server: the node agent's publisher
writes it, the scheduler's reading of the Node (``node_spec``) packs into it and resolves portions against
it (the binder's rendering). GPUs SIMULATED (the driver's reserve as NVML memory info v2 would report it)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, NodeCondition, NodeStatus, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from gpufrac.contract import keys
from gpufrac.node.inventory.publish import InventoryPublisher, desired_state
from gpufrac.node.inventory.reserve import MemoryReserveSettings
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag
from gpufrac.node.mps.mode import capability_for
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.model import ModePolicy
from gpufrac.scheduler.binder import binding_annotations
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import gpu_request, node_spec, pending_pod
from gpufrac.scheduler.placement_engine import build_engine

L4_TOTAL = 23034
DRIVER_RESERVED = 450  # what the simulated driver reports reserved (a T4 reserves about this much)


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await akube.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    await akube.patch(
        Node.Status,
        name,
        {
            "status": NodeStatus(
                conditions=[NodeCondition(type="Ready", status="True")],
                allocatable={"cpu": "8", "memory": "32Gi", "pods": "110"},
            ).to_dict()
        },
    )
    # The API server's admission taints a new Node not-ready until a node lifecycle controller clears it;
    # none runs here, so the test clears it as that controller would for a Ready node.
    await akube.patch(Node, name, {"spec": {"taints": None}})
    yield name
    await akube.delete(Node, name)


def pod(name: str, annotations: dict[str, str]) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace="default", uid=f"uid-{name}", annotations=annotations),
        spec=PodSpec(containers=[Container(name="app", image="x")]),
    )


async def test_the_scheduler_packs_and_resolves_portions_against_usable_memory(
    akube: AsyncClient, node_name: str
) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    backend.set_reserved(0, DRIVER_RESERVED)
    reserve = MemoryReserveSettings(mps_server_mib=500)
    await InventoryPublisher(
        client=akube,
        node_name=node_name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        taint=False,
        memory_reserve=reserve,
        mps_reserve=True,  # the agent supervises MPS on this node: the server's share is held back too
    ).publish_once()

    node = await akube.get(Node, node_name)
    usable = L4_TOTAL - DRIVER_RESERVED - 500
    (published,) = json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
    assert (published["mib"], published["total_mib"], published["reserved_mib"]) == (usable, L4_TOTAL, 950)
    spec = node_spec(node)
    assert [g.memory_mib for g in spec.gpus] == [usable]

    engine = build_engine(SchedulerConfig())
    engine.add_node(spec)

    def place(p: Pod, arrival: int):  # type: ignore[no-untyped-def]
        request = gpu_request(p)
        pending = pending_pod(
            p, gpu=request, arrival=arrival, default_queue="default", mode_policy=ModePolicy.REQUIRED
        )
        (decision,) = engine.schedule([pending])
        return request, decision

    # A request of the whole framebuffer would be killed within its request: it is not placed.
    _, whole = place(pod("whole", {"gpu-memory": str(L4_TOTAL)}), 0)
    assert isinstance(whole, Unschedulable) and "GPU memory" in whole.message, whole
    # A portion is resolved on what is usable, not on the total.
    request, half = place(pod("half", {"gpu-fraction": "0.5"}), 1)
    assert isinstance(half, Placement)
    rendered = binding_annotations(request, half, device_style="uuid")
    assert rendered[keys.memory_request_key("app")] == f"{usable // 2}Mi"


def test_a_driver_that_does_not_say_gets_the_configured_reserve() -> None:
    inventory = SimulatedInventory(node_name="n", spec=parse_flag("1xL4-24GB")).read()
    silent = replace(inventory, gpus=tuple(replace(g, reserved_mib=None) for g in inventory.gpus))
    (gpu,) = desired_state(inventory=silent, reserve=MemoryReserveSettings()).gpus
    assert gpu["reserved_mib"] == 692  # 3 % of 23034 MiB rounded up (over the 256 MiB minimum)
    assert gpu["mib"] == L4_TOTAL - 692
    (gpu,) = desired_state(inventory=inventory, reserve=MemoryReserveSettings()).gpus
    assert gpu["mib"] == L4_TOTAL  # the simulated driver reports no reserve unless told
