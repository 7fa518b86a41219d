"""Kubernetes objects -> the engine's plain values, and bound pods -> the placements they hold.

The engine sees no Kubernetes object (it is the simulator's engine too), so this module is where a Node
becomes a ``NodeSpec`` and a Pod a ``PendingPod``, with Kubernetes' own arithmetic: a pod's host request
is the larger of the sum of its containers and its largest init container, plus overhead; a node is
Ready only when both the kubelet's condition and the node agent's are True (a node whose agent is not
running cannot enforce a fraction, so it must not get one), and the agent's condition must also keep
being re-written (its heartbeat; the service decides its expiry).

The GPU request itself is parsed by the contract and nowhere else. A bound pod's placement is read with
``contract.render.read_binding``, the reader the node agent enforces with: the devices and MiB the binder
wrote, never resolved again from a GPU's size, so the scheduler books after a restart exactly what the
node enforces, and a binding the node refuses books no GPU (its containers cannot start).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, ClassVar

import msgspec
from lightkube.core.resource import ApiInfo, GlobalResource
from lightkube.resources.core_v1 import Node, Pod
from lightkube.utils.quantity import parse_quantity

from gpufrac.contract import keys
from gpufrac.contract.gpu_operator import driver_upgrade_state
from gpufrac.contract.parse import container_specs, parse_pod
from gpufrac.contract.render import BoundContainer, read_binding
from gpufrac.contract.request import ComputeMode, PodGpuRequest
from gpufrac.mig.geometry import MigLayoutError, Slice, check_layout
from gpufrac.mig.profiles import mig_model
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.model import (
    BOTH_MODES,
    GpuDevice,
    GpuMode,
    MigSlice,
    ModePolicy,
    NodeSelectorTerm,
    NodeSpec,
    PendingPod,
    Taint,
    TaintEffect,
    Toleration,
    TolerationOperator,
)
from gpufrac.scheduler.pod_fields import (
    and_terms,
    node_extras,
    node_resources,
    node_selector_term,
    pod_constraints,
)

log = logging.getLogger(__name__)


class InvalidInventory(ValueError):
    """A managed node's ``gpufrac.io/gpus`` annotation cannot be read."""


# -- nodes ------------------------------------------------------------------------------------------------


class _TopologyMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    namespace: str | None = None
    resourceVersion: str | None = None
    labels: dict[str, str] | None = None


class _TopologyTaint(msgspec.Struct, omit_defaults=True):
    key: str = ""
    value: str | None = None
    effect: str = ""


class _TopologySpec(msgspec.Struct, omit_defaults=True):
    taints: list[_TopologyTaint] | None = None


class NodeTopology(GlobalResource, msgspec.Struct, omit_defaults=True):
    """A Node read for its topology alone: name, labels and taints (the ``nodes`` API, decoded narrowly).

    The scheduler watches every node this way to know the nodes it does not manage as topology domains
    (kube-scheduler counts them all). A full Node carries its status (conditions, addresses, the list of
    its images: kilobytes per node); decoding into this type skips all of it as the JSON is read, so a
    cluster of thousands of nodes outside gpufrac's costs little memory to watch.
    """

    _api_info: ClassVar[ApiInfo] = Node._api_info
    metadata: _TopologyMeta = msgspec.field(default_factory=_TopologyMeta)
    spec: _TopologySpec | None = None


def _taints(raw: Iterable[Any]) -> tuple[Taint, ...]:
    """The taints the engine knows (NoSchedule, PreferNoSchedule, NoExecute), from the API's."""
    return tuple(
        Taint(key=t.key, value=t.value or "", effect=TaintEffect(t.effect))
        for t in raw
        if t.effect in TaintEffect.__members__.values()
    )


def topology_node_spec(node: NodeTopology) -> NodeSpec:
    """The engine's view of a node the scheduler does not manage: a topology domain by its labels, with
    its taints (a spread constraint's ``nodeTaintsPolicy: Honor`` reads them); no resources and no
    GPUs, since nothing is placed there (``Engine.add_topology_node``)."""
    return NodeSpec(
        name=node.metadata.name,
        cpu_milli=0,
        memory_bytes=0,
        max_pods=0,
        labels=dict(node.metadata.labels or {}),
        taints=_taints((node.spec.taints if node.spec else None) or ()),
    )


