"""What ``kubectl gpufrac nodes`` and ``explain`` show, computed from API objects (no I/O here).

Per GPU: the inventory the node agent published (``gpufrac.io/gpus``), and what the bound pods on it
hold, rebuilt from their contract annotations exactly as the scheduler rebuilds them after a restart
(``bound_placement``: the binding read as the node reads it). Guaranteed MiB is the sum of the tenants'
requests; free is usable minus guaranteed (what a new guaranteed request can still get).

Whether each fraction's GPU memory limit is in force comes from the pod condition the node agent writes
(``GpuMemoryEnforced``, ``gpufrac.node.memlimit.condition``): kubectl reads the API, not Prometheus, so
a fraction counts as verified only where that condition is True. Its message holds one part per
container, each starting with the container's name (``app: soft 4096 MiB, hard 6144 MiB read back on 1
GPU(s) ...``), so ``explain`` can say it per container; a False condition names only the containers it
is about, and the others are shown Unknown.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightkube.resources.core_v1 import Event, Node, Pod

from gpufrac.contract import keys
from gpufrac.contract.dra import AllocationError, device_name, read_allocation
from gpufrac.contract.errors import ContractError
from gpufrac.contract.request import ContainerGpuRequest, PodGpuRequest
from gpufrac.contract.resize import resize_keys
from gpufrac.placement.decision import Placement
from gpufrac.placement.queue_access import chosen_queue, named_queues
from gpufrac.scheduler.objects import (
    InvalidInventory,
    bound_placement,
    gpu_request,
    node_inventory,
    node_spec,
)

#: Pods in these phases hold nothing (the scheduler's informer skips them too).
TERMINAL_PHASES = ("Succeeded", "Failed")
#: A container's enforcement when the pod condition says nothing about it (or is not written yet).
UNKNOWN = "Unknown"
#: A whole-GPU tenant: no memory limit to enforce.
NOT_FRACTIONAL = "-"


@dataclass(frozen=True, slots=True)
class ContainerEnforcement:
    """One fractional container's GPU memory limit, as the pod's ``GpuMemoryEnforced`` condition says."""

    container: str
    status: str  # "True", "False" or "Unknown"
    reason: str | None
    message: str


@dataclass(frozen=True, slots=True)
class MemoryEnforcement:
    """The pod's ``GpuMemoryEnforced`` condition (status None: not written) and what it says per container."""

    status: str | None
    reason: str | None
    message: str | None
    since: str | None
    containers: list[ContainerEnforcement]

    def of(self, container: str) -> str:
        found = next((c for c in self.containers if c.container == container), None)
        return found.status if found is not None else UNKNOWN


def _parts(message: str, containers: Sequence[str]) -> dict[str, str]:
    """The condition's message split per container: ``"; "`` joins containers and also a container's GPUs,
    so a part starts a new container only where it begins with one of the pod's container names."""
    parts: dict[str, list[str]] = {}
    current = None
    for piece in message.split("; ") if message else ():
        name = next((c for c in containers if piece.startswith(f"{c}: ") and c not in parts), None)
        if name is not None:
            current = name
            parts[name] = [piece[len(name) + 2 :]]
        elif current is not None:
            parts[current].append(piece)
    return {name: "; ".join(pieces) for name, pieces in parts.items()}


def memory_enforcement(pod: Pod, fractional: Sequence[str]) -> MemoryEnforcement:
    """``fractional``: the pod's fractional containers (whole-GPU ones have no limit to enforce)."""
    conditions = (pod.status.conditions if pod.status else None) or []
    condition = next((c for c in conditions if c.type == keys.POD_MEMORY_ENFORCED_CONDITION), None)
    if condition is None:
        unwritten = (
            f"the node agent has not written {keys.POD_MEMORY_ENFORCED_CONDITION} (the container has not "
            "started, or the node's agent does not verify limits)"
        )
        return MemoryEnforcement(
            None, None, None, None, [ContainerEnforcement(c, UNKNOWN, None, unwritten) for c in fractional]
        )
    parts = _parts(condition.message or "", fractional)
    containers = []
    for name in fractional:
        if condition.status == "True" or name in parts:
            containers.append(
                ContainerEnforcement(name, condition.status, condition.reason, parts.get(name, ""))
            )
        else:
            containers.append(
                ContainerEnforcement(
                    name, UNKNOWN, None, "not named in the pod's condition (read back, or not started yet)"
                )
            )
    since = condition.lastTransitionTime
    return MemoryEnforcement(
        status=condition.status,
        reason=condition.reason,
        message=condition.message,
        since=since.isoformat() if since is not None else None,
        containers=containers,
    )


