"""The scheduler service: informers -> queue -> booking cache -> binder, with a Lease deciding who binds.

It runs on the controller skeleton it shares with the operator (``gpufrac.process.controller``: the
lease, probes, the handler adapter and the shutdown order).

State. Informers feed one booking cache (``gpufrac.scheduler.booking_cache``), which holds the engine:
our pods (``spec.schedulerName`` = ours), other schedulers' pods already bound (they take cpu, memory and
pod slots, host ports and other resources on managed nodes, their labels and terms count for affinity
and spread, and GPUs if they carry the contract) and managed nodes; every node, read narrowly
(``objects.NodeTopology``: labels and taints), so that the nodes gpufrac does not manage are topology
domains as kube-scheduler counts them, with the pods bound there counted; another informer watches
the node agents' Leases (below). Three more read what some pod fields refer to: namespaces (labels,
for ``namespaceSelector``), claims and volumes (a bound volume's node affinity); ``pod_fields`` says
which fields are honoured. Every
replica keeps the cache current from the moment it starts, leader or not, so a standby takes over with
warm books. At start-up the books are rebuilt from what the API says: every bound pod is booked from its
annotations as the informers list it, before anything is placed (the scheduling loop waits for every
informer to sync). Nothing about placements is kept anywhere else, so a restart never double-books a GPU.

Assumed pods. A placement is booked the moment it is decided (assumed), so the next batch sees it without
waiting for the watch; the bind runs in the background and writes exactly what the engine placed. A
successful bind waits for the watch to confirm it; a failed one is forgotten and the pod retried with
backoff; a bind whose confirmation never comes expires (``assumed_ttl_s``). A booked pod is never queued
again, whatever events its own bind causes.

Where to extend. ``_schedule`` is one scheduling cycle: ``_prepare`` turns each pod into the engine's
``PendingPod`` and passes it through the ``filters`` (``PodFilter``: narrow where a pod may go with
what the engine cannot see, such as the pods already on each node, ``cache.on_node``); the cache places
the batch; each pod that fits nowhere goes to the ``post_filter`` (``PostFilter``: the preemption step)
before it is reported unschedulable.

Unschedulable pods get PodScheduled=False with the engine's counted reasons (or the contract's sentence
for an invalid request, or the queue's name when the pod names a queue that is not configured) and a
FailedScheduling Event, written only when the message changes, and wait until the cluster changes: a
node added or changed, a pod released. One pod never stops the others: an unexpected error while reading
or placing a pod is logged and reported on that pod (PodScheduled=False, reason SchedulerError), and the
loop goes on.

Node agents prove they are alive by renewing their node's Lease (a heartbeat; a fourth informer watches
the Leases in ``node_lease_namespace``). A node whose heartbeat is older than ``node_heartbeat_expiry_s``
takes no new pods; since an expiry is time passing and not an API event, a timer re-evaluates nodes as
their heartbeats expire (``gpufrac.kube.heartbeat``), and a heartbeat that resumes is a Lease (or Node)
update like any other.

DRA claims (``dra: true``, the default; docs/dra.md): three more informers read ResourceClaims,
DeviceClasses and ResourceSlices. Every allocated claim of gpufrac's driver on a managed node is booked
in the engine once, whoever allocated it (``BookingCache.claim_changed``), so annotation pods and claims
never book the same memory. A pod whose claims are all gpufrac's (``gpufrac.scheduler.claims``) is
placed like an annotation pod: its claims' requests are containers of its engine request, restricted
to nodes that publish our devices (and to the node its already allocated claims are on); once placed,
its shares become the claims' holds and the pod keeps its host resources, and the bind first writes
each claim's allocation and reservation (``ClaimWriter``), then the Binding.

Queues come from Queue objects, KAI's Queue objects and the configuration file, merged into the engine
(``gpufrac.scheduler.queues``; docs/queues.md). A pod that fits nowhere may preempt or reclaim
(``gpufrac.scheduler.preemption``), or have movable pods moved for it (consolidation, the same module);
pods of a gang are placed all or nothing (``gpufrac.scheduler.gangs``).

Shutdown order matters: stop placing, let binds in flight finish (bounded, ``_drain``), then release the
lease, so a successor never places while this replica still writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kube.errors import Conflict
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from gpufrac.kube.heartbeat import AgentHeartbeats, latest_heartbeat, lease_renewed
from gpufrac.kube.informer import Informer, object_key
from gpufrac.kube.lease import LeadershipLost, LeaseTiming
from gpufrac.kube.patch import set_pod_condition
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.placement.consolidation import MoveBudget
from gpufrac.placement.decision import Decision, Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import (
    ModePolicy,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    PendingPod,
    SelectorOperator,
)
from gpufrac.process.controller import ControllerRunner, Election, Handler, cancel, default_identity
from gpufrac.scheduler.binder import Binder, BindMode, BindResult, Outcome, stale_binding_keys
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claims import (
    ClaimPlan,
    ClaimWriter,
    DriverClass,
    PublishedNode,
    allocation,
    driver_class,
    plan_claims,
    published_nodes,
)
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.gangs import GangKey, Gangs, gang_of
from gpufrac.scheduler.metrics import GpuAllocation, SchedulerMetrics, StateReaders
from gpufrac.scheduler.objects import (
    NodeTopology,
    agent_heartbeat,
    gpu_request,
    node_spec,
    pending_pod,
    topology_node_spec,
)
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.pod_fields import RefusedPod, refused_fields, scheduling_gates, volume_terms
from gpufrac.scheduler.preemption import Preemptions
from gpufrac.scheduler.queue_status import QueueStatusWriter, engine_capacity
from gpufrac.scheduler.queues import QueueDirectory
from gpufrac.scheduler.scheduling_queue import SchedulingQueue

log = logging.getLogger(__name__)

COMPONENT = "gpufrac-scheduler"

#: PodScheduled reasons: no node fits (or the pod's request cannot be placed as written), and the
#: scheduler itself failed on the pod (kube-scheduler's two reasons).
UNSCHEDULABLE = "Unschedulable"
SCHEDULER_ERROR = "SchedulerError"

#: How much of an unexpected error's text goes into a pod's condition.
_ERROR_TEXT_MAX = 300

#: How often bound bookings are checked for a confirmation that never came.
_EXPIRY_CHECK_S = 1.0

#: Events wait while a burst is being bound: binds in flight, or one finished this recently.
EVENTS_SETTLE_S = 1.0
#: Events a burst may leave waiting (one per pod bound); more are dropped and counted.
EVENTS_QUEUE = 10_000


@dataclass(frozen=True, slots=True)
class _ClaimBind:
    """A claim pod's part of its bind: every claim it uses, and the allocations to write (by claim uid)."""

    plan: ClaimPlan
    allocations: dict[str, dict[str, Any]]