def node_inventory(node: Node) -> tuple[GpuDevice, ...]:
    """The node's physical GPUs from ``gpufrac.io/gpus``: a JSON list of {uuid, index, model, mib} and,
    per GPU, its ``mode`` (fractions, mig or whole; absent: fractions, what older agents wrote) and for
    mode mig its slices, ``mig: [{profile, start, uuid, mib}]`` (docs/mig.md, "Inventory")."""
    raw = (node.metadata.annotations or {}).get(keys.NODE_GPUS_ANNOTATION)
    if raw is None:
        return ()
    where = f"{keys.NODE_GPUS_ANNOTATION} of node {node.metadata.name}"
    try:
        entries = json.loads(raw)
        gpus = tuple(_gpu_entry(e, where) for e in entries)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        if isinstance(error, InvalidInventory):
            raise
        raise InvalidInventory(f"{where}: {error}") from error
    if any(g.memory_mib <= 0 for g in gpus) or len({g.uuid for g in gpus}) != len(gpus):
        raise InvalidInventory(f"{where}: GPUs need unique UUIDs and a positive MiB")
    slices = [s.uuid for g in gpus for s in g.mig]
    if len(set(slices)) != len(slices) or set(slices) & {g.uuid for g in gpus}:
        raise InvalidInventory(f"{where}: MIG devices need UUIDs of their own, unique on the node")
    return tuple(sorted(gpus, key=lambda g: g.index))


def _gpu_entry(e: Mapping[str, Any], where: str) -> GpuDevice:
    """One GPU of the inventory; ``InvalidInventory`` names the GPU, the key, the value and the rule."""
    uuid = str(e["uuid"])
    raw_mode = e.get("mode", GpuMode.FRACTIONS.value)
    modes = ", ".join(m.value for m in GpuMode)
    if raw_mode not in GpuMode.__members__.values():
        raise InvalidInventory(f"{where}: GPU {uuid} has mode {raw_mode!r}; a mode is one of {modes}")
    mode = GpuMode(raw_mode)
    raw_slices = e.get("mig") or []
    if raw_slices and mode is not GpuMode.MIG:
        raise InvalidInventory(
            f"{where}: GPU {uuid} in mode {mode.value} lists MIG slices; only mode mig has them"
        )
    slices = []
    for entry in raw_slices:
        try:
            s = MigSlice(str(entry["profile"]), int(entry["start"]), str(entry["uuid"]), int(entry["mib"]))
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidInventory(
                f"{where}: GPU {uuid} has MIG slice {entry!r}; a slice needs profile, start, uuid and a MiB"
                f" ({error})"
            ) from error
        if s.mib <= 0:
            raise InvalidInventory(
                f"{where}: GPU {uuid} has MIG slice {s} of {s.mib} MiB; it must be positive"
            )
        slices.append(s)
    model = str(e.get("model", ""))
    table = mig_model(model)
    if slices and table is not None:
        try:
            check_layout(table, [Slice(s.profile, s.start) for s in slices])
        except MigLayoutError as error:
            raise InvalidInventory(f"{where}: GPU {uuid}: {error}") from error
    return GpuDevice(
        uuid=uuid,
        index=int(e["index"]),
        memory_mib=int(e["mib"]),
        model=model,
        mode=mode,
        mig=tuple(sorted(slices, key=lambda s: s.start)),
    )


def device_uuids(spec: NodeSpec) -> set[str]:
    """Every device UUID a pod may hold on the node: its GPUs' and their MIG slices'."""
    return {g.uuid for g in spec.gpus} | {s.uuid for g in spec.gpus for s in g.mig}


def _condition_true(node: Node, kind: str) -> bool:
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == kind and c.status == "True" for c in conditions)


def agent_heartbeat(node: Node) -> datetime | None:
    """``lastHeartbeatTime`` of the node agent's Ready condition (None when there is none)."""
    for c in (node.status.conditions if node.status else None) or []:
        if c.type == keys.NODE_READY_CONDITION and c.lastHeartbeatTime is not None:
            stamp = c.lastHeartbeatTime
            return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)
    return None


def compute_modes(labels: Mapping[str, str]) -> frozenset[ComputeMode]:
    """The compute modes the node says it can enforce (both, when it says nothing)."""
    said = {m: labels.get(keys.COMPUTE_MODE_LABEL_PREFIX + m.value) for m in ComputeMode}
    if all(v is None for v in said.values()):
        return BOTH_MODES
    return frozenset(m for m, v in said.items() if v == "true")