@dataclass(frozen=True, slots=True)
class Tenant:
    namespace: str
    pod: str
    container: str
    mode: str
    request_mib: int
    limit_mib: int
    #: Whether the container's GPU memory limit is in force: "True", "False", "Unknown"; "-" for whole GPUs.
    enforced: str = NOT_FRACTIONAL

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    @property
    def fractional(self) -> bool:
        return self.enforced != NOT_FRACTIONAL


@dataclass(slots=True)
class GpuRow:
    node: str
    index: int
    uuid: str
    model: str
    usable_mib: int
    health: str
    tenants: list[Tenant] = field(default_factory=list)

    @property
    def guaranteed_mib(self) -> int:
        return sum(t.request_mib for t in self.tenants)

    @property
    def limit_mib(self) -> int:
        return sum(t.limit_mib for t in self.tenants)

    @property
    def free_mib(self) -> int:
        return self.usable_mib - self.guaranteed_mib

    @property
    def mode(self) -> str:
        return ",".join(sorted({t.mode for t in self.tenants})) or "-"

    @property
    def enforced(self) -> str:
        """Fractional tenants whose limit is verified, of all fractional tenants ("-" when none)."""
        fractions = [t for t in self.tenants if t.fractional]
        if not fractions:
            return NOT_FRACTIONAL
        return f"{sum(t.enforced == 'True' for t in fractions)}/{len(fractions)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "index": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "usableMiB": self.usable_mib,
            "guaranteedMiB": self.guaranteed_mib,
            "limitMiB": self.limit_mib,
            "freeMiB": self.free_mib,
            "mode": self.mode,
            "enforced": self.enforced,
            "health": self.health,
            "tenants": [asdict(t) for t in self.tenants],
        }


def _health(node: Node) -> str:
    return "Ready" if node_spec(node).ready else "NotReady"


def gpu_rows(
    nodes: Iterable[Node], pods: Iterable[Pod], claims: Iterable[Any] = ()
) -> tuple[list[GpuRow], list[str]]:
    """Every published GPU with its tenants, and warnings (unreadable inventories or requests).

    ``claims`` (ResourceClaims) add the shares our DRA driver holds: each allocated result of the driver
    is a tenant of the GPU it names (the pool is the node), ``<claim>/<request>`` of the pod the claim is
    reserved for (``claim_tenants``)."""
    rows: dict[str, dict[str, GpuRow]] = {}
    devices = {}
    warnings: list[str] = []
    for node in nodes:
        try:
            inventory = node_inventory(node)
        except InvalidInventory as error:
            warnings.append(str(error))
            continue
        health = _health(node)
        name = node.metadata.name
        devices[name] = {g.uuid: g for g in inventory}
        rows[name] = {
            g.uuid: GpuRow(
                node=name, index=g.index, uuid=g.uuid, model=g.model, usable_mib=g.memory_mib, health=health
            )
            for g in inventory
        }
    for pod in pods:
        node = pod.spec.nodeName if pod.spec else None
        if not node or node not in rows or (pod.status and pod.status.phase in TERMINAL_PHASES):
            continue
        try:
            placement = bound_placement(pod, gpus_by_uuid=devices[node])
        except ContractError as error:
            warnings.append(
                f"pod {pod.metadata.namespace}/{pod.metadata.name}: the node refuses its binding: {error}"
            )
            continue
        enforcement = memory_enforcement(pod, [c.container for c in placement.containers if not c.exclusive])
        for container in placement.containers:
            mode = "exclusive" if container.exclusive else container.mode.value
            enforced = NOT_FRACTIONAL if container.exclusive else enforcement.of(container.container)
            for device in container.devices:
                rows[node][device.uuid].tenants.append(
                    Tenant(
                        namespace=pod.metadata.namespace,
                        pod=pod.metadata.name,
                        container=container.container,
                        mode=mode,
                        request_mib=device.request_mib,
                        limit_mib=device.limit_mib,
                        enforced=enforced,
                    )
                )
    for node, uuid, tenant in claim_tenants(claims, devices, warnings):
        if node in rows and uuid in rows[node]:
            rows[node][uuid].tenants.append(tenant)
    ordered = [row for node in sorted(rows) for row in sorted(rows[node].values(), key=lambda r: r.index)]
    return ordered, warnings


