"""Simulated GPU nodes: Node objects that look to the scheduler exactly like node-agent-published ones.

The embedded cluster has no kubelets and no GPUs. What the scheduler reads from a GPU node is all on
the Node object: the managed label and taint, the GPU inventory annotation (uuid, index, model, MiB per
physical GPU), a Ready condition, the node agent's readiness condition and allocatable cpu, memory and
pods. This module writes those, so the scheduler, the demo and the benchmark drive the real API server
with nodes the product cannot tell from real ones. (Later a node agent with a simulated GPU backend
publishes the same fields itself.)

GPU UUIDs are derived from the node name and index, so a re-created node gets the same UUIDs, as a
real machine does. A shape's ``mig`` layouts publish GPUs in mode mig with their slices (docs/mig.md,
"Inventory"), MIG UUIDs derived as the simulated node agent derives them; ``mig_layout`` gives the
inventory entry of one GPU laid out anew, what a test publishes as the agent's answer to a layout change.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from lightkube import AsyncClient, Client
from lightkube.models.core_v1 import NodeCondition, NodeSpec, NodeStatus, Taint
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, api_errors
from gpufrac.mig.geometry import Slice, check_layout
from gpufrac.mig.profiles import mig_model
from gpufrac.node import labels as node_labels
from gpufrac.node.inventory.simulated import MODEL_MIB, simulated_mig_uuid, simulated_uuid
from gpufrac.node.mps.mode import DriverVersion, capability_for

#: Framebuffer MiB per model: the simulated node agent's table, so both describe the same GPUs.
GPU_MODELS: dict[str, int] = MODEL_MIB

_CAPABILITY = capability_for(driver=DriverVersion.parse("615.20.01"), mps_running=True)


@dataclass(frozen=True, slots=True)
class NodeShape:
    """What every simulated node of a pool has."""

    gpus: int = 8
    model: str = "H100-80GB"
    gpu_mib: int | None = None
    cpu: str = "128"
    memory: str = "1024Gi"
    pods: int = 250
    #: MIG layouts by GPU index (``("3g.40gb@0", "3g.40gb@4")``): those GPUs are in mode mig.
    mig: tuple[tuple[int, tuple[str, ...]], ...] = ()

    @property
    def mib(self) -> int:
        if self.gpu_mib is not None:
            return self.gpu_mib
        try:
            return GPU_MODELS[self.model]
        except KeyError:
            known = ", ".join(GPU_MODELS)
            raise ValueError(f"unknown GPU model {self.model!r}: give gpu_mib or one of {known}") from None


def gpu_uuid(node: str, index: int) -> str:
    """The UUID a simulated node agent gives GPU ``index`` of ``node`` (stable across re-creation)."""
    return simulated_uuid(node, index)


def inventory(node: str, shape: NodeShape) -> list[dict[str, object]]:
    """The ``gpufrac.io/gpus`` annotation's content for ``node``."""
    layouts = dict(shape.mig)
    out: list[dict[str, object]] = []
    for i in range(shape.gpus):
        entry: dict[str, object] = {
            "uuid": gpu_uuid(node, i),
            "index": i,
            "model": shape.model,
            "mib": shape.mib,
        }
        if i in layouts:
            entry = mig_layout(entry, layouts[i])
        out.append(entry)
    return out


def mig_layout(entry: dict[str, object], layout: tuple[str, ...] | None) -> dict[str, object]:
    """GPU ``entry`` of an inventory in mode mig with the slices ``layout`` names (``3g.40gb@0``), or back
    in mode fractions with ``None``; raises ``MigLayoutError`` for a layout the model cannot hold."""
    base = {k: v for k, v in entry.items() if k not in ("mode", "mig")}
    if layout is None:
        return {**base, "mode": "fractions"}
    model = mig_model(str(entry["model"]))
    if model is None:
        raise ValueError(f"GPU model {entry['model']!r} has no MIG profiles gpufrac knows")
    slices = [Slice.parse(text) for text in layout]
    check_layout(model, slices)
    published = []
    for s in sorted(slices):
        profile = model.profile(s.profile)
        assert profile is not None
        uuid = simulated_mig_uuid(str(entry["uuid"]), s)
        published.append({"profile": s.profile, "start": s.start, "uuid": uuid, "mib": profile.memory_mib})
    return {**base, "mode": "mig", "mig": sorted(published, key=lambda x: int(x["start"]))}