def _milli(value: Decimal | None) -> int:
    return 0 if value is None else math.ceil(value * 1000)


def _whole(value: Decimal | None) -> int:
    return 0 if value is None else math.ceil(value)


def node_spec(node: Node, *, agent_heartbeat_expired: bool = False) -> NodeSpec:
    """The engine's view of a node; a node with an unreadable inventory has no GPUs (and is logged).

    Whether the agent's heartbeat expired is a matter of time, which the caller decides
    (``gpufrac.kube.heartbeat``).
    """
    meta, spec, status = node.metadata, node.spec, node.status
    allocatable: Mapping[str, str] = (status.allocatable if status else None) or {}
    try:
        gpus = node_inventory(node)
    except InvalidInventory as error:
        log.warning("%s; the node gets no GPU pods until it is fixed", error)
        gpus = ()
    labels = dict(meta.labels or {})
    model = gpus[0].model if gpus else labels.get(keys.GPU_MODEL_LABEL, "")
    if model and keys.GPU_MODEL_LABEL not in labels:
        labels[keys.GPU_MODEL_LABEL] = model
    taints = _taints((spec.taints if spec else None) or ())
    extended, ephemeral = node_resources(allocatable)
    return NodeSpec(
        name=meta.name,
        cpu_milli=_milli(parse_quantity(allocatable.get("cpu"))),
        memory_bytes=_whole(parse_quantity(allocatable.get("memory"))),
        max_pods=_whole(parse_quantity(allocatable.get("pods"))) if "pods" in allocatable else 110,
        labels=labels,
        taints=taints,
        # A driver upgrade in progress takes the node out at once, before its agent has reacted.
        ready=_condition_true(node, "Ready")
        and _condition_true(node, keys.NODE_READY_CONDITION)
        and driver_upgrade_state(meta.labels) is None,
        schedulable=not (spec and spec.unschedulable),
        gpu_model=model,
        gpus=gpus,
        compute_modes=compute_modes(labels),
        agent_heartbeat_expired=agent_heartbeat_expired,
        node_stack_conflict=keys.NODE_STACK_CONFLICT_ANNOTATION in (meta.annotations or {}),
        extended=extended,
        ephemeral_bytes=ephemeral,
    )


# -- pods -------------------------------------------------------------------------------------------------


#: Parsed GPU requests by what parsing reads: the annotations and each container's name and resources.
#: The replicas of one workload carry the same, so a burst parses each template once instead of each pod
#: (parsing was 0.3 ms of the scheduler's CPU a pod). Cleared when full.
_PARSED: dict[tuple[Any, ...], PodGpuRequest] = {}
_PARSED_MAX = 4096


def _resources_key(container: Any) -> tuple[Any, ...]:
    resources = container.resources
    if resources is None:
        return (container.name, None, None)
    limits, requests = resources.limits, resources.requests
    return (
        container.name,
        tuple(limits.items()) if limits else None,
        tuple(requests.items()) if requests else None,
    )


def gpu_request(pod: Pod) -> PodGpuRequest:
    """The pod's parsed GPU request; raises the contract's ``InvalidPodRequest``.

    The containers' ``nvidia.com/gpu`` counts are read by the contract's ``container_specs``, as the
    webhook and ``validate`` read them: a count that is not a whole number is refused, never rounded up to
    a whole GPU. A request already parsed from the same annotations and containers is answered from
    ``_PARSED`` (a ``PodGpuRequest`` is immutable); an invalid one is parsed again each time.
    """
    annotations = pod.metadata.annotations or {}
    spec_containers = pod.spec.containers if pod.spec else []
    try:
        key = (tuple(annotations.items()), tuple(_resources_key(c) for c in spec_containers))
        parsed = _PARSED.get(key)
    except TypeError:  # an unhashable value: not from the API, parse it as it is
        key, parsed = None, None
    if parsed is not None:
        return parsed
    containers = [
        {
            "name": c.name,
            "resources": {
                "limits": c.resources.limits if c.resources else None,
                "requests": c.resources.requests if c.resources else None,
            },
        }
        for c in spec_containers
    ]
    parsed = parse_pod(annotations, container_specs({"containers": containers}))
    if key is not None:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[key] = parsed
    return parsed


