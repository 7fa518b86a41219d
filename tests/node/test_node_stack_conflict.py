"""Two GPU-fractioning node stacks on one node, on a real API server: detected, reported, refused.

NVIDIA's gpu-fractioning operator writes the ``gpu-fractioning.nvidia.com/Ready`` node condition for its
own daemons, with reasons of its own. Here a second writer sets that condition the way it does (a
strategic merge of the one condition through the status subresource, a reason gpufrac never writes);
the operator itself cannot run here. The scheduler's side is its real code: ``node_spec`` of the Node as
the API server returns it, and the placement engine's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import NodeCondition, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.kube.events import WARNING, EventRecorder, ObjectRef
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag
from gpufrac.node.mps.mode import capability_for
from gpufrac.placement.decision import Placement, Reason, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import PendingPod, Toleration, TolerationOperator
from gpufrac.scheduler.objects import node_spec

#: A reason of NVIDIA's operator (its daemons' aggregate health); any reason outside gpufrac's is the sign.
OTHER_STACK_REASON = "AllDaemonsReady"


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def node_name(client: AsyncClient) -> AsyncIterator[str]:
    """A Node as a kubelet registers it: its labels, its resources, its own Ready condition."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await client.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    resources = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    await client.patch(
        Node.Status,
        name,
        {
            "status": NodeStatus(
                capacity=resources,
                allocatable=resources,
                conditions=[NodeCondition(type="Ready", status="True", reason="KubeletReady")],
            ).to_dict()
        },
    )
    yield name
    await client.delete(Node, name)


class StatusWrites:
    """The API client, counting the writes of the Node's status (the condition) that go through it."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self.count = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._client, name)

    async def patch(self, resource, *args, **kwargs):  # type: ignore[no-untyped-def]
        if resource is Node.Status:
            self.count += 1
        return await self._client.patch(resource, *args, **kwargs)


class CountedEvents:
    """The real Event recorder, counting what the agent emits through it."""

    def __init__(self, recorder: EventRecorder) -> None:
        self._recorder = recorder
        self.emitted = 0

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        self.emitted += 1
        self._recorder.emit(regarding=regarding, type=type, reason=reason, message=message)


async def node_events(client: AsyncClient, name: str) -> list[Event]:
    """The Events about Node ``name``, once the recorder has written one (Node Events live in default)."""
    for _ in range(200):
        events = [
            e async for e in client.list(Event, namespace="default", fields={"involvedObject.name": name})
        ]
        if events:
            return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"no Event about node {name} was written")


async def other_stack_writes(client: AsyncClient, name: str, *, reason: str, message: str) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": keys.NODE_READY_CONDITION,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    await client.patch(
        Node.Status, name, {"status": {"conditions": [condition]}}, patch_type=PatchType.STRATEGIC
    )


async def other_stack_leaves(client: AsyncClient, name: str) -> None:
    """Its uninstall: the condition it wrote is removed."""
    node = await client.get(Node, name)
    assert node.status is not None
    at = next(i for i, c in enumerate(node.status.conditions or []) if c.type == keys.NODE_READY_CONDITION)
    await client.patch(
        Node.Status,
        name,
        [{"op": "remove", "path": f"/status/conditions/{at}"}],
        patch_type=PatchType.JSON,
    )


def ready_condition(node: Node) -> NodeCondition:
    assert node.status is not None
    return next(c for c in node.status.conditions or [] if c.type == keys.NODE_READY_CONDITION)


def decide(node: Node) -> Placement | Unschedulable:
    """The scheduler's answer for a half-GPU pod with this one node in the cluster."""
    engine = Engine(policy="binpack")
    engine.add_node(node_spec(node))
    pod = PendingPod(
        namespace="ns",
        name="p",
        uid=f"uid-{uuid.uuid4().hex[:6]}",
        gpu=PodGpuRequest(
            (ContainerGpuRequest("main", GpuMemory(portion=0.5), None, ComputeMode.TIME_SLICING),)
        ),
        tolerations=(
            Toleration(key=keys.MANAGED_TAINT_KEY, operator=TolerationOperator.EXISTS),
            # The API server taints a new Node not-ready; no node lifecycle controller runs here to lift it.
            Toleration(key="node.kubernetes.io/not-ready", operator=TolerationOperator.EXISTS),
        ),
    )
    return engine.place(pod)


async def test_another_stack_writing_the_condition_is_reported_refused_and_not_fought(
    client: AsyncClient, node_name: str
) -> None:
    recorder = EventRecorder(client=client, component="gpufrac-node-agent", instance=node_name, workers=1)
    recording = asyncio.create_task(recorder.run())
    try:
        await conflict_reported_refused_and_not_fought(client, node_name, CountedEvents(recorder))
    finally:
        recording.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recording


