"""The scheduler's one set of books: which pod holds what on which node, and in which state.

Why one cache: the engine's ledgers are the only thing a placement may be checked against, so every
pod that holds GPUs must be in them exactly once, whether the scheduler placed it a millisecond ago or
the API showed it bound at start-up. This module keeps, next to the engine, only what the engine cannot
know: the state of each booking and the pods bound to nodes the scheduler does not know (yet). It works
the way kube-scheduler's cache does:

- **assumed**: the engine just placed the pod (``place``); its GPUs are held at once, so the next batch
  sees them, while the bind runs in the background. An assumed booking never expires: its bind has
  not answered yet.
- **bound**: the bind answered success (``finish_binding``); the booking waits for the informer to show
  the pod bound. If that confirmation does not come within ``assumed_ttl`` (the pod was deleted while
  the watch was away and no delete arrived), ``expire`` releases the booking, as kube-scheduler expires
  an assumed pod whose binding finished.
- **confirmed**: the informer shows the pod bound (``confirm``): from then on only a delete
  (``remove``) or a node change releases it. A pod confirmed on a node the cache does not know waits
  for that node, holding nothing, and is booked when the node arrives.
- ``forget``: the bind failed; an assumed or bound booking is released (a confirmed one is not: the API
  already shows it bound).

Amounts. The engine's ``Placement`` is the only source of resolved per-device amounts: the binder writes
exactly what is booked here, and a pod confirmed from the API is booked from what the binder wrote (its
annotations: devices and whole MiB), so a restart rebuilds exactly the books it had. One rule makes that
true: the contract writes one amount per container, so where a container's GPUs differ in size and the
engine resolved a portion differently on each, the smallest amount of each kind is booked (and written).

Nodes. ``set_node`` is the one place a node change is handled. A node that goes (``remove_node``)
takes its bookings out of the engine, but they are kept aside, in their states: a bind in flight to it
may still land, and a pod bound there still holds its GPUs if the node comes back. A node that comes
(back) books the bookings kept for it (as they were, when all their GPUs are there) and the pods the API
showed bound to it while it was unknown (from their annotations). A new spec with the same GPUs only
replaces the spec. A changed GPU inventory keeps every booking whose GPUs are all still there, re-books
confirmed pods that lost a GPU from their annotations (the missing GPU is not counted) and releases
unconfirmed ones (their bind's outcome, seen by the informer, books them again).

Topology-only nodes. kube-scheduler counts every node as an affinity and spread domain, and every pod
bound anywhere. ``set_topology_node`` tells the engine of a node the scheduler does not manage (its
labels and taints; nothing is placed there), and the pods the API shows bound to it (kept as pods
waiting for their node, above) are counted in the engine for other pods' rules: their labels, namespace
and terms. A topology-only node that becomes managed is dropped as such before it is added, and its
pods are booked as bound pods; a managed node that goes may come back as a topology-only node (the
service tells), and the bookings kept aside for it count there meanwhile.

DRA claims. An allocated claim of our driver is held once in the engine, whatever pods use it, and
follows the informer (``claim_changed``) and this scheduler's own writes (``hold_claim``,
``claim_written``); ``claim_holds.ClaimHolds`` keeps them (``claims``) and says how. Claims of a node the
cache does not know wait for it, like pods; a node that comes (back) or changes GPUs re-holds them. The
pods that use claims are booked with their host resources only (``rebook``): their GPUs are the claims'.

Everything here is synchronous and in memory: informer handlers and the scheduling loop call it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.contract.errors import ContractError
from gpufrac.contract.request import PodGpuRequest
from gpufrac.placement.decision import ContainerPlacement, Decision, DeviceAssignment, Placement
from gpufrac.placement.model import ModePolicy, NodeSpec, PendingPod
from gpufrac.scheduler.claim_holds import ClaimHolds
from gpufrac.scheduler.objects import (
    DefaultQueue,
    bound_placement,
    device_uuids,
    gpu_request,
    host_request,
    pending_pod,
)
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.pod_fields import RefusedPod

log = logging.getLogger(__name__)


class BookingState(enum.Enum):
    ASSUMED = "assumed"
    BOUND = "bound"
    CONFIRMED = "confirmed"


@dataclass(slots=True)
class Booking:
    """One pod's booking: ``placement`` is what the engine holds for it on ``placement.node``."""

    pod: Pod
    pending: PendingPod
    placement: Placement
    state: BookingState
    #: When a ``BOUND`` booking expires unconfirmed (the cache's clock); None otherwise.
    deadline: float | None = None

    @property
    def node(self) -> str:
        return self.placement.node