def host_request(pod: Pod) -> tuple[int, int]:
    """(cpu milli, memory bytes) the pod takes on its node, as kube-scheduler computes it."""
    spec = pod.spec
    if spec is None:
        return 0, 0

    def requests(container: object) -> tuple[int, int]:
        resources = container.resources  # type: ignore[attr-defined]
        req = (resources.requests if resources else None) or {}
        return _cpu_milli(req.get("cpu")), _memory_bytes(req.get("memory"))

    cpu = mem = 0
    for container in spec.containers:
        c, m = requests(container)
        cpu, mem = cpu + c, mem + m
    for container in spec.initContainers or []:
        c, m = requests(container)
        cpu, mem = max(cpu, c), max(mem, m)
    if spec.resources is not None and spec.resources.requests:
        # Pod-level resources (beta, on by default in 1.34): kube-scheduler fits the pod by them.
        level_cpu, level_mem = requests(spec)
        cpu, mem = level_cpu or cpu, level_mem or mem
    overhead = spec.overhead or {}
    cpu += _cpu_milli(overhead.get("cpu"))
    mem += _memory_bytes(overhead.get("memory"))
    return cpu, mem


@functools.lru_cache(maxsize=1024)
def _cpu_milli(quantity: str | None) -> int:
    """A CPU quantity in millicores, rounded up; remembered (a burst's pods repeat a few values)."""
    return _milli(parse_quantity(quantity))


@functools.lru_cache(maxsize=1024)
def _memory_bytes(quantity: str | None) -> int:
    """A memory quantity in bytes, rounded up; remembered like ``_cpu_milli``."""
    return _whole(parse_quantity(quantity))


def queue_label(pod: Pod) -> tuple[str, str] | None:
    """(label key, queue name) of the label that puts the pod in a queue (ours before KAI's); None
    when the pod names no queue."""
    labels = pod.metadata.labels or {}
    for key in (keys.QUEUE_LABEL, keys.KAI_QUEUE_LABEL):
        if labels.get(key):
            return key, labels[key]
    return None


#: The queue of a pod that names none: one name, or one per namespace (its default queue).
DefaultQueue = str | Callable[[str], str]


def pod_queue(pod: Pod, *, default: DefaultQueue) -> str:
    """The queue the pod names, or ``default`` (of its namespace) when it names none."""
    found = queue_label(pod)
    if found is not None:
        return found[1]
    return default if isinstance(default, str) else default(pod.metadata.namespace or "")


#: Managed nodes are tainted to keep OTHER schedulers off; pods of this scheduler tolerate the taint
#: implicitly (the webhook also adds the toleration, but a pod must not become unschedulable on our own
#: nodes because the webhook was bypassed or down).
_OWN_TAINT = Toleration(
    key=keys.MANAGED_TAINT_KEY,
    operator=TolerationOperator.EXISTS,
    effect=TaintEffect(keys.MANAGED_TAINT_EFFECT),
)


def _tolerations(pod: Pod) -> tuple[Toleration, ...]:
    out = [_OWN_TAINT]
    for t in (pod.spec.tolerations if pod.spec else None) or []:
        toleration = _toleration(t.key, t.operator, t.value, t.effect)
        if toleration is not None:
            out.append(toleration)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _toleration(
    key: str | None, operator: str | None, value: str | None, effect: str | None
) -> Toleration | None:
    """The engine's toleration (None for an effect it does not know); remembered, since every pod carries
    the same few (the API server's not-ready and unreachable ones)."""
    known = TaintEffect(effect) if effect in TaintEffect.__members__.values() else None
    if effect and known is None:
        return None
    kind = TolerationOperator.EXISTS if operator == "Exists" else TolerationOperator.EQUAL
    return Toleration(key=key or "", operator=kind, value=value or "", effect=known)


def _affinity(pod: Pod) -> tuple[NodeSelectorTerm, ...]:
    affinity = pod.spec.affinity if pod.spec else None
    required = (
        affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution
        if (affinity and affinity.nodeAffinity)
        else None
    )
    if required is None:
        return ()
    return tuple(node_selector_term(term) for term in required.nodeSelectorTerms)