def sim_node(
    *,
    name: str,
    shape: NodeShape = NodeShape(),
    labels: dict[str, str] | None = None,
    agent_published: bool = False,
) -> Node:
    """A managed, Ready GPU node object (not yet created).

    With ``agent_published`` it is the Node as a kubelet registers it (Ready, allocatable, the managed
    taint): the GPU inventory, the agent's labels and its readiness condition are left for a running
    node agent to publish.
    """
    now = datetime.now(UTC)
    resources = {"cpu": shape.cpu, "memory": shape.memory, "pods": str(shape.pods)}
    node_labels_: dict[str, str] = {
        keys.MANAGED_LABEL: "true",
        keys.HOSTNAME_LABEL: name,
        "kubernetes.io/os": "linux",
    }
    annotations: dict[str, str] = {}
    conditions = [
        NodeCondition(
            type="Ready",
            status="True",
            reason="SimulatedNode",
            message="simulated GPU node",
            lastHeartbeatTime=now,
            lastTransitionTime=now,
        )
    ]
    if not agent_published:
        node_labels_ |= {
            node_labels.GPU_MODEL_LABEL: shape.model,
            node_labels.GPU_COUNT_LABEL: str(shape.gpus),
            node_labels.DRIVER_MAJOR_LABEL: "615",
            # What a node agent on an r615+ driver with MPS serving advertises.
            **_CAPABILITY.labels(),
        }
        annotations[keys.NODE_GPUS_ANNOTATION] = json.dumps(inventory(name, shape), separators=(",", ":"))
        conditions.append(
            NodeCondition(
                type=keys.NODE_READY_CONDITION,
                status="True",
                reason="SimulatedNode",
                message="simulated node agent",
                lastHeartbeatTime=now,
                lastTransitionTime=now,
            )
        )
    return Node(
        metadata=ObjectMeta(name=name, labels={**node_labels_, **(labels or {})}, annotations=annotations),
        spec=NodeSpec(
            taints=[
                Taint(
                    key=keys.MANAGED_TAINT_KEY,
                    value=keys.MANAGED_TAINT_VALUE,
                    effect=keys.MANAGED_TAINT_EFFECT,
                )
            ]
        ),
        status=NodeStatus(capacity=resources, allocatable=resources, conditions=conditions),
    )


def _settle(wanted: Node, created: Node) -> tuple[dict[str, object] | None, dict[str, object] | None]:
    """The patches that make a just-created node what ``wanted`` says, as a node controller would.

    The API server's NodeTaint admission adds ``node.kubernetes.io/not-ready:NoSchedule`` to every new
    Node, and no node lifecycle controller runs in the embedded cluster to take it off once the node is
    Ready; the status may also be dropped on create. Returns (status patch, taints patch), None for none.
    """
    status = None
    if not (created.status and created.status.conditions):
        status = {"status": wanted.status.to_dict()}
    have = [(t.key, t.value, t.effect) for t in (created.spec.taints if created.spec else None) or []]
    want = [(t.key, t.value, t.effect) for t in wanted.spec.taints or []]
    taints = None if have == want else {"spec": {"taints": [t.to_dict() for t in wanted.spec.taints or []]}}
    return status, taints


def node_names(count: int, *, prefix: str = "gpu-node-") -> list[str]:
    width = max(3, len(str(count - 1)))
    return [f"{prefix}{i:0{width}d}" for i in range(count)]


async def create_sim_nodes(
    client: AsyncClient,
    *,
    count: int,
    shape: NodeShape = NodeShape(),
    prefix: str = "gpu-node-",
    labels: dict[str, str] | None = None,
    zones: int = 0,
    concurrency: int = 16,
) -> list[str]:
    """Create ``count`` simulated nodes (existing ones are left as they are); returns their names.

    With ``zones`` the i-th node is in zone ``zone-<i mod zones>`` (the well-known zone label), for
    workloads that spread over zones.
    """
    names = node_names(count, prefix=prefix)
    gate = asyncio.Semaphore(concurrency)

    async def create(index: int, name: str) -> None:
        zone = {keys.ZONE_LABEL: f"zone-{index % zones}"} if zones else {}
        async with gate:
            node = sim_node(name=name, shape=shape, labels={**(labels or {}), **zone})
            try:
                with api_errors():
                    created = await client.create(node)
            except Conflict as error:
                if error.already_exists:
                    return
                raise
            status_patch, taints_patch = _settle(node, created)
            with api_errors():
                if status_patch:
                    await client.patch(Node.Status, name, status_patch, patch_type=PatchType.MERGE)
                if taints_patch:
                    await client.patch(Node, name, taints_patch, patch_type=PatchType.MERGE)

    await asyncio.gather(*(create(i, name) for i, name in enumerate(names)))
    return names


def create_sim_nodes_sync(
    client: Client,
    *,
    count: int,
    shape: NodeShape = NodeShape(),
    prefix: str = "gpu-node-",
    labels: dict[str, str] | None = None,
) -> list[str]:
    """``create_sim_nodes`` for synchronous callers (``gpufrac up``/``demo``)."""
    names = node_names(count, prefix=prefix)
    for name in names:
        node = sim_node(name=name, shape=shape, labels=labels)
        try:
            with api_errors():
                created = client.create(node)
        except Conflict as error:
            if error.already_exists:
                continue
            raise
        status_patch, taints_patch = _settle(node, created)
        with api_errors():
            if status_patch:
                client.patch(Node.Status, name, status_patch, patch_type=PatchType.MERGE)
            if taints_patch:
                client.patch(Node, name, taints_patch, patch_type=PatchType.MERGE)
    return names