def claim_tenants(
    claims: Iterable[Any], devices: Mapping[str, Mapping[str, Any]], warnings: list[str]
) -> Iterator[tuple[str, str, Tenant]]:
    """(node, GPU UUID, tenant) for every share of our DRA driver in ``claims`` (lightkube objects or
    dicts), read with the node's own reader (``contract.dra.read_allocation``). ``devices``: each node's
    inventory by UUID. A claim's enforcement is ``Unknown``: the node agent reads back the limits of
    annotation fractions only (docs/dra.md)."""
    for claim in claims:
        data = claim.to_dict() if hasattr(claim, "to_dict") else dict(claim)
        meta = data.get("metadata") or {}
        status = data.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        pools = {r.get("pool") for r in results if r.get("driver") == keys.DRA_DRIVER_NAME}
        for node in sorted(p for p in pools if p in devices):
            uuids = {device_name(uuid, gpu.index): uuid for uuid, gpu in devices[node].items()}
            try:
                shares = read_allocation(data, uuids=uuids)
            except AllocationError as error:
                warnings.append(f"claim {meta.get('namespace')}/{meta.get('name')}: {error}")
                continue
            consumers = [
                r.get("name") for r in status.get("reservedFor") or [] if r.get("resource") == "pods"
            ]
            pod = consumers[0] if consumers else f"<claim {meta.get('name')}, not in use>"
            for share in shares:
                if share.pool != node:
                    continue
                bound = share.bound
                usable = devices[node][bound.devices[0]].memory_mib
                yield (
                    node,
                    bound.devices[0],
                    Tenant(
                        namespace=meta.get("namespace") or "",
                        pod=pod,
                        container=f"{meta.get('name')}/{share.request}",
                        mode="exclusive" if bound.exclusive else bound.mode.value,
                        request_mib=usable if bound.exclusive else bound.request_mib or 0,
                        limit_mib=usable if bound.exclusive else bound.limit_mib or bound.request_mib or 0,
                        enforced=NOT_FRACTIONAL if bound.exclusive else UNKNOWN,
                    ),
                )


@dataclass(frozen=True, slots=True)
class NodeEnforcement:
    """A node's fractional containers (of bound, not finished pods) and those whose limit is verified."""

    node: str
    fractions: list[str]
    unverified: list[str]

    @property
    def verified(self) -> int:
        return len(self.fractions) - len(self.unverified)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "fractions": len(self.fractions),
            "verified": self.verified,
            "unverified": self.unverified,
        }


def node_enforcement(rows: Iterable[GpuRow]) -> list[NodeEnforcement]:
    """Per node (every node with published GPUs): fractional containers counted once however many GPUs
    they span, as the node agent's ``gpufrac_fractions_running`` counts them."""
    status: dict[str, dict[str, str]] = {}
    for row in rows:
        mine = status.setdefault(row.node, {})
        for tenant in row.tenants:
            if tenant.fractional:
                mine[tenant.name] = tenant.enforced
    return [
        NodeEnforcement(
            node=node,
            fractions=sorted(tenants),
            unverified=sorted(name for name, enforced in tenants.items() if enforced != "True"),
        )
        for node, tenants in sorted(status.items())
    ]


@dataclass(frozen=True, slots=True)
class ResizeState:
    """A resize of the pod not finished: the request still on it (``gpufrac.io/container.<c>.resize.*``),
    the scheduler's ``GpuResizePending`` condition (why it waits or was refused) and the node agent's
    ``GpuResizeInProgress`` (a decided resize not yet in force); each condition as ``type``, ``status``,
    ``reason``, ``message``, ``since`` (None: not on the pod)."""

    requested: dict[str, str]
    pending: dict[str, str | None] | None
    in_progress: dict[str, str | None] | None


def resize_state(pod: Pod) -> ResizeState | None:
    """The pod's unfinished resize, or None when it shows none."""
    requested = resize_keys(pod.metadata.annotations or {})
    found: dict[str, dict[str, str | None]] = {}
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type in (keys.POD_RESIZE_PENDING_CONDITION, keys.POD_RESIZE_IN_PROGRESS_CONDITION):
            since = c.lastTransitionTime
            found[c.type] = {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "since": since.isoformat() if since is not None else None,
            }
    if not requested and not found:
        return None
    return ResizeState(
        requested=dict(sorted(requested.items())),
        pending=found.get(keys.POD_RESIZE_PENDING_CONDITION),
        in_progress=found.get(keys.POD_RESIZE_IN_PROGRESS_CONDITION),
    )