def pending_pod(
    pod: Pod,
    *,
    gpu: PodGpuRequest,
    arrival: int,
    default_queue: DefaultQueue,
    mode_policy: ModePolicy,
    volume_terms: list[tuple[NodeSelectorTerm, ...]] | None = None,
) -> PendingPod:
    """The engine's view of ``pod``; ``volume_terms`` are the node affinities of its bound volumes
    (``pod_fields.volume_terms``), ANDed with the pod's own. Raises ``pod_fields.RefusedPod`` for a
    field that cannot be read."""
    cpu, mem = host_request(pod)
    meta = pod.metadata
    affinity = _affinity(pod)
    if volume_terms:
        affinity = and_terms(affinity, volume_terms)
    return PendingPod(
        namespace=meta.namespace,
        name=meta.name,
        uid=meta.uid,
        gpu=gpu,
        cpu_milli=cpu,
        memory_bytes=mem,
        node_selector=dict((pod.spec.nodeSelector if pod.spec else None) or {}),
        affinity=affinity,
        tolerations=_tolerations(pod),
        priority=(pod.spec.priority if pod.spec else None) or 0,
        queue=pod_queue(pod, default=default_queue),
        arrival=arrival,
        mode_policy=mode_policy,
        policy=(meta.annotations or {}).get(keys.PLACEMENT_POLICY_ANNOTATION) or None,
        labels=dict(meta.labels or {}),
        constraints=pod_constraints(pod),
        extras=node_extras(pod),
        nominated_node=(pod.status.nominatedNodeName if pod.status else None) or None,
        movable=movable(pod),
    )


def movable(pod: Pod) -> bool:
    """Whether consolidation may move the pod: it says ``gpufrac.io/movable: "true"`` and a controller
    owns it (an ownerReference with ``controller: true``), which recreates it once it is evicted. A
    bare pod is never moved, whatever it says: nothing would bring it back."""
    meta = pod.metadata
    if (meta.annotations or {}).get(keys.MOVABLE_ANNOTATION) != "true":
        return False
    return any(ref.controller for ref in meta.ownerReferences or ())


# -- bound pods -------------------------------------------------------------------------------------------


def bound_placement(pod: Pod, *, gpus_by_uuid: Mapping[str, GpuDevice]) -> Placement:
    """What a bound pod holds: its binding as the node reads it (``read_binding``), on the node's GPUs.

    Raises ``InvalidPodRequest`` where the node would refuse the binding. Devices the node does not
    publish are skipped. A whole-GPU container holds each GPU's memory; an sm-sharing container the
    binder wrote no compute portion for (another binder) runs with no SM cap on the node, and is
    charged its memory share of the GPU, as the engine charges a pod that asks no compute share. A MIG
    container holds its slices (their MIG UUIDs, among the GPUs' published slices), each whole.
    """
    node = (pod.spec.nodeName if pod.spec else None) or ""
    slices = {s.uuid: (g, s) for g in gpus_by_uuid.values() for s in g.mig}
    containers = []
    for bound in read_binding(pod.metadata.annotations or {}):
        devices = []
        for name in bound.devices:
            uuid = name.removeprefix(f"{keys.GPU_RESOURCE}=")
            if bound.mig and uuid in slices:
                gpu, held = slices[uuid]
                devices.append(DeviceAssignment(uuid, gpu.index, held.mib, held.mib, None))
                continue
            device = None if bound.mig else gpus_by_uuid.get(uuid)
            if device is None:
                log.warning(
                    "pod %s/%s holds GPU %s which node %s does not publish; not counted",
                    pod.metadata.namespace,
                    pod.metadata.name,
                    name,
                    node,
                )
                continue
            devices.append(_held(bound, device))
        if devices:
            placed = ContainerPlacement(
                bound.container, bound.mode, bound.exclusive, tuple(devices), mig=bound.mig
            )
            containers.append(placed)
    return Placement(pod_uid=pod.metadata.uid, node=node, containers=tuple(containers))


def _held(bound: BoundContainer, device: GpuDevice) -> DeviceAssignment:
    sm_sharing = bound.mode is ComputeMode.SM_SHARING
    if bound.exclusive or bound.request_mib is None or bound.limit_mib is None:
        mib = device.memory_mib
        return DeviceAssignment(device.uuid, device.index, mib, mib, 1.0 if sm_sharing else None)
    portion = bound.compute_portion
    if sm_sharing and portion is None:
        portion = min(1.0, bound.request_mib / device.memory_mib)
    return DeviceAssignment(device.uuid, device.index, bound.request_mib, bound.limit_mib, portion)