class PodFilter(Protocol):
    """Narrows where one pod may go, with what the engine cannot see (e.g. the pods on each node).

    Returns the pod as the engine should place it (for instance with extra required node-affinity
    terms), or a sentence saying why it cannot be placed now (the pod is reported unschedulable with it
    and retried when the cluster changes).
    """

    def narrow(self, pending: PendingPod, pod: Pod, cache: BookingCache) -> PendingPod | str: ...


class PostFilter(Protocol):
    """What to do for a pod that fits nowhere (the preemption step). Returns True when it took the pod
    in hand (e.g. victims are being evicted and the pod is nominated); the pod is then parked without
    being reported unschedulable, and retried when the cluster changes."""

    def post_filter(
        self, pending: PendingPod, pod: Pod, decision: Unschedulable, cache: BookingCache
    ) -> bool: ...


def _meaningful_change(old: Pod, new: Pod) -> bool:
    """A change a user made (spec, labels, annotations), not a status write; or the names of the claims
    kube-controller-manager generated from the pod's ResourceClaimTemplates (a pod waits for them)."""
    return (
        old.spec != new.spec
        or old.metadata.annotations != new.metadata.annotations
        or old.metadata.labels != new.metadata.labels
        or (old.status.resourceClaimStatuses if old.status else None)
        != (new.status.resourceClaimStatuses if new.status else None)
    )


def _condition(pod: Pod, kind: str) -> tuple[str | None, str | None]:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == kind:
            return c.status, c.message
    return None, None