@dataclass(slots=True)
class Explanation:
    """Where a pod went and why, or why it waits: the scheduler's condition and Events, newest last."""

    namespace: str
    pod: str
    scheduler: str
    node: str | None
    phase: str
    scheduled: dict[str, str | None] | None
    gpus: list[dict[str, Any]]
    events: list[dict[str, Any]]
    request: str | None
    fit: list[str] = field(default_factory=list)
    #: The ``GpuMemoryEnforced`` condition per fractional container (None: the pod has none, or is unbound).
    enforced: MemoryEnforcement | None = None
    #: The queue the pod is in and that queue's share (None: the queues were not read).
    queue: QueueShare | None = None
    #: A resize not finished: the request, why the scheduler has not carried it out, what the node is at.
    resize: ResizeState | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: How a pod got into its queue (``QueueShare.how``).
BY_LABEL, BY_NAMESPACE, BY_DEFAULT = "label", "namespace-default", "default-queue"
#: Said of a status field the scheduler has not written (yet).
NOT_WRITTEN = "not written yet"
_NO_OBJECT = (
    "the scheduler also reads queues from its configuration file and KAI Scheduler's Queues, which have no "
    "status here; a pod whose queue is defined nowhere stays Pending"
)


@dataclass(frozen=True, slots=True)
class QueueShare:
    """The queue a pod is in, how it got there, and that queue's GPU-memory share in MiB as its ``Queue``
    object says: deserved (and limit) from the spec, fair share and allocated from the status the
    scheduler writes (None: not written yet). ``found`` is False where no ``Queue`` object has the name
    (a queue of the scheduler's configuration file or a KAI Scheduler queue, or none at all)."""

    queue: str
    #: ``label`` (the pod's gpufrac.io/queue or kai.scheduler/queue), ``namespace-default`` (its
    #: Namespace's gpufrac.io/default-queue label) or ``default-queue`` (the scheduler's default_queue).
    how: str
    #: How, in words (``label gpufrac.io/queue``).
    via: str
    found: bool
    parent: str | None = None
    deserved_mib: int | None = None
    limit_mib: int | None = None
    fair_share_mib: int | None = None
    allocated_mib: int | None = None
    #: What else a reader needs: unreadable objects, a queue with child queues, where to look.
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[tuple[str, str]]:
        """``explain``'s lines for the queue, as (label, text)."""
        where = f"{self.queue} ({self.via})"
        if self.parent:
            where += f", a child of queue {self.parent}"
        if not self.found:
            share = (
                f"no Queue object named {self.queue} (kubectl get queues.gpufrac.io): no spec or status "
                "to show"
            )
        else:
            parts = [f"deserved {self.deserved_mib} MiB"]
            if self.limit_mib is not None:
                parts.append(f"limit {self.limit_mib} MiB")
            written = [
                f"{what} {value} MiB"
                for what, value in (("fair share", self.fair_share_mib), ("allocated", self.allocated_mib))
                if value is not None
            ]
            missing = [
                what
                for what, value in (("fair share", self.fair_share_mib), ("allocated", self.allocated_mib))
                if value is None
            ]
            share = ", ".join(parts + written)
            if missing:
                share += f"; {' and '.join(missing)} {NOT_WRITTEN} (the scheduler writes the Queue's status)"
        return [("Queue:", where), ("Share:", f"GPU memory {share}"), *(("", note) for note in self.notes)]