@dataclass(frozen=True, slots=True)
class NodeChange:
    """What ``set_node`` did: ``added``/``gpus_changed`` and the pods whose bookings were released."""

    added: bool
    changed: bool
    gpus_changed: bool = False
    released: tuple[str, ...] = ()


def uniform(placement: Placement) -> Placement:
    """``placement`` with one amount per container: the smallest request, limit and compute portion of
    its GPUs (the contract writes one of each per container). Unchanged when the GPUs agree."""
    containers = []
    changed = False
    for c in placement.containers:
        if c.mig or len({(d.request_mib, d.limit_mib, d.compute_portion) for d in c.devices}) <= 1:
            containers.append(c)
            continue
        changed = True
        request = min(d.request_mib for d in c.devices)
        limit = min(d.limit_mib for d in c.devices)
        portions = [d.compute_portion for d in c.devices if d.compute_portion is not None]
        portion = min(portions) if portions else None
        devices = tuple(
            DeviceAssignment(d.uuid, d.index, request, max(request, limit), portion) for d in c.devices
        )
        containers.append(ContainerPlacement(c.container, c.mode, c.exclusive, devices))
    return replace(placement, containers=tuple(containers)) if changed else placement


class BookingCache:
    """See the module docstring. ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(
        self,
        *,
        engine: PlacementEngine,
        default_queue: DefaultQueue,
        mode_policy: ModePolicy = ModePolicy.REQUIRED,
        assumed_ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._default_queue = default_queue
        self._mode_policy = mode_policy
        self._ttl = assumed_ttl
        self._clock = clock
        self._nodes: dict[str, NodeSpec] = {}
        self._bookings: dict[str, Booking] = {}
        self._on_node: dict[str, set[str]] = {}
        #: Pods the API shows bound to a node the cache does not know: node -> uid -> pod.
        self._waiting: dict[str, dict[str, Pod]] = {}
        #: Bookings of nodes that went, kept in their states until the node comes back: uid -> booking.
        self._parked: dict[str, Booking] = {}
        #: Bound bookings waiting for their confirmation: uid -> deadline.
        self._deadlines: dict[str, float] = {}
        #: Nodes the scheduler does not manage, known as topology domains: name -> spec.
        self._topology: dict[str, NodeSpec] = {}
        #: Allocated claims of our driver, held in the engine when their node is known.
        self.claims = ClaimHolds(engine=engine, node=self._nodes.get)

    # -- reading ------------------------------------------------------------------------------------------

    def __contains__(self, uid: object) -> bool:
        return uid in self._bookings or uid in self._parked

    def __len__(self) -> int:
        return len(self._bookings) + len(self._parked)

    def __iter__(self) -> Iterator[Booking]:
        return iter([*self._bookings.values(), *self._parked.values()])

    def booking(self, uid: str) -> Booking | None:
        """The pod's booking, held in the engine or kept aside for a node that went."""
        return self._bookings.get(uid) or self._parked.get(uid)

    def on_node(self, node: str) -> list[Booking]:
        """The bookings held on ``node`` (for filters that look at the pods already there)."""
        return [self._bookings[uid] for uid in sorted(self._on_node.get(node, ()))]

    @property
    def nodes(self) -> dict[str, NodeSpec]:
        """The known nodes by name (read only)."""
        return self._nodes

    @property
    def topology_nodes(self) -> dict[str, NodeSpec]:
        """The nodes known as topology domains only, by name (read only)."""
        return self._topology

    def waiting_for_node(self, node: str) -> list[str]:
        return sorted(self._waiting.get(node, {}))

    # -- placing ------------------------------------------------------------------------------------------

    def place(
        self,
        pods: Sequence[PendingPod],
        originals: Sequence[Pod],
        *,
        gang: bool = False,
        min_member: int | None = None,
    ) -> list[Decision]:
        """The engine's decisions for ``pods`` (``originals`` are their API objects, in the same order);
        every Placement returned is booked as assumed. ``gang``: all or nothing (at least ``min_member``
        of them), in one statement."""
        decisions = (
            self.engine.schedule(pods, gang=True, min_member=min_member)
            if gang
            else self.engine.schedule(pods)
        )
        out: list[Decision] = []
        for pending, pod, decision in zip(pods, originals, decisions, strict=True):
            if isinstance(decision, Placement):
                decision = self._hold(pending, pod, decision, BookingState.ASSUMED)
            out.append(decision)
        return out

    def finish_binding(self, uid: str) -> None:
        """The bind succeeded: wait ``assumed_ttl`` for the informer to confirm it."""
        booking = self.booking(uid)
        if booking is not None and booking.state is BookingState.ASSUMED:
            booking.state = BookingState.BOUND
            booking.deadline = self._deadlines[uid] = self._clock() + self._ttl

    def forget(self, uid: str) -> bool:
        """The bind failed: release an assumed or bound booking. True when something was released."""
        booking = self.booking(uid)
        if booking is None or booking.state is BookingState.CONFIRMED:
            return False
        self._release(uid)
        return True

    def expire(self) -> list[str]:
        """Release bound bookings whose confirmation did not come in time; returns their uids."""
        now = self._clock()
        expired = [uid for uid, deadline in self._deadlines.items() if deadline <= now]
        for uid in expired:
            booking = self.booking(uid)
            assert booking is not None
            log.warning(
                "pod %s was bound to %s but the API has not shown it bound for %.0fs; releasing its booking",
                booking.pending.key,
                booking.node,
                self._ttl,
            )
            self._release(uid)
        return expired

    # -- what the informers show --------------------------------------------------------------------------

    def confirm(self, pod: Pod) -> bool:
        """The API shows ``pod`` bound to ``pod.spec.nodeName`` (ours, or another scheduler's). True when
        the pod, newly counted on an unmanaged node, may let a waiting pod in (a required affinity or a
        spread constraint counts it)."""
        uid, node = pod.metadata.uid, pod.spec.nodeName
        booking = self.booking(uid)
        if booking is not None:
            if booking.node == node:
                booking.pod, booking.state, booking.deadline = pod, BookingState.CONFIRMED, None
                self._deadlines.pop(uid, None)
                return False
            self._release(uid)
        # A pod's nodeName never changes once set, so it waits under that node alone (looking through
        # every node's waiting pods cost a pass over all unmanaged nodes per pod event).
        waiting = self._waiting.get(node)
        previous = waiting.pop(uid, None) if waiting is not None else None
        if node not in self._nodes:
            self._waiting.setdefault(node, {})[uid] = pod
            # Counted again only when what other pods' rules read changed (a pod's terms are immutable;
            # its labels are not); status updates are most of the events.
            if node in self._topology and (
                previous is None or previous.metadata.labels != pod.metadata.labels
            ):
                return self._count(pod, node)
            return False
        self._book_bound(pod)
        return False

    def release(self, uid: str) -> bool:
        """Drop a pod's booking whatever its state (a preemption victim's room handed to its preemptor).
        True when it held something."""
        return self._release(uid)

    def remove(self, pod: Pod) -> bool:
        """The pod is gone (deleted or finished). True when it held something (for a pod of an unmanaged
        node: when its leaving may let a waiting pod in)."""
        uid = pod.metadata.uid
        node = pod.spec.nodeName if pod.spec else None
        if node and node in self._waiting:
            self._waiting[node].pop(uid, None)
        return self._release(uid)

    def set_node(self, spec: NodeSpec) -> NodeChange:
        """A node added or changed (see the module docstring)."""
        previous = self._nodes.get(spec.name)
        if previous == spec:
            return NodeChange(added=False, changed=False)
        if previous is None:
            if self._topology.pop(spec.name, None) is not None:
                self.engine.remove_topology_node(spec.name)  # its pods are booked as bound below
            self.engine.add_node(spec)
            self._nodes[spec.name] = spec
            uuids = device_uuids(spec)
            for booking in [b for b in self._parked.values() if b.node == spec.name]:
                del self._parked[booking.pending.uid]
                if all(set(c.uuids) <= uuids for c in booking.placement.containers):
                    self.engine.assume(booking.pending, booking.placement)
                    self._bookings[booking.pending.uid] = booking
                    self._on_node.setdefault(spec.name, set()).add(booking.pending.uid)
                elif booking.state is BookingState.CONFIRMED:
                    self._book_bound(booking.pod)
            for pod in self._waiting.pop(spec.name, {}).values():
                self._book_bound(pod)
            self.claims.hold_on(spec.name)
            return NodeChange(added=True, changed=True)
        self._nodes[spec.name] = spec
        if previous.gpus == spec.gpus:
            self.engine.update_node(spec)
            return NodeChange(added=False, changed=True)
        log.info("GPUs of node %s changed; rebooking its pods", spec.name)
        released = []
        for uid in self.engine.update_node(spec):
            booking = self._bookings.pop(uid)
            self._on_node[spec.name].discard(uid)
            if booking.state is BookingState.CONFIRMED:
                self._book_bound(booking.pod)
            else:
                released.append(uid)
        self.claims.hold_on(spec.name)
        return NodeChange(added=False, changed=True, gpus_changed=True, released=tuple(released))

    def remove_node(self, name: str) -> None:
        """The node went: its bookings leave the engine and are kept aside until it comes back."""
        if name not in self._nodes:
            return
        for uid in sorted(self._on_node.pop(name, set())):
            self._parked[uid] = self._bookings.pop(uid)
        self.engine.remove_node(name)  # the engine lets go of every pod it held there
        del self._nodes[name]

    def set_topology_node(self, spec: NodeSpec) -> bool:
        """A node the scheduler does not manage, added or changed: a topology domain for affinity and
        spread, its bound pods counted (see the module docstring). Ignored for a managed node. True when
        the engine's view changed."""
        if spec.name in self._nodes or self._topology.get(spec.name) == spec:
            return False
        added = spec.name not in self._topology
        self.engine.add_topology_node(spec)
        self._topology[spec.name] = spec
        if added:
            for pod in self._waiting.get(spec.name, {}).values():
                self._count(pod, spec.name)
            for booking in self._parked.values():
                if booking.node == spec.name:
                    self._count(booking.pod, spec.name)
        return True

    def remove_topology_node(self, name: str) -> bool:
        """A topology-only node went (or became managed). True when it was known."""
        if self._topology.pop(name, None) is None:
            return False
        self.engine.remove_topology_node(name)  # its pods stay waiting for their node
        return True

    # -- DRA claims ---------------------------------------------------------------------------------------

    def claim_changed(self, claim: ResourceClaim) -> bool:
        """The informer's view of a claim (``ClaimHolds.changed``). True when the books changed."""
        return self.claims.changed(claim)

    def hold_claim(self, claim: dict[str, Any], *, node: str, assumed: bool) -> bool:
        """Hold an allocated claim (``claim`` with its ``status.allocation``) on ``node``."""
        return self.claims.hold(claim, node=node, assumed=assumed)

    def claim_written(self, uid: str, *, landed: bool) -> bool:
        """This scheduler's write of a claim's allocation answered (``ClaimHolds.written``)."""
        return self.claims.written(uid, landed=landed)

    def release_claim(self, uid: str) -> bool:
        """A claim deallocated or deleted: its GPUs are free again. True when it held something."""
        return self.claims.release(uid)

    def rebook(self, uid: str, pending: PendingPod, placement: Placement) -> None:
        """Replace what an assumed booking holds (a claim pod: its shares became the claims' holds)."""
        booking = self._bookings[uid]
        self.engine.assume(pending, placement)
        booking.pending, booking.placement = pending, placement

    # -- internals ----------------------------------------------------------------------------------------

    def _hold(self, pending: PendingPod, pod: Pod, placement: Placement, state: BookingState) -> Placement:
        written = uniform(placement)
        if written is not placement:
            self.engine.assume(pending, written)  # replaces what the engine held for the pod
        self._bookings[pending.uid] = Booking(pod=pod, pending=pending, placement=written, state=state)
        self._on_node.setdefault(written.node, set()).add(pending.uid)
        return written

    def _count(self, pod: Pod, node: str) -> bool:
        """Count a pod bound to topology-only ``node`` for other pods' rules (True: it may let a waiting
        pod in)."""
        return self.engine.add_topology_pod(self._bound_pending(pod, PodGpuRequest()), node)

    def _bound_pending(self, pod: Pod, gpu: PodGpuRequest) -> PendingPod:
        """The engine's view of a bound pod: what it takes and the rules it carries, or, when a field
        cannot be read, what it takes and its labels."""
        meta = pod.metadata
        try:
            return pending_pod(
                pod, gpu=gpu, arrival=0, default_queue=self._default_queue, mode_policy=self._mode_policy
            )
        except RefusedPod as error:  # a bound pod still takes its resources; its rules cannot be read
            log.warning("bound pod %s/%s: %s", meta.namespace, meta.name, error)
            cpu, memory = host_request(pod)
            return PendingPod(
                namespace=meta.namespace,
                name=meta.name,
                uid=meta.uid,
                gpu=gpu,
                cpu_milli=cpu,
                memory_bytes=memory,
                labels=dict(meta.labels or {}),
            )

    def _book_bound(self, pod: Pod) -> None:
        """Book a pod the API shows bound to a known node, from what its binder wrote."""
        node = pod.spec.nodeName
        meta = pod.metadata
        try:
            gpu = gpu_request(pod)
        except Exception as error:  # InvalidPodRequest, or anything else one pod's data may raise
            log.warning(
                "bound pod %s/%s has an invalid GPU request; booking its host resources only: %s",
                meta.namespace,
                meta.name,
                error,
            )
            gpu = PodGpuRequest()
        spec = self._nodes[node]
        try:
            placement = bound_placement(pod, gpus_by_uuid={g.uuid: g for g in spec.gpus})
        except ContractError as error:  # the node refuses this binding: its containers cannot start
            log.warning(
                "bound pod %s/%s has a binding the node refuses; booking its host resources only: %s",
                meta.namespace,
                meta.name,
                error,
            )
            placement = Placement(pod_uid=meta.uid, node=node, containers=())
        pending = self._bound_pending(pod, gpu)
        try:
            self.engine.assume(pending, placement)
        except ValueError as error:
            log.error("cannot book pod %s/%s on %s: %s", meta.namespace, meta.name, node, error)
            return
        self._bookings[meta.uid] = Booking(
            pod=pod, pending=pending, placement=placement, state=BookingState.CONFIRMED
        )
        self._on_node.setdefault(node, set()).add(meta.uid)

    def _release(self, uid: str) -> bool:
        self._deadlines.pop(uid, None)
        # A pod counted on a topology-only node "held something" only if its leaving may let a waiting
        # pod in (an anti-affinity it carried, or a rule that counted it other than a required
        # affinity): unmanaged nodes' pods come and go often, and each release wakes every parked pod.
        counted = bool(self._topology) and bool(self.engine.remove_topology_pod(uid))
        if self._parked.pop(uid, None) is not None:
            return True
        booking = self._bookings.pop(uid, None)
        if booking is None:
            return counted
        self.engine.forget(uid)
        on_node = self._on_node.get(booking.node)
        if on_node is not None:
            on_node.discard(uid)
        return True