class SchedulerService:
    """Run with ``await service.run()``; cancel the task to stop it cleanly."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        config: SchedulerConfig,
        engine: PlacementEngine,
        identity: str | None = None,
        lease_client: AsyncClient | None = None,
        shutdown_grace: float = 5.0,
        filters: Sequence[PodFilter] = (),
        post_filter: PostFilter | None = None,
    ) -> None:
        self.config = config
        self.identity = identity or default_identity()
        self._client = client
        self._shutdown_grace = shutdown_grace
        self._filters = tuple(filters)
        self._post_filter = post_filter
        self._mode_policy = ModePolicy(config.mode_policy)
        # Before the metrics: their collector reads it at once.
        self.cache = BookingCache(
            engine=engine,
            # A pod without a queue label is in its namespace's default queue (the directory, below).
            default_queue=lambda namespace: self.queue_directory.default_for(namespace),
            mode_policy=self._mode_policy,
            assumed_ttl=config.assumed_ttl_s,
        )
        name = config.scheduler_name
        live = "status.phase!=Succeeded,status.phase!=Failed"
        self.pods: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(namespace=ALL_NAMESPACES, fields=f"spec.schedulerName={name},{live}"),
            name="pods",
        )
        self.foreign_pods: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(
                namespace=ALL_NAMESPACES, fields=f"spec.schedulerName!={name},spec.nodeName!=,{live}"
            ),
            name="foreign-pods",
        )
        self.nodes: Informer[Node] = Informer(
            client=client,
            resource=Node,
            selection=Selection(labels=config.node_selector),
            name="nodes",
        )
        self.pods.add_handler(Handler(changed=self._pod_changed, deleted=self._pod_deleted))
        self.foreign_pods.add_handler(Handler(changed=self._foreign_changed, deleted=self._pod_deleted))
        self.leases: Informer[Lease] = Informer(
            client=client,
            resource=Lease,
            selection=Selection(namespace=config.node_lease_namespace),
            name="node-leases",
        )
        self.nodes.add_handler(Handler(changed=self._node_changed, deleted=self._node_deleted))
        # Every node, read narrowly (labels and taints): the unmanaged ones are topology domains for
        # affinity and spread, as kube-scheduler counts them; the pods bound to them come through the pod
        # informers above, which do not select by node.
        self.topology_nodes: Informer[NodeTopology] = Informer(
            client=client, resource=NodeTopology, name="topology-nodes"
        )
        self.topology_nodes.add_handler(
            Handler(changed=self._topology_node_changed, deleted=self._topology_node_deleted)
        )
        self.leases.add_handler(Handler(changed=self._lease_changed, deleted=self._lease_deleted))
        # Pod fields kube-scheduler honours (#19): namespace labels for affinity terms' namespaceSelector,
        # and the claims and volumes whose node affinity a pod inherits.
        self.namespaces: Informer[Namespace] = Informer(client=client, resource=Namespace, name="namespaces")
        self.claims: Informer[PersistentVolumeClaim] = Informer(
            client=client,
            resource=PersistentVolumeClaim,
            selection=Selection(namespace=ALL_NAMESPACES),
            name="claims",
        )
        self.volumes: Informer[PersistentVolume] = Informer(
            client=client, resource=PersistentVolume, name="volumes"
        )
        self.namespaces.add_handler(Handler(changed=self._namespace_changed, deleted=self._storage_changed))
        self.claims.add_handler(Handler(changed=self._storage_changed, deleted=self._storage_changed))
        self.volumes.add_handler(Handler(changed=self._storage_changed, deleted=self._storage_changed))
        # DRA (docs/dra.md): claims of our driver are allocated here and booked whoever allocated them.
        dra_informers: tuple[Informer[Any], ...] = ()
        self.resource_claims: Informer[ResourceClaim] | None = None
        self.device_classes: Informer[DeviceClass] | None = None
        self.resource_slices: Informer[ResourceSlice] | None = None
        self._classes: dict[str, DriverClass | None] = {}
        self._published: dict[str, PublishedNode] = {}
        if config.dra:
            self.resource_claims = Informer(
                client=client,
                resource=ResourceClaim,
                selection=Selection(namespace=ALL_NAMESPACES),
                name="resource-claims",
            )
            self.device_classes = Informer(client=client, resource=DeviceClass, name="device-classes")
            self.resource_slices = Informer(client=client, resource=ResourceSlice, name="resource-slices")
            self.resource_claims.add_handler(
                Handler(changed=self._resource_claim_changed, deleted=self._resource_claim_deleted)
            )
            self.device_classes.add_handler(
                Handler(changed=self._device_class_changed, deleted=self._device_class_deleted)
            )
            self.resource_slices.add_handler(
                Handler(changed=self._slices_changed, deleted=self._slices_changed)
            )
            dra_informers = (self.resource_claims, self.device_classes, self.resource_slices)
        self._claim_plans: dict[str, ClaimPlan] = {}

        # Scheduled Events wait while a burst is being bound: the API server's CPU goes to binds first.
        self.events = EventRecorder(
            client=client,
            component=COMPONENT,
            instance=self.identity,
            queue_size=EVENTS_QUEUE,
            yield_to=self._binding_burst,
        )
        self.queue: SchedulingQueue[Pod] = SchedulingQueue(
            backoff_initial=config.backoff_initial_s,
            backoff_max=config.backoff_max_s,
            unschedulable_resync=config.unschedulable_resync_s,
        )
        # Queues: Queue objects, KAI's queues and the file's, merged into the engine (docs/queues.md).
        self.queue_directory = QueueDirectory(
            client=client,
            config=config,
            apply=engine.set_queues,
            changed=self.queue.cluster_changed,
            namespace_labels=self._namespace_labels,
        )
        self.queue_status = QueueStatusWriter(
            client=client,
            directory=self.queue_directory,
            book=lambda: self.cache.engine.queues,
            capacity=lambda: engine_capacity(self.cache.engine),
            waiting=self.queue.waiting,
            is_leader=self.is_leader,
            interval=config.queue_status_interval_s or 0.0,
        )
        self.metrics = SchedulerMetrics()
        election = config.leader_election
        self.runner = ControllerRunner(
            name=f"scheduler {config.scheduler_name}",
            client=client,
            identity=self.identity,
            informers=(
                self.pods,
                self.foreign_pods,
                self.nodes,
                self.topology_nodes,
                self.leases,
                self.namespaces,
                self.claims,
                self.volumes,
                *dra_informers,
            ),
            lead=self._lead,
            registry=self.metrics.registry,
            http_host=config.http_host,
            http_port=config.http_port,
            election=Election(
                lease_name=election.lease_name,
                lease_namespace=election.lease_namespace,
                timing=LeaseTiming(
                    lease_duration=election.lease_duration_s,
                    renew_deadline=election.renew_deadline_s,
                    retry_period=election.retry_period_s,
                ),
            )
            if election.enabled
            else None,
            lease_client=lease_client,
            background=(
                self.events.run,
                self._expire_heartbeats,
                self._expire_bookings,
                self.queue_directory.run,
                *((self.queue_status.run,) if config.queue_status_interval_s is not None else ()),
            ),
            drain=self._drain,
        )
        self.elector = self.runner.elector
        self.claim_writer = ClaimWriter(client=client, fence=self.is_leader)
        self.binder = Binder(
            client=client,
            fence=self.is_leader,
            device_style=config.device_names,
            mode=BindMode(config.bind_mode),
        )
        self.metrics.watch_state(
            StateReaders(
                pending_by_queue=self.queue.pending_by_queue,
                gpu_allocations=self._gpu_allocations,
                is_leader=self.is_leader,
                informer_relists=lambda: {i.name: i.relists for i in self.runner.informers},
                heartbeat_expired_nodes=lambda: sum(
                    1 for spec in self.cache.nodes.values() if spec.agent_heartbeat_expired
                ),
                events_pending=lambda: self.events.pending,
                events_dropped=lambda: self.events.dropped,
            )
        )
        self._bind_gate = asyncio.Semaphore(config.bind_concurrency)
        self._heartbeats = AgentHeartbeats(expiry_s=config.node_heartbeat_expiry_s)
        self._heartbeat_wake = asyncio.Event()
        self._heartbeat_due = math.inf

        self._in_flight: set[str] = set()
        self._first_seen: dict[str, float] = {}
        self._reported: dict[str, str] = {}
        self._arrivals = 0
        self._binds: set[asyncio.Task[None]] = set()
        self._last_bound = -math.inf
        self._chores: set[asyncio.Task[None]] = set()
        self.bound_total = 0
        self.gangs = Gangs(
            client=client,
            spawn=lambda coro: self._spawn(coro, self._chores),
            retry=self.queue.cluster_changed,
        )
        # Preemption, reclaim and consolidation search the engine's own books, so they need the engine.
        self.preemptions: Preemptions | None = None
        consolidation = config.consolidation
        if (config.preemption or consolidation.enabled) and isinstance(engine, Engine):
            self.preemptions = Preemptions(
                client=client,
                engine=engine,
                events=self.events,
                victim_pod=self._own_bound_pod,
                release=self.cache.release,
                place_now=lambda pod: self._schedule([(pod.metadata.uid, pod)]),
                retry=self.queue.cluster_changed,
                spawn=lambda coro: self._spawn(coro, self._chores),
                preempt=config.preemption,
                moves=MoveBudget(consolidation.max_moves_per_minute, now=time.monotonic())
                if consolidation.enabled
                else None,
            )

    # -- running ------------------------------------------------------------------------------------------

    @property
    def probe_port(self) -> int:
        return self.runner.probe_port

    def is_leader(self) -> bool:
        return self.runner.is_leader()

    def _binding_burst(self) -> bool:
        """Binds in flight, or one finished within ``EVENTS_SETTLE_S``: the Events wait (EventRecorder)."""
        return bool(self._binds) or time.monotonic() - self._last_bound < EVENTS_SETTLE_S

    @property
    def synced(self) -> bool:
        return self.runner.synced and self.queue_directory.synced

    async def wait_scheduling(self, timeout: float | None = None) -> None:
        """Wait until this replica leads and has started placing pods (for callers and tests)."""
        await self.runner.wait_working(timeout=timeout)

    async def run(self) -> None:
        await self.runner.run()

    async def _drain(self) -> None:
        """At shutdown, after placing stopped and before the lease is released: binds in flight finish
        (bounded by the grace period), then the chores stop."""
        if self._binds:
            _, pending = await asyncio.wait(set(self._binds), timeout=self._shutdown_grace)
            if pending:
                log.warning(
                    "%d binds did not finish before shutdown; the next leader cleans them", len(pending)
                )
            await cancel(*pending)
        await cancel(*self._chores)

    async def _lead(self) -> None:
        await self.queue_directory.wait_synced()
        log.info(
            "informers synced: %d managed nodes (and %d other nodes as topology domains), %d pods booked, "
            "%d pending; placing pods as leader %s",
            len(self.cache.nodes),
            len(self.cache.topology_nodes),
            len(self.cache),
            len(self.queue),
            self.identity,
        )
        window = self.config.batch_window_ms / 1000.0
        while True:
            batch = await self.queue.next_batch(window=window, max_batch=self.config.max_batch)
            if not self.is_leader():
                for key, pod in batch:
                    self.queue.add(key, pod, queue=self.queue_directory.queue_of(pod))
                await asyncio.sleep(self.config.leader_election.retry_period_s)
                continue
            self._schedule(batch)
            await asyncio.sleep(0)  # let binds and the watch run between batches

    # -- placing ------------------------------------------------------------------------------------------

    def _schedule(self, batch: list[tuple[str, Pod]]) -> None:
        """One scheduling cycle: read and filter each pod, place the batch, bind or report each pod."""
        if self.preemptions is not None:
            self.preemptions.new_cycle()
        todo: list[tuple[PendingPod, Pod, PodGpuRequest]] = []
        for uid, queued in batch:
            pod = self.pods.store.get(object_key(queued))
            if pod is None or pod.metadata.uid != uid:
                continue  # deleted (or replaced by a new pod of the same name) since it was queued
            if (pod.spec and pod.spec.nodeName) or uid in self.cache or uid in self._in_flight:
                continue
            if scheduling_gates(pod):
                # Not placed until its gates are gone; removing one is a spec update, which queues it.
                self.queue.remove(uid)
                continue
            try:
                if stale_binding_keys(pod.metadata.annotations or {}):
                    self._in_flight.add(uid)
                    self._spawn(self._clean(uid, pod), self._chores)
                    continue
                prepared = self._prepare(pod)
            except Exception as error:
                self._failed_on(pod, error, doing="reading")
                continue
            if isinstance(prepared, str):
                self._unschedulable(pod, prepared)
            else:
                todo.append((prepared[0], pod, prepared[1]))
        if not todo:
            return
        self.metrics.batches.observe(len(todo))
        singles: list[tuple[PendingPod, Pod, PodGpuRequest]] = []
        gangs: dict[GangKey, list[tuple[PendingPod, Pod, PodGpuRequest]]] = {}
        for entry in todo:
            key = gang_of(entry[1])
            if key is None:
                singles.append(entry)
            else:
                gangs.setdefault(key, []).append(entry)
        for (pending, pod, gpu), decision in zip(singles, self._decide(singles), strict=True):
            self._apply(pending, pod, gpu, decision)
        for key, members in gangs.items():
            self._schedule_gang(key, members)

    def _apply(
        self,
        pending: PendingPod,
        pod: Pod,
        gpu: PodGpuRequest,
        decision: Decision | BaseException,
        *,
        gang: GangKey | None = None,
        note: str = "",
    ) -> None:
        """Bind a placed pod (the cache booked it), or report why not, after the post-filter and
        preemption had their say."""
        plan = self._claim_plans.pop(pending.uid, None)
        if isinstance(decision, Placement):
            claims: _ClaimBind | None = None
            if plan is not None:
                try:
                    decision, claims = self._claim_shares(pending, decision, plan)
                except ValueError as error:
                    if self.cache.forget(pending.uid):
                        self.queue.cluster_changed()
                    self._unschedulable(pod, str(error))
                    return
                gpu = PodGpuRequest()  # the GPUs are the claims'; the pod gets no annotations
            self._in_flight.add(pending.uid)
            self._spawn(self._bind(pod, gpu, decision, claims=claims), self._binds)
        elif isinstance(decision, BaseException):
            self._failed_on(pod, decision, doing="placing")
        elif gang is not None:
            self._unschedulable(pod, f"gang {gang}: {decision.message}{note}")
        elif self._post_filter is not None and self._post_filter.post_filter(
            pending, pod, decision, self.cache
        ):
            self.queue.park(pod.metadata.uid, pod, queue=pending.queue)
        elif self.preemptions is not None:
            message = self.preemptions.consider(pending, pod, decision)
            if message is None:  # this cycle's search budget is spent: a later cycle searches for it
                self.queue.defer(pending.uid, pod, queue=pending.queue, delay_s=self.preemptions.deferral_s())
            else:
                self._unschedulable(pod, message)
        else:
            self._unschedulable(pod, decision.message)

    def _schedule_gang(self, key: GangKey, batch: list[tuple[PendingPod, Pod, PodGpuRequest]]) -> None:
        """Place a gang's pending members in one statement, at least minMember minus those running."""
        members = list(batch)
        seen = {pending.uid for pending, _, _ in batch}
        for pod in self.pods.store:
            uid = pod.metadata.uid
            if uid in seen or uid in self.cache or uid in self._in_flight or (pod.spec and pod.spec.nodeName):
                continue
            if pod.metadata.deletionTimestamp is None and gang_of(pod) == key:
                prepared = self._prepare(pod)
                if isinstance(prepared, str):
                    self._unschedulable(pod, prepared)
                else:
                    members.append((prepared[0], pod, prepared[1]))
        spec = self.gangs.spec(key)
        if spec is None:
            for _, pod, _ in members:
                self.queue.park(pod.metadata.uid, pod, queue=self.queue_directory.queue_of(pod))
            return
        if isinstance(spec, str):
            for _, pod, _ in members:
                self._unschedulable(pod, spec)
            return
        running = sum(1 for booking in self.cache if gang_of(booking.pod) == key)
        need = max(0, spec.min_member - running)
        if len(members) < need:
            waited, first_time = self.gangs.waited(key)
            message = (
                f"waiting for gang {key}: {running + len(members)} of its minMember {spec.min_member} pods "
                f"exist ({running} placed)"
            )
            if self.gangs.timed_out(key):
                message = f"gang {key} timed out after {waited:.0f}s, {message}"
            for _, pod, _ in members:
                if first_time:
                    self.events.emit(regarding=_ref(pod), type=WARNING, reason="GangTimeout", message=message)
                self._unschedulable(pod, message)
            return
        try:
            decisions: list[Decision | BaseException] = list(
                self.cache.place([m[0] for m in members], [m[1] for m in members], gang=True, min_member=need)
            )
        except Exception as error:
            decisions = [error] * len(members)
        note: str | None = ""
        if any(isinstance(d, Placement) for d in decisions):
            self.gangs.placed(key)
        elif self.preemptions is not None and all(isinstance(d, Unschedulable) for d in decisions):
            try:
                note = self.preemptions.consider_gang(str(key), [(m[0], m[1]) for m in members], need)
            except Exception:  # a failed search must not cost the members their report
                log.exception("preemption search for gang %s failed", key)
            if note is None:  # this cycle's search budget is spent: a later cycle searches for it
                delay = self.preemptions.deferral_s()
                for pending, pod, _ in members:
                    self.queue.defer(pending.uid, pod, queue=pending.queue, delay_s=delay)
                return
        for (pending, pod, gpu), decision in zip(members, decisions, strict=True):
            self._apply(pending, pod, gpu, decision, gang=key, note=note)

    def _claim_shares(
        self, pending: PendingPod, placement: Placement, plan: ClaimPlan
    ) -> tuple[Placement, _ClaimBind]:
        """A placed claim pod: its shares become its claims' allocations, held at once in the books
        (assumed until written), and the pod keeps its host resources only. Raises ValueError when the
        node does not publish a chosen GPU as a device (its slice lags its inventory)."""
        node = placement.node
        spec, published = self.cache.nodes[node], self._published.get(node)
        allocations: dict[str, dict[str, Any]] = {}
        if plan.to_allocate:
            if published is None:
                raise ValueError(f"node {node} publishes no ResourceSlice of driver {keys.DRA_DRIVER_NAME}")
            for claim in plan.to_allocate:
                allocations[claim.claim.metadata.uid] = allocation(
                    claim, placement=placement, node=spec, published=published
                )
        for claim in plan.to_allocate:
            body = claim.claim.to_dict()
            body["status"] = {
                **(body.get("status") or {}),
                "allocation": allocations[claim.claim.metadata.uid],
            }
            self.cache.hold_claim(body, node=node, assumed=True)
        host = Placement(pod_uid=placement.pod_uid, node=node, containers=())
        self.cache.rebook(pending.uid, replace(pending, gpu=PodGpuRequest()), host)
        return host, _ClaimBind(plan, allocations)

    def _own_bound_pod(self, uid: str) -> Pod | None:
        """The pod of a booked uid if this scheduler placed it (only such pods may be preempted)."""
        booking = self.cache.booking(uid)
        if booking is None or booking.pod.spec is None:
            return None
        return booking.pod if booking.pod.spec.schedulerName == self.config.scheduler_name else None

    def _prepare(self, pod: Pod) -> tuple[PendingPod, PodGpuRequest] | str:
        """The engine's view of a pending pod, or the sentence that says why it cannot be placed as is."""
        refused = self.queue_directory.refusal(pod)
        if refused is not None:
            return refused
        try:
            gpu = gpu_request(pod)
        except InvalidPodRequest as error:
            return str(error)
        refused = refused_fields(pod, dra=self.config.dra)
        if refused is not None:
            return refused
        node_terms: list[tuple[NodeSelectorTerm, ...]] = []
        mode_policy = self._mode_policy
        plan: ClaimPlan | None = None
        if pod.spec and pod.spec.resourceClaims:
            planned = self._plan_claims(pod, gpu)
            if isinstance(planned, str):
                return planned
            plan = planned
            gpu = PodGpuRequest(containers=tuple(share.gpu for share in plan.shares))
            # A claim's class names its mode: no fallback to the other one.
            mode_policy = ModePolicy.REQUIRED
            nodes = [plan.node] if plan.node is not None else sorted(plan.nodes) if plan.shares else []
            if nodes:
                node_terms.append(
                    (
                        NodeSelectorTerm(
                            (NodeSelectorRequirement(keys.HOSTNAME_LABEL, SelectorOperator.IN, tuple(nodes)),)
                        ),
                    )
                )
        self._arrivals += 1
        try:
            pending = pending_pod(
                pod,
                gpu=gpu,
                arrival=self._arrivals,
                default_queue=self.queue_directory.default_for,
                mode_policy=mode_policy,
                volume_terms=volume_terms(
                    pod,
                    claim=lambda ns, name: self.claims.store.get(f"{ns}/{name}"),
                    volume=self.volumes.store.get,
                )
                + node_terms,
            )
        except RefusedPod as error:
            return str(error)
        for pod_filter in self._filters:
            narrowed = pod_filter.narrow(pending, pod, self.cache)
            if isinstance(narrowed, str):
                return narrowed
            pending = narrowed
        if plan is not None:
            self._claim_plans[pending.uid] = plan
        else:
            self._claim_plans.pop(pending.uid, None)
        return pending, gpu

    def _plan_claims(self, pod: Pod, gpu: PodGpuRequest) -> ClaimPlan | str:
        if gpu.wants_gpu:
            return (
                "spec.resourceClaims and a GPU request in annotations or nvidia.com/gpu: a pod gets its GPUs "
                "one way; use claims or the gpufrac annotations, not both"
            )
        claims = self.resource_claims
        assert claims is not None  # refused_fields refuses claims when DRA is off
        return plan_claims(
            pod,
            claim=lambda ns, name: claims.store.get(f"{ns}/{name}"),
            classes=self._classes,
            published=self._published,
        )

    def _decide(self, todo: list[tuple[PendingPod, Pod, PodGpuRequest]]) -> list[Decision | BaseException]:
        """The decisions for the batch, each Placement booked as assumed; if the engine fails on the
        batch, each pod is placed on its own so that the failure stays with the pod that causes it (the
        engine undoes a failed batch, see ``Statement``)."""
        pods = [pending for pending, _, _ in todo]
        try:
            return list(self.cache.place(pods, [pod for _, pod, _ in todo]))
        except Exception:
            log.exception("placing a batch of %d pods failed; placing them one at a time", len(pods))
        decisions: list[Decision | BaseException] = []
        for pending, pod, _ in todo:
            try:
                decisions.extend(self.cache.place([pending], [pod]))
            except Exception as error:
                decisions.append(error)
        return decisions

    def _failed_on(self, pod: Pod, error: BaseException, *, doing: str) -> None:
        """An unexpected error on one pod: logged with its traceback and reported on the pod."""
        meta = pod.metadata
        log.error(
            "%s pod %s/%s failed unexpectedly",
            doing,
            meta.namespace,
            meta.name,
            exc_info=error,
            extra={"pod": f"{meta.namespace}/{meta.name}"},
        )
        text = f"{type(error).__name__}: {error}"
        if len(text) > _ERROR_TEXT_MAX:
            text = text[: _ERROR_TEXT_MAX - 3] + "..."
        self._unschedulable(
            pod,
            f"the scheduler failed {doing} this pod ({text}); it is tried again when the cluster changes",
            reason=SCHEDULER_ERROR,
        )

    async def _bind(
        self, pod: Pod, gpu: PodGpuRequest, placement: Placement, *, claims: _ClaimBind | None = None
    ) -> None:
        uid = pod.metadata.uid
        try:
            async with self._bind_gate:
                result = None
                if claims is not None:
                    result = await self._write_claims(pod, claims)
                if result is None:
                    result = await self.binder.bind(pod, request=gpu, placement=placement)
        finally:
            self._in_flight.discard(uid)
        self._after_bind(pod, placement, result)

    async def _write_claims(self, pod: Pod, claims: _ClaimBind) -> BindResult | None:
        """Write a claim pod's allocations and reservations (None: all landed, bind the pod)."""
        landed, error = await self.claim_writer.write(
            pod, claims=claims.plan.claims, allocations=claims.allocations
        )
        for claim_uid in claims.allocations:
            if self.cache.claim_written(claim_uid, landed=claim_uid in landed):
                self.queue.cluster_changed()
        if error is None:
            return None
        return BindResult(Outcome.FAILED, error, "claim")

    def _after_bind(self, pod: Pod, placement: Placement, result: BindResult) -> None:
        uid, meta = pod.metadata.uid, pod.metadata
        if result.outcome is Outcome.BOUND:
            self.cache.finish_binding(uid)
            self.bound_total += 1
            self._last_bound = time.monotonic()
            self.metrics.attempts.labels("scheduled").inc()
            seen = self._first_seen.pop(uid, None)
            if seen is not None:
                self.metrics.e2e_latency.observe(time.monotonic() - seen)
            self.queue.forget_failures(uid)
            self._reported.pop(uid, None)
            gpus = ", ".join(u for c in placement.containers for u in c.uuids)
            self.events.emit(
                regarding=_ref(pod),
                type=NORMAL,
                reason="Scheduled",
                message=f"Successfully assigned {meta.namespace}/{meta.name} to {placement.node}"
                + (f" with GPUs {gpus}" if gpus else ""),
                yields=True,
            )
            return
        if self.cache.forget(uid):
            self.queue.cluster_changed()
        if result.outcome is Outcome.UNWRITABLE:
            self._unschedulable(pod, result.detail)
            return
        if result.outcome in (Outcome.GONE, Outcome.BOUND_ELSEWHERE):
            if result.outcome is Outcome.GONE:
                self.queue.remove(uid)
            return
        if result.error_reason:
            self.metrics.bind_errors.labels(result.error_reason).inc()
        self.metrics.attempts.labels("error").inc()
        latest = self.pods.store.get(object_key(pod))
        if latest is None or latest.metadata.uid != uid or (latest.spec and latest.spec.nodeName):
            return
        delay = self.queue.back_off(uid, latest, queue=self.queue_directory.queue_of(latest))
        log.info(
            "binding %s/%s to %s failed (%s: %s); retrying in %.1fs",
            meta.namespace,
            meta.name,
            placement.node,
            result.outcome.value,
            result.detail,
            delay,
            extra={"pod": f"{meta.namespace}/{meta.name}", "node": placement.node},
        )
        if result.outcome is Outcome.FAILED:
            self.events.emit(
                regarding=_ref(pod),
                type=WARNING,
                reason="FailedBinding",
                message=result.detail or "bind failed",
            )

    async def _clean(self, uid: str, pod: Pod) -> None:
        try:
            result = await self.binder.clean_stale(pod)
        finally:
            self._in_flight.discard(uid)
        latest = self.pods.store.get(object_key(pod))
        if result.outcome is Outcome.GONE or latest is None or latest.metadata.uid != uid:
            return
        if result.outcome is Outcome.CLEANED:
            self.queue.add(uid, latest, queue=self.queue_directory.queue_of(latest))
        else:
            self.queue.back_off(uid, latest, queue=self.queue_directory.queue_of(latest))

    def _unschedulable(self, pod: Pod, message: str, *, reason: str = UNSCHEDULABLE) -> None:
        uid, meta = pod.metadata.uid, pod.metadata
        self.metrics.attempts.labels("unschedulable" if reason == UNSCHEDULABLE else "error").inc()
        self.queue.park(uid, pod, queue=self.queue_directory.queue_of(pod))
        status, current = _condition(pod, "PodScheduled")
        if self._reported.get(uid) == message and status == "False" and current == message:
            return
        self._reported[uid] = message
        log.info(
            "pod %s/%s is unschedulable: %s",
            meta.namespace,
            meta.name,
            message,
            extra={"pod": f"{meta.namespace}/{meta.name}"},
        )
        self.events.emit(regarding=_ref(pod), type=WARNING, reason="FailedScheduling", message=message)
        self._spawn(self._report_unschedulable(pod, message, reason=reason), self._chores)

    async def _report_unschedulable(self, pod: Pod, message: str, *, reason: str) -> None:
        if not self.is_leader():
            return
        try:
            await set_pod_condition(
                self._client,
                name=pod.metadata.name,
                namespace=pod.metadata.namespace,
                type="PodScheduled",
                status="False",
                reason=reason,
                message=message,
                # The pod as this report saw it: a bind (or any change) since wins, and the pod is
                # judged again from its newer self if it is still pending.
                resource_version=pod.metadata.resourceVersion,
            )
        except Conflict:
            log.debug(
                "pod %s/%s changed since; its report is dropped", pod.metadata.namespace, pod.metadata.name
            )
        except Exception as error:  # a report is best effort; the pod stays parked either way
            log.warning(
                "could not set PodScheduled on %s/%s: %s", pod.metadata.namespace, pod.metadata.name, error
            )

    def _spawn(self, coro: Coroutine[Any, Any, None], group: set[asyncio.Task[None]]) -> None:
        task = asyncio.create_task(coro)
        group.add(task)
        task.add_done_callback(self._task_done(group))

    @staticmethod
    def _task_done(group: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            group.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("background task failed", exc_info=task.exception())

        return done

    # -- informer handlers (synchronous: memory only) -----------------------------------------------------

    def _pod_changed(self, old: Pod | None, pod: Pod) -> None:
        if pod.spec and pod.spec.nodeName:
            self.queue.remove(pod.metadata.uid)
            if self.cache.confirm(pod):
                self.queue.cluster_changed()
            if pod.metadata.deletionTimestamp is not None and self.preemptions is not None:
                self.preemptions.leaving(pod.metadata.uid)
            return
        uid = pod.metadata.uid
        if pod.metadata.deletionTimestamp is not None:
            self.queue.remove(uid)
            return
        if uid in self._in_flight or uid in self.cache:
            return  # its own bind (or clean) is writing it
        self._nominated(pod)
        queue = self.queue_directory.queue_of(pod)
        if old is None or uid not in self.queue or _meaningful_change(old, pod):
            self._first_seen.setdefault(uid, time.monotonic())
            self.queue.add(uid, pod, queue=queue)
        else:
            self.queue.update(uid, pod)

    def _nominated(self, pod: Pod) -> None:
        """Hold room on the node a preemptor nominated for this pending pod (status.nominatedNodeName)."""
        node = (pod.status.nominatedNodeName if pod.status else None) or None
        meta = pod.metadata
        engine = self.cache.engine
        if node is None:
            if engine.drop_nomination(meta.uid):
                self.queue.cluster_changed()  # the room it held is free
            return
        try:
            pending = pending_pod(
                pod,
                gpu=gpu_request(pod),
                arrival=0,
                default_queue=self.queue_directory.default_for,
                mode_policy=self._mode_policy,
            )
        except Exception as error:  # its own scheduling attempt reports the problem
            log.debug("not holding room for %s/%s: %s", meta.namespace, meta.name, error)
            return
        engine.nominate(pending, node)

    def _namespace_labels(self, name: str) -> dict[str, str] | None:
        namespace = self.namespaces.store.get(name)
        return None if namespace is None else dict(namespace.metadata.labels or {})

    def _namespace_changed(self, old: Namespace | None, namespace: Namespace) -> None:
        self.cache.engine.set_namespace(namespace.metadata.name, dict(namespace.metadata.labels or {}))
        # Labels choose a namespace's default queue and which queues it may use, as well as affinity.
        if old is None or old.metadata.labels != namespace.metadata.labels:
            self.queue.cluster_changed()

    def _storage_changed(self, *objects: Any) -> None:
        """A claim, volume or namespace changed: pods waiting on one may fit now."""
        self.queue.cluster_changed()

    def _resource_claim_changed(self, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        self.cache.claim_changed(claim)
        self.queue.cluster_changed()  # a claim created, allocated or freed: pods waiting on it may go

    def _resource_claim_deleted(self, claim: ResourceClaim) -> None:
        self.cache.release_claim(claim.metadata.uid)
        self.queue.cluster_changed()

    def _device_class_changed(self, old: DeviceClass | None, device_class: DeviceClass) -> None:
        self._classes[device_class.metadata.name] = driver_class(device_class)
        self.queue.cluster_changed()

    def _device_class_deleted(self, device_class: DeviceClass) -> None:
        self._classes.pop(device_class.metadata.name, None)
        self.queue.cluster_changed()

    def _slices_changed(self, *objects: Any) -> None:
        assert self.resource_slices is not None
        self._published = published_nodes(self.resource_slices.store)
        self.queue.cluster_changed()

    def _foreign_changed(self, old: Pod | None, pod: Pod) -> None:
        # A pod counted on an unmanaged node that a waiting pod's affinity or spread counts wakes the
        # parked pods (kube-scheduler's queueing hints do as much).
        if pod.spec and pod.spec.nodeName and self.cache.confirm(pod):
            self.queue.cluster_changed()

    def _pod_deleted(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if self.cache.engine.drop_nomination(uid):
            self.queue.cluster_changed()
        self.queue.remove(uid)
        self._first_seen.pop(uid, None)
        self._reported.pop(uid, None)
        self._claim_plans.pop(uid, None)
        if self.preemptions is not None and self.preemptions.deleted(uid):
            return  # a victim: its room stays booked until its preemptor takes it
        if self.cache.remove(pod):
            self.queue.cluster_changed()

    def _node_changed(self, old: Node | None, node: Node) -> None:
        self._observe_heartbeat(node)

    def _observe_heartbeat(self, node: Node) -> None:
        """The node's heartbeat (its Lease's or its condition's, the newer) observed; the node re-set."""
        loop = asyncio.get_running_loop()
        name = node.metadata.name
        lease = self.leases.store.get(f"{self.config.node_lease_namespace}/{name}")
        stamp = latest_heartbeat(lease_renewed(lease) if lease is not None else None, agent_heartbeat(node))
        expires = self._heartbeats.observe(name, stamp, now=loop.time(), wall_now=datetime.now(UTC))
        if expires < self._heartbeat_due:
            self._heartbeat_wake.set()
        self._set_node(node, now=loop.time())

    def _lease_changed(self, old: Lease | None, lease: Lease) -> None:
        node = self.nodes.store.get(lease.metadata.name)
        if node is not None:
            self._observe_heartbeat(node)

    def _lease_deleted(self, lease: Lease) -> None:
        self._lease_changed(None, lease)

    def _set_node(self, node: Node, *, now: float) -> None:
        name = node.metadata.name
        expired = self._heartbeats.expired(name, now=now)
        spec = node_spec(node, agent_heartbeat_expired=expired)
        previous = self.cache.nodes.get(name)
        if expired and (previous is None or not previous.agent_heartbeat_expired):
            log.warning(
                "node %s: the node agent's heartbeat expired (last %s, expiry %.0fs); no new pods go there "
                "until it resumes",
                name,
                self._heartbeats.last_seen(name) or "never",
                self._heartbeats.expiry_s,
                extra={"node": name},
            )
        elif previous is not None and previous.agent_heartbeat_expired and not expired:
            log.info("node %s: the node agent's heartbeat resumed", name, extra={"node": name})
        if self.cache.set_node(spec).changed:
            self.queue.cluster_changed()

    def _node_deleted(self, node: Node) -> None:
        name = node.metadata.name
        self._heartbeats.forget(name)
        self.cache.remove_node(name)
        # No longer managed (its label went) but still a node: a topology domain from now on.
        still = self.topology_nodes.store.get(name)
        if still is not None and self.cache.set_topology_node(topology_node_spec(still)):
            self.queue.cluster_changed()

    def _topology_node_changed(self, old: NodeTopology | None, node: NodeTopology) -> None:
        # A managed node is the managed informer's (the cache ignores it here); one that has just become
        # managed is dropped as a topology node when that informer adds it.
        if self.cache.set_topology_node(topology_node_spec(node)):
            self.queue.cluster_changed()

    def _topology_node_deleted(self, node: NodeTopology) -> None:
        if self.cache.remove_topology_node(node.metadata.name):
            self.queue.cluster_changed()

    async def _expire_heartbeats(self) -> None:
        """Re-evaluate nodes when their agents' heartbeats expire: time passing is no API event."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for name, spec in list(self.cache.nodes.items()):
                if spec.agent_heartbeat_expired != self._heartbeats.expired(name, now=now):
                    node = self.nodes.store.get(name)
                    if node is not None:
                        self._set_node(node, now=now)
            due = self._heartbeats.next_expiry(now=now)
            self._heartbeat_due = math.inf if due is None else due
            self._heartbeat_wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(None if due is None else due):
                    await self._heartbeat_wake.wait()

    async def _expire_bookings(self) -> None:
        """Release bound bookings whose confirmation never came (see the booking cache)."""
        while True:
            await asyncio.sleep(_EXPIRY_CHECK_S)
            if self.cache.expire():
                self.queue.cluster_changed()

    # -- metrics ------------------------------------------------------------------------------------------

    def _gpu_allocations(self) -> Iterable[GpuAllocation]:
        engine = self.cache.engine
        for node in engine.node_names:
            for ledger in engine.ledger(node):
                yield GpuAllocation(
                    node=node,
                    gpu=ledger.uuid,
                    index=ledger.index,
                    capacity_mib=ledger.capacity_mib,
                    request_mib=ledger.capacity_mib - ledger.free_mib,
                    limit_mib=ledger.limit_sum_mib,
                )


def _ref(pod: Pod) -> ObjectRef:
    meta = pod.metadata
    return ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid or "")


def build_service(
    *, client: AsyncClient, config: SchedulerConfig, identity: str | None = None
) -> SchedulerService:
    """A service with the placement engine its configuration describes (the simulator's engine)."""
    from gpufrac.scheduler.placement_engine import build_engine

    return SchedulerService(client=client, config=config, engine=build_engine(config), identity=identity)


__all__ = [
    "COMPONENT",
    "LeadershipLost",
    "PodFilter",
    "PostFilter",
    "SchedulerService",
    "build_service",
]