def queue_share(
    pod: Pod,
    *,
    queues: Iterable[Any],
    namespace_labels: Mapping[str, str] | None,
    default_queue: str,
    notes: Sequence[str] = (),
) -> QueueShare:
    """The queue ``pod`` is in, by the scheduler's rule (``placement.queue_access.chosen_queue``), and its
    share from the ``Queue`` objects ``queues`` (lightkube objects). ``namespace_labels``: the labels of
    the pod's Namespace, None where they could not be read (then a pod without a queue label is shown in
    ``default_queue``, with a note). ``notes``: what the caller could not read, said with the queue."""
    meta = pod.metadata
    namespace = meta.namespace or ""
    pod_labels = meta.labels or {}
    choice = chosen_queue(
        pod_labels=pod_labels,
        namespace=namespace,
        namespace_labels=namespace_labels or {},
        fallback=default_queue,
    )
    if named_queues(pod_labels):
        how = BY_LABEL
    elif (namespace_labels or {}).get(keys.NAMESPACE_DEFAULT_QUEUE_LABEL):
        how = BY_NAMESPACE
    else:
        how = BY_DEFAULT
    said = list(notes)
    if how == BY_DEFAULT:
        labels = f"{keys.QUEUE_LABEL} or {keys.KAI_QUEUE_LABEL}"
        if namespace_labels is None:
            said.append(
                f"the pod has no {labels} label, and namespace {namespace}'s labels could not be read: if "
                f"it names a default queue ({keys.NAMESPACE_DEFAULT_QUEUE_LABEL}), the pod is in that one"
            )
        else:
            said.append(
                f"the pod has no {labels} label and namespace {namespace} has no "
                f"{keys.NAMESPACE_DEFAULT_QUEUE_LABEL} label"
            )
        said.append(f"{default_queue} is the scheduler's default_queue as --default-queue gives it")
    by_name = {q.metadata.name: q for q in queues}
    found = by_name.get(choice.queue)
    if found is None:
        return QueueShare(
            queue=choice.queue,
            how=how,
            via=choice.via,
            found=False,
            notes=[*said, _NO_OBJECT],
        )
    spec, status = dict(found.spec or {}), dict(found.status or {})
    memory = (spec.get("resources") or {}).get("gpuMemory") or {}
    children = sorted(
        name for name, q in by_name.items() if ((q.spec or {}).get("parentQueue") or None) == choice.queue
    )
    if children:
        said.append(
            f"queue {choice.queue} has child queues ({', '.join(children)}): pods join a queue without "
            "children, so the scheduler holds this pod"
        )
    return QueueShare(
        queue=choice.queue,
        how=how,
        via=choice.via,
        found=True,
        parent=spec.get("parentQueue") or None,
        deserved_mib=memory.get("deserved", 0),
        limit_mib=memory.get("limit"),
        fair_share_mib=(status.get("fairShare") or {}).get("gpuMemory"),
        allocated_mib=(status.get("allocated") or {}).get("gpuMemory"),
        notes=said,
    )


def _need(container: ContainerGpuRequest) -> str:
    if container.exclusive or container.request is None:
        return "a whole GPU"
    if container.request.mib is not None:
        return f"{container.request.mib} MiB"
    return f"{container.request.portion:g} of a GPU"


def _room_for(container: ContainerGpuRequest, row: GpuRow) -> bool:
    """Whether ``row`` could take one device of ``container`` by memory and mode, as things stand."""
    return row.health == "Ready" and _mode_allows(container, row) and _memory_allows(container, row)


def _mode_allows(container: ContainerGpuRequest, row: GpuRow) -> bool:
    if container.exclusive:
        return not row.tenants
    return {t.mode for t in row.tenants} <= {container.mode.value}


def _memory_allows(container: ContainerGpuRequest, row: GpuRow) -> bool:
    return container.exclusive or row.free_mib >= container.request_mib(row.usable_mib)


def _ever_holds(container: ContainerGpuRequest, row: GpuRow) -> bool:
    """Whether ``row``, empty, could hold one device of ``container``."""
    return row.health == "Ready" and container.request_mib(row.usable_mib) <= row.usable_mib


#: The scheduler's words when a pod's queue, not the GPUs, holds it (``placement.engine.over_limit``).
_QUEUE_HOLDS = re.compile(r"queue \S+ would (?:exceed its|take its ancestor queue)[^,.]*")


def fit_hints(
    request: PodGpuRequest, rows: list[GpuRow], *, scheduled_message: str | None = None
) -> list[str]:
    """For a waiting pod, per GPU container: is GPU memory what blocks it now, and what would make it fit.

    Memory and compute mode only, GPU by GPU, from the same rows ``nodes`` shows; the scheduler's own
    reasons (the PodScheduled message) cover everything else (selectors, taints, CPU, host memory). Each
    piece of advice follows from a reason: a request no GPU can ever hold is told so (not "when tenants
    leave"), fewer GPUs is offered only to a pod that asks for several, and a pod its queue holds gets the
    queue's reason instead of GPU advice.
    """
    held = _QUEUE_HOLDS.search(scheduled_message or "")
    if held:
        return [
            f"held by its queue, not by GPU memory: {held.group(0)}. It runs when the queue's own pods "
            "leave or its limit is raised (kubectl gpufrac queues; docs/queues.md)"
        ]
    ready = [row for row in rows if row.health == "Ready"]
    if not ready:
        return ["no Ready GPU in the cluster: see kubectl gpufrac nodes"]
    hints = []
    for container in request.containers:
        hints.append(f"{container.container}: {_container_hint(container, ready)}")
    return hints