async def conflict_reported_refused_and_not_fought(
    client: AsyncClient, node_name: str, events: CountedEvents
) -> None:
    writes = StatusWrites(client)
    pub = InventoryPublisher(
        client=writes,  # type: ignore[arg-type]
        node_name=node_name,
        backend=SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB")),
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        resync_s=0.0,  # every publish re-asserts the Node: the most the agent could ever write
        events=events,
    )
    await pub.publish_once()
    assert isinstance(decide(await client.get(Node, node_name)), Placement)

    other_message = "all gpu-fractioning daemons are running"
    await other_stack_writes(client, node_name, reason=OTHER_STACK_REASON, message=other_message)
    state = await pub.publish_once()

    # The agent reports the conflict: not ready, with a reason and a message naming what it found.
    assert (state.ready, state.reason) == (False, keys.NODE_REASON_CONFLICTING_STACK)
    assert OTHER_STACK_REASON in state.message
    node = await client.get(Node, node_name)
    assert node.metadata is not None and node.metadata.annotations is not None
    assert OTHER_STACK_REASON in node.metadata.annotations[keys.NODE_STACK_CONFLICT_ANNOTATION]
    [event] = await node_events(client, node_name)
    assert (event.involvedObject.kind, event.involvedObject.uid) == ("Node", node.metadata.uid)
    assert (event.type, event.reason) == (WARNING, "ConflictingNodeStack")
    assert OTHER_STACK_REASON in (event.message or "")

    # The scheduler refuses the node, and says why in the counted sentence.
    decision = decide(node)
    assert isinstance(decision, Unschedulable)
    assert decision.message == f"0/1 nodes are available: 1 {Reason.NODE_STACK_CONFLICT.message}."
    assert "1 node(s) run another GPU-fractioning node stack" in decision.message

    # It stops fighting: heartbeats go on (labels, inventory), the other stack's condition is not written
    # over, and the Event is not repeated; the annotation follows what the other stack says.
    written = writes.count
    for i in range(5):  # the other stack keeps writing, and what it says changes
        said = f"{other_message} ({i})"
        await other_stack_writes(client, node_name, reason=OTHER_STACK_REASON, message=said)
        await pub.publish_once()
    assert writes.count == written
    node = await client.get(Node, node_name)
    assert ready_condition(node).reason == OTHER_STACK_REASON
    assert events.emitted == 1
    assert node.metadata is not None and node.metadata.annotations is not None
    assert f"{other_message} (4)" in node.metadata.annotations[keys.NODE_STACK_CONFLICT_ANNOTATION]

    # The other stack is uninstalled: the agent writes its condition again and the node comes back.
    await other_stack_leaves(client, node_name)
    state = await pub.publish_once()
    assert (state.ready, state.reason) == (True, keys.NODE_REASON_READY)
    node = await client.get(Node, node_name)
    assert ready_condition(node).reason == keys.NODE_REASON_READY
    assert node.metadata is not None
    assert keys.NODE_STACK_CONFLICT_ANNOTATION not in (node.metadata.annotations or {})
    assert isinstance(decide(node), Placement)


async def test_the_conflict_clears_without_a_heartbeat_once_the_condition_is_gone(
    client: AsyncClient, node_name: str
) -> None:
    """With a resync of an hour the agent still looks each interval while in conflict."""
    pub = InventoryPublisher(
        client=client,
        node_name=node_name,
        backend=SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB")),
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        resync_s=3600.0,
    )
    await other_stack_writes(client, node_name, reason=OTHER_STACK_REASON, message="fractiond not ready")
    state = await pub.publish_once()  # an agent that starts on a node NVIDIA's operator already manages
    assert state.reason == keys.NODE_REASON_CONFLICTING_STACK
    assert ready_condition(await client.get(Node, node_name)).reason == OTHER_STACK_REASON

    await other_stack_leaves(client, node_name)
    state = await pub.publish_once()
    assert state.ready
    assert ready_condition(await client.get(Node, node_name)).status == "True"


async def test_a_heartbeat_the_agent_did_not_write_is_a_conflict(client: AsyncClient, node_name: str) -> None:
    """A second writer that uses gpufrac's own reason (a second gpufrac agent) is caught by its heartbeat."""
    pub = InventoryPublisher(
        client=client,
        node_name=node_name,
        backend=SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB")),
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        resync_s=0.0,
    )
    await pub.publish_once()
    await other_stack_writes(client, node_name, reason=keys.NODE_REASON_READY, message="someone else")
    state = await pub.publish_once()
    assert state.reason == keys.NODE_REASON_CONFLICTING_STACK
    assert "did not write" in state.message
    assert ready_condition(await client.get(Node, node_name)).message == "someone else"