def _container_hint(container: ContainerGpuRequest, ready: list[GpuRow]) -> str:
    if container.mig is not None:  # slices of GPUs in MIG mode: not memory of these rows (docs/mig.md)
        mig = container.mig
        size = mig.profile if mig.profile is not None else f"at least {mig.min_mib} MiB"
        return (
            f"needs {mig.count} MIG slice(s) of {size} on one node; slices are placed on GPUs in MIG mode, "
            "not in a GPU's free memory: see the scheduler's reasons"
        )
    wanted = f"needs {container.device_count} GPU(s) on one node with {_need(container)} free each"
    count = container.device_count
    ever = Counter(row.node for row in ready if _ever_holds(container, row))
    most_ever = ever.most_common(1)[0][1] if ever else 0
    if most_ever < count:
        largest = max(ready, key=lambda r: r.usable_mib)
        if not ever:
            return (
                f"{wanted}; it never fits here: the largest GPU has {largest.usable_mib} MiB usable "
                f"({largest.node} GPU {largest.index}, {largest.model}). Ask for at most that"
            )
        return (
            f"{wanted}; it never fits here: no node has more than {most_ever} GPU(s) that could hold it. "
            f"Ask for at most {most_ever} GPU(s) per pod, or add a node with {count}"
        )
    now = Counter(row.node for row in ready if _room_for(container, row))
    node, fitting = now.most_common(1)[0] if now else ("", 0)
    if fitting >= count:
        return (
            f"{wanted}; node {node} has {fitting} such GPUs now, so GPU memory is not what blocks it: see "
            "the scheduler's reasons (selector, taints, compute mode support, CPU or host memory)"
        )
    advice = [f"the most any node has now is {fitting}"]
    other_mode = [row for row in ready if _memory_allows(container, row) and not _mode_allows(container, row)]
    if other_mode and not container.exclusive:
        advice.append(
            f"{len(other_mode)} GPU(s) have the memory free but serve the other compute mode "
            "(a GPU never mixes modes)"
        )
    elif other_mode:
        advice.append(f"{len(other_mode)} GPU(s) have tenants (a whole GPU needs an empty one)")
    ways = ["when tenants leave"]
    largest_free = max((row.free_mib for row in ready if _mode_allows(container, row)), default=0)
    if not container.exclusive and largest_free > 0:
        ways.append(f"with a request of at most {largest_free} MiB (the largest free now)")
    if count > 1 and fitting > 0:
        ways.append(f"with {fitting} GPU(s) instead of {count}")
    return f"{wanted}; {'; '.join(advice)}. It fits {', or '.join(ways)}, or on an added node"


def explain(
    pod: Pod,
    *,
    node: Node | None,
    events: Iterable[Event],
    rows: list[GpuRow] | None = None,
    claims: Sequence[Any] = (),
    queue: QueueShare | None = None,
) -> Explanation:
    """``rows`` (the cluster's GPUs, as ``gpu_rows`` builds them) adds fit hints for a waiting pod;
    ``claims`` (the ResourceClaims reserved for the pod) add the GPU shares our DRA driver holds for it;
    ``queue`` (``queue_share``) the pod's queue and its share."""
    meta, spec, status = pod.metadata, pod.spec, pod.status
    condition = next(
        (c for c in (status.conditions if status else None) or [] if c.type == "PodScheduled"), None
    )
    gpus: list[dict[str, Any]] = []
    request_text = None
    try:
        request = gpu_request(pod)
        if not request.wants_gpu:
            request_text = "no GPU"
    except ContractError as error:
        request, request_text = None, f"invalid: {error}"
    enforced = None
    if request is not None and request.wants_gpu and node is not None and spec and spec.nodeName:
        by_uuid = {g.uuid: g for g in node_inventory(node)}
        try:
            placement = bound_placement(pod, gpus_by_uuid=by_uuid)
        except ContractError as error:
            request_text = f"bound, but the node refuses its binding: {error}"
            placement = Placement(pod_uid=meta.uid, node=spec.nodeName, containers=())
        fractional = [c.container for c in placement.containers if not c.exclusive]
        if fractional:
            enforced = memory_enforcement(pod, fractional)
        for container in placement.containers:
            for device in container.devices:
                gpus.append(
                    {
                        "container": container.container,
                        "gpu": device.index,
                        "uuid": device.uuid,
                        "mode": "exclusive" if container.exclusive else container.mode.value,
                        "requestMiB": device.request_mib,
                        "limitMiB": device.limit_mib,
                    }
                )

    if claims and node is not None:
        by_uuid = {g.uuid: g for g in node_inventory(node)}
        names = sorted(
            {str(c.metadata.name if hasattr(c, "metadata") else c["metadata"]["name"]) for c in claims}
        )
        request_text = f"DRA claim(s) {', '.join(names)}"
        for _, uuid, tenant in claim_tenants(claims, {node.metadata.name: by_uuid}, []):
            gpus.append(
                {
                    "container": tenant.container,
                    "gpu": by_uuid[uuid].index,
                    "uuid": uuid,
                    "mode": tenant.mode,
                    "requestMiB": tenant.request_mib,
                    "limitMiB": tenant.limit_mib,
                }
            )

    def when(e: Event) -> str:
        stamp = (
            e.lastTimestamp
            or e.eventTime
            or e.firstTimestamp
            or (e.metadata.creationTimestamp if e.metadata else None)
        )
        return stamp.isoformat() if stamp else ""

    ordered = sorted(events, key=when)
    return Explanation(
        namespace=meta.namespace,
        pod=meta.name,
        scheduler=(spec.schedulerName if spec else None) or "default-scheduler",
        node=(spec.nodeName if spec else None) or None,
        phase=(status.phase if status else None) or "Pending",
        scheduled=(
            {"status": condition.status, "reason": condition.reason, "message": condition.message}
            if condition is not None
            else None
        ),
        gpus=gpus,
        events=[
            {"time": when(e), "type": e.type, "reason": e.reason, "count": e.count or 1, "message": e.message}
            for e in ordered
        ],
        request=request_text,
        fit=(
            fit_hints(request, rows, scheduled_message=condition.message if condition else None)
            if request is not None and rows is not None and not gpus
            else []
        ),
        enforced=enforced,
        queue=queue,
        resize=resize_state(pod),
    )


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One ``Queue`` object as ``kubectl gpufrac queues`` shows it: its place in the tree, its spec's
    terms and the status the scheduler wrote (None where it wrote none yet)."""

    name: str
    depth: int
    parent: str | None
    display_name: str | None
    spec: dict[str, Any]
    status: dict[str, Any]

    def term(self, resource: str, key: str) -> Any:
        return ((self.spec.get("resources") or {}).get(resource) or {}).get(key)

    def amount(self, kind: str, resource: str) -> Any:
        return (self.status.get(kind) or {}).get(resource)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "parent": self.parent,
            "displayName": self.display_name,
            "resources": self.spec.get("resources") or {},
            "status": self.status,
        }


def queue_rows(queues: Iterable[Any]) -> list[QueueRow]:
    """Queue objects in tree order: each parent before its children, siblings by name. A queue whose
    parent is missing (or part of a cycle) is shown at the top level, as the scheduler treats it."""
    by_name = {q.metadata.name: q for q in queues}
    children: dict[str | None, list[str]] = {}
    for name, q in by_name.items():
        parent = (q.spec or {}).get("parentQueue") or None
        seen, walk = {name}, parent
        while walk is not None and walk in by_name and walk not in seen:
            seen.add(walk)
            walk = (by_name[walk].spec or {}).get("parentQueue") or None
        top = parent is None or parent not in by_name or walk in seen
        children.setdefault(None if top else parent, []).append(name)
    rows: list[QueueRow] = []

    def visit(name: str, depth: int) -> None:
        q = by_name[name]
        spec = dict(q.spec or {})
        rows.append(
            QueueRow(
                name=name,
                depth=depth,
                parent=spec.get("parentQueue") or None,
                display_name=spec.get("displayName") or None,
                spec=spec,
                status=dict(q.status or {}),
            )
        )
        for child in sorted(children.get(name, ())):
            visit(child, depth + 1)

    for root in sorted(children.get(None, ())):
        visit(root, 0)
    return rows
