"""The scheduler service: informers -> queue -> scheduling cycle -> binding cycle, with a Lease deciding
who binds. It runs on the controller runner it shares with the operator (``gpufrac.process.controller``:
informers, the lease, probes, the handler adapter and the shutdown order).

The cycle, as ``_schedule`` runs it on each batch the scheduling queue hands out (``cycle_pace`` sizes it):

1. Read (PreFilter). Each pod still pending becomes one ``CycleItem`` (``gpufrac.scheduler.cycle``): its
   queue must be known, its request valid (``gpufrac.contract``) and its fields honoured
   (``pod_fields``); a pod with DRA claims gets its claim plan from the claim front
   (``claim_front``: the claims' requests are its containers, restricted to nodes that publish our
   devices); the ``PodFilter`` s narrow where it may go. A pod that cannot be placed as it is gets the
   sentence that says why; a pod left with keys of an unfinished bind is cleaned first.
2. Place. The booking cache (``booking_cache``, which holds the engine) places the batch and books each
   placement as assumed, so the next batch sees it without waiting for the watch; a gang's members are
   placed all or nothing (``gangs``).
3. Post-filter. A pod that fits nowhere goes to the ``PostFilter`` s: preemption, reclaim and
   consolidation (``preemption``) may make room for it, or defer it to a later cycle.
4. Bind or report. A placed pod goes to the binding cycle (``bind_cycle``: claims first, then the
   binder writes exactly what the engine placed, in the background); any other gets PodScheduled=False
   and a FailedScheduling Event (``status_report``) and waits until the cluster changes. An unexpected
   error on one pod is reported on that pod (reason SchedulerError); the loop goes on.

State. Informers feed the one booking cache: our pods and other schedulers' pods already bound (host
resources, affinity and spread terms, GPUs if they carry the contract), and what some pod fields refer to,
namespaces, PersistentVolumeClaims and volumes (``pod_watch``); nodes and node agents' heartbeats
(``node_watch``); DRA claims of our driver (``claim_front``). Queues come from Queue objects, KAI's Queue
objects and the configuration file (``queues``; docs/queues.md). Every replica keeps the cache current, leader
or not, so a standby takes over with warm books; at start every bound pod is booked from its annotations
before anything is placed (the leader's work waits for every informer to sync). Nothing about placements is
kept anywhere else, so a restart never double-books a GPU.

Shutdown order matters: stop placing, let binds in flight finish (bounded, ``_drain``), then release the
lease, so a successor never places while this replica still writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kube.events import EventRecorder
from gpufrac.kube.informer import object_key
from gpufrac.kube.lease import LeadershipLost, LeaseTiming
from gpufrac.placement.consolidation import MoveBudget
from gpufrac.placement.decision import Decision, Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import ModePolicy, NodeSelectorRequirement, NodeSelectorTerm, SelectorOperator
from gpufrac.process.controller import ControllerRunner, Election, cancel, default_identity
from gpufrac.scheduler.bind_cycle import BackgroundTasks, BindCycle
from gpufrac.scheduler.binder import Binder, BindMode, stale_binding_keys
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claim_front import ClaimBind, ClaimFront
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.cycle import CycleItem, PodFilter, PostFilter, PostFilterResult, PreemptionPostFilter
from gpufrac.scheduler.cycle_pace import CyclePace
from gpufrac.scheduler.gangs import GangKey, Gangs, gang_of
from gpufrac.scheduler.metrics import SchedulerMetrics, StateReaders, gpu_allocations
from gpufrac.scheduler.mig_layouts import MigLayouts
from gpufrac.scheduler.node_watch import NodeWatch
from gpufrac.scheduler.objects import gpu_request, pending_pod
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.pod_fields import RefusedPod, refused_fields, scheduling_gates, volume_terms
from gpufrac.scheduler.pod_watch import PodWatch
from gpufrac.scheduler.preemption import Preemptions
from gpufrac.scheduler.preemption_gates import GateSettings
from gpufrac.scheduler.queue_status import QueueStatusWriter
from gpufrac.scheduler.queues import QueueDirectory
from gpufrac.scheduler.resize import Resizes
from gpufrac.scheduler.scheduling_queue import SchedulingQueue
from gpufrac.scheduler.status_report import StatusReporter

log = logging.getLogger(__name__)

COMPONENT = "gpufrac-scheduler"

#: How often bound bookings are checked for a confirmation that never came.
_EXPIRY_CHECK_S = 1.0

#: Events a burst may leave waiting (one per pod bound); more are dropped and counted.
EVENTS_QUEUE = 10_000


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
        self._shutdown_grace = shutdown_grace
        self._filters = tuple(filters)
        self._mode_policy = ModePolicy(config.mode_policy)
        self._arrivals = 0
        self._pace = CyclePace(max_batch=config.max_batch, budget_s=config.cycle_budget_ms / 1000.0)
        self._chores = BackgroundTasks()
        self.queue: SchedulingQueue[Pod] = SchedulingQueue(
            backoff_initial=config.backoff_initial_s,
            backoff_max=config.backoff_max_s,
            unschedulable_resync=config.unschedulable_resync_s,
        )
        changed = self.queue.cluster_changed
        self.cache = BookingCache(
            engine=engine,
            # A pod without a queue label is in its namespace's default queue (the directory, below).
            default_queue=lambda namespace: self.queue_directory.default_for(namespace),
            mode_policy=self._mode_policy,
            assumed_ttl=config.assumed_ttl_s,
        )
        self.pod_watch = PodWatch(
            client=client,
            scheduler_name=config.scheduler_name,
            cache=self.cache,
            queue=self.queue,
            queue_of=lambda pod: self.queue_directory.queue_of(pod),
            default_queue=lambda namespace: self.queue_directory.default_for(namespace),
            mode_policy=self._mode_policy,
            in_flight=lambda uid: uid in self.binds.in_flight,
            leaving=lambda uid: self.preemptions.leaving(uid) if self.preemptions is not None else None,
            victim_deleted=lambda uid: self.preemptions is not None and self.preemptions.deleted(uid),
            forget=lambda uid: self.report.forget(uid),
            resize=lambda pod, gone: self.resizes.observe(pod, gone=gone),
        )
        self.pods = self.pod_watch.pods
        self.node_watch = NodeWatch(
            client=client,
            cache=self.cache,
            changed=changed,
            node_selector=config.node_selector,
            lease_namespace=config.node_lease_namespace,
            heartbeat_expiry_s=config.node_heartbeat_expiry_s,
            observe=lambda node: self.layouts.observe(node),
        )
        # DRA (docs/dra.md): claims of our driver are allocated here and booked whoever allocated them.
        self.claim_front = (
            ClaimFront(client=client, cache=self.cache, changed=changed, fence=self.is_leader)
            if config.dra
            else None
        )
        # Queues: Queue objects, KAI's queues and the file's, merged into the engine (docs/queues.md).
        self.queue_directory = QueueDirectory(
            client=client,
            config=config,
            apply=engine.set_queues,
            changed=changed,
            namespace_labels=self.pod_watch.namespace_labels,
        )
        self.queue_status = QueueStatusWriter(
            client=client,
            directory=self.queue_directory,
            engine=lambda: self.cache.engine,
            leaving=lambda: self.preemptions.leaving_pods if self.preemptions is not None else (),
            planned=lambda: self.preemptions.planned() if self.preemptions is not None else {},
            waiting=self.queue.waiting,
            is_leader=self.is_leader,
            interval=config.queue_status_interval_s or 0.0,
            time_fairness=config.time_fairness,
        )
        # Scheduled Events wait while a burst is being bound: the API server's CPU goes to binds first.
        self.events = EventRecorder(
            client=client,
            component=COMPONENT,
            instance=self.identity,
            queue_size=EVENTS_QUEUE,
            yield_to=lambda: self.binds.busy(),
        )
        self.metrics = SchedulerMetrics()
        self.resizes = Resizes(
            client=client, cache=self.cache, events=self.events, fence=self.is_leader, changed=changed
        )
        self.resizes.answered = self.metrics.resize_answered
        self.report = StatusReporter(
            client=client,
            events=self.events,
            park=lambda pod: self.queue.park(pod.metadata.uid, pod, queue=self.queue_directory.queue_of(pod)),
            spawn=self._chores.spawn,
            attempts=lambda result: self.metrics.attempts.labels(result).inc(),
            is_leader=self.is_leader,
        )
        self.binds = BindCycle(
            binder=Binder(
                client=client,
                fence=self.is_leader,
                device_style=config.device_names,
                mode=BindMode(config.bind_mode),
            ),
            write_claims=self.claim_front.write if self.claim_front is not None else None,
            cache=self.cache,
            queue=self.queue,
            queue_of=self.queue_directory.queue_of,
            report=self.report,
            metrics=self.metrics,
            latest=self.pod_watch.latest,
            arrived=self.pod_watch.arrived,
            chores=self._chores,
            concurrency=config.bind_concurrency,
        )
        self.gangs = Gangs(client=client, spawn=self._chores.spawn, retry=changed)
        # Preemption, reclaim and consolidation search the engine's own books, so they need the engine.
        self.preemptions: Preemptions | None = None
        consolidation = config.consolidation
        if ((on := consolidation.enabled) or config.preemption) and isinstance(engine, Engine):
            self.preemptions = Preemptions(
                client=client,
                engine=engine,
                events=self.events,
                victim_pod=self._own_bound_pod,
                release=self.cache.release,
                place_now=lambda pod: self._schedule([(pod.metadata.uid, pod)]),
                retry=changed,
                spawn=self._chores.spawn,
                waiting=self.queue_status.waiting_asks,
                preempt=config.preemption,
                moves=MoveBudget(consolidation.max_moves_per_minute, now=time.monotonic()) if on else None,
                gates=GateSettings.of(config),
            )
        self.layouts = MigLayouts.of_service(self, client)  # dynamic MIG layouts (docs/mig.md)
        self._post_filters: tuple[PostFilter, ...] = (
            *((post_filter,) if post_filter is not None else ()),
            self.layouts,
            *((PreemptionPostFilter(self.preemptions),) if self.preemptions is not None else ()),
        )
        self.runner = self._runner(client, config, lease_client)
        self.elector = self.runner.elector
        self.metrics.watch_state(
            StateReaders(
                pending_by_queue=self.queue.pending_by_queue,
                gpu_allocations=lambda: gpu_allocations(self.cache.engine),
                is_leader=self.is_leader,
                informer_relists=lambda: {i.name: i.relists for i in self.runner.informers},
                heartbeat_expired_nodes=self.node_watch.expired_count,
                events_pending=lambda: self.events.pending,
                events_dropped=lambda: self.events.dropped,
                events_failed=lambda: self.events.failed,
            )
        )

    def _runner(
        self, client: AsyncClient, config: SchedulerConfig, lease_client: AsyncClient | None
    ) -> ControllerRunner:
        election = config.leader_election
        return ControllerRunner(
            name=f"scheduler {config.scheduler_name}",
            client=client,
            identity=self.identity,
            informers=(
                *self.pod_watch.informers,
                *self.node_watch.informers,
                *self.pod_watch.field_informers,
                *(self.claim_front.informers if self.claim_front is not None else ()),
            ),
            # The Queue informers start once their CRDs are found: /readyz and the lead wait for them too.
            sources=(self.queue_directory,),
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
                self.node_watch.run,
                self._expire_bookings,
                self.resizes.run,
                *((self.queue_status.run,) if self.queue_status.needed else ()),
            ),
            drain=self._drain,
        )

    # -- running ------------------------------------------------------------------------------------------

    @property
    def probe_port(self) -> int:
        return self.runner.probe_port

    def is_leader(self) -> bool:
        return self.runner.is_leader()

    @property
    def synced(self) -> bool:
        return self.runner.synced

    @property
    def bound_total(self) -> int:
        return self.binds.bound_total

    async def wait_scheduling(self, timeout: float | None = None) -> None:
        """Wait until this replica leads and has started placing pods (for callers and tests)."""
        await self.runner.wait_working(timeout=timeout)

    async def run(self) -> None:
        await self.runner.run()

    async def _drain(self) -> None:
        """At shutdown, after placing stopped and before the lease is released: binds in flight finish
        (bounded by the grace period), then the chores stop."""
        await self.binds.drain(self._shutdown_grace)
        await cancel(*self._chores.tasks)

    async def _lead(self) -> None:
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
            batch = await self.queue.next_batch(window=window, max_batch=self._pace.size)
            if not self.is_leader():
                for key, pod in batch:
                    self.queue.add(key, pod, queue=self.queue_directory.queue_of(pod))
                await asyncio.sleep(self.config.leader_election.retry_period_s)
                continue
            with self._pace.cycle(len(batch)):
                self._schedule(batch)
            await asyncio.sleep(0)  # let binds and the watch run between batches

    # -- the scheduling cycle -----------------------------------------------------------------------------

    def _schedule(self, batch: list[tuple[str, Pod]]) -> None:
        """One scheduling cycle: read and filter each pod, place the batch, bind or report each pod."""
        if self.preemptions is not None:
            self.preemptions.new_cycle(pod for _, pod in batch)
        items: list[CycleItem] = []
        for uid, queued in batch:
            pod = self.pods.store.get(object_key(queued))
            if pod is None or pod.metadata.uid != uid:
                continue  # deleted (or replaced by a new pod of the same name) since it was queued
            if (pod.spec and pod.spec.nodeName) or uid in self.cache or uid in self.binds.in_flight:
                continue
            if scheduling_gates(pod):
                # Not placed until its gates are gone; removing one is a spec update, which queues it.
                self.queue.remove(uid)
                continue
            try:
                if stale_binding_keys(pod.metadata.annotations or {}):
                    self.binds.clean(pod)
                    continue
                item = self._read(pod)
            except Exception as error:
                self.report.failed(pod, error, doing="reading")
                continue
            if isinstance(item, str):
                self.report.unschedulable(pod, item)
            else:
                items.append(item)
        if not items:
            return
        self.metrics.batches.observe(len(items))
        singles: list[CycleItem] = []
        gangs: dict[GangKey, list[CycleItem]] = {}
        for item in items:
            key = gang_of(item.pod)
            if key is None:
                singles.append(item)
            else:
                gangs.setdefault(key, []).append(item)
        for item, decision in zip(singles, self._decide(singles), strict=True):
            self._apply(item, decision)
        for key, members in gangs.items():
            self._schedule_gang(key, members)

    def _read(self, pod: Pod) -> CycleItem | str:
        """The pod as this cycle carries it, or the sentence that says why it cannot be placed as is."""
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
        plan = None
        if pod.spec and pod.spec.resourceClaims:
            assert self.claim_front is not None  # refused_fields refuses claims when DRA is off
            planned = self.claim_front.plan(pod, gpu)
            if isinstance(planned, str):
                return planned
            plan = planned
            gpu = PodGpuRequest(containers=tuple(share.gpu for share in plan.shares))
            # A claim's class names its mode: no fallback to the other one.
            mode_policy = ModePolicy.REQUIRED
            nodes = [plan.node] if plan.node is not None else sorted(plan.nodes) if plan.shares else []
            if nodes:
                requirement = NodeSelectorRequirement(keys.HOSTNAME_LABEL, SelectorOperator.IN, tuple(nodes))
                node_terms.append((NodeSelectorTerm((requirement,)),))
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
                    claim=lambda ns, name: self.pod_watch.claims.store.get(f"{ns}/{name}"),
                    volume=self.pod_watch.volumes.store.get,
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
        # A claim pod's GPUs are its claims': its bind writes no GPU annotations.
        return CycleItem(pending=pending, pod=pod, gpu=PodGpuRequest() if plan else gpu, plan=plan)

    def _decide(self, items: list[CycleItem]) -> list[Decision | BaseException]:
        """The decisions for the batch, each Placement booked as assumed; if the engine fails on the
        batch, each pod is placed on its own so that the failure stays with the pod that causes it (the
        engine undoes a failed batch, see ``Statement``)."""
        try:
            return list(self.cache.place([i.pending for i in items], [i.pod for i in items]))
        except Exception:
            log.exception("placing a batch of %d pods failed; placing them one at a time", len(items))
        decisions: list[Decision | BaseException] = []
        for item in items:
            try:
                decisions.extend(self.cache.place([item.pending], [item.pod]))
            except Exception as error:
                decisions.append(error)
        return decisions

    def _schedule_gang(self, key: GangKey, batch: list[CycleItem]) -> None:
        """Place a gang's pending members in one statement, at least minMember minus those running."""
        members = list(batch)
        seen = {item.uid for item in batch}
        for pod in self.pods.store:
            uid = pod.metadata.uid
            if (
                uid in seen
                or uid in self.cache
                or uid in self.binds.in_flight
                or (pod.spec and pod.spec.nodeName)
            ):
                continue
            if pod.metadata.deletionTimestamp is None and gang_of(pod) == key:
                item = self._read(pod)
                if isinstance(item, str):
                    self.report.unschedulable(pod, item)
                else:
                    members.append(item)
        spec = self.gangs.spec(key)
        if spec is None:
            for item in members:
                self.queue.park(item.uid, item.pod, queue=self.queue_directory.queue_of(item.pod))
            return
        if isinstance(spec, str):
            for item in members:
                self.report.unschedulable(item.pod, spec)
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
            for item in members:
                if first_time:
                    self.report.gang_timeout(item.pod, message)
                self.report.unschedulable(item.pod, message)
            return
        try:
            decisions: list[Decision | BaseException] = list(
                self.cache.place(
                    [m.pending for m in members], [m.pod for m in members], gang=True, min_member=need
                )
            )
        except Exception as error:
            decisions = [error] * len(members)
        note: str | None = ""
        if any(isinstance(d, Placement) for d in decisions):
            self.gangs.placed(key)
        elif self.preemptions is not None and all(isinstance(d, Unschedulable) for d in decisions):
            try:
                note = self.preemptions.consider_gang(str(key), [(m.pending, m.pod) for m in members], need)
            except Exception:  # a failed search must not cost the members their report
                log.exception("preemption search for gang %s failed", key)
            if note is None:  # this cycle's search budget is spent: a later cycle searches for it
                delay = self.preemptions.deferral_s()
                for item in members:
                    self.queue.defer(item.uid, item.pod, queue=item.pending.queue, delay_s=delay)
                return
        for item, decision in zip(members, decisions, strict=True):
            self._apply(item, decision, gang=key, note=note)

    def _apply(
        self,
        item: CycleItem,
        decision: Decision | BaseException,
        *,
        gang: GangKey | None = None,
        note: str = "",
    ) -> None:
        """Bind a placed pod (the cache booked it), or report why not, after the post-filters had their
        say."""
        if isinstance(decision, Placement):
            claims: ClaimBind | None = None
            if item.plan is not None:
                assert self.claim_front is not None
                try:
                    decision, claims = self.claim_front.hold(item.pending, decision, item.plan)
                except ValueError as error:
                    if self.cache.forget(item.uid):
                        self.queue.cluster_changed()
                    self.report.unschedulable(item.pod, str(error))
                    return
            self.binds.start(item.pod, item.gpu, decision, claims)
        elif isinstance(decision, BaseException):
            self.report.failed(item.pod, decision, doing="placing")
        elif gang is not None:
            self.report.unschedulable(item.pod, f"gang {gang}: {decision.message}{note}")
        else:
            self._post_filter(item, decision)

    def _post_filter(self, item: CycleItem, decision: Unschedulable) -> None:
        """Ask the post-filters in turn; the first that answers decides what happens to the pod."""
        for post_filter in self._post_filters:
            result: PostFilterResult | None = post_filter.post_filter(item, decision, self.cache)
            if result is None:
                continue
            if result.report is not None:
                self.report.unschedulable(item.pod, result.report)
            elif result.defer_s is not None:
                self.queue.defer(item.uid, item.pod, queue=item.pending.queue, delay_s=result.defer_s)
            else:
                self.queue.park(item.uid, item.pod, queue=item.pending.queue)
            return
        self.report.unschedulable(item.pod, decision.message)

    # -- what the pieces ask of the service ---------------------------------------------------------------

    def _own_bound_pod(self, uid: str) -> Pod | None:
        """The pod of a booked uid if this scheduler placed it (only such pods may be preempted)."""
        booking = self.cache.booking(uid)
        if booking is None or booking.pod.spec is None:
            return None
        return booking.pod if booking.pod.spec.schedulerName == self.config.scheduler_name else None

    async def _expire_bookings(self) -> None:
        """Release bound bookings whose confirmation never came (see the booking cache)."""
        while True:
            await asyncio.sleep(_EXPIRY_CHECK_S)
            if self.cache.expire():
                self.queue.cluster_changed()


def build_service(
    *, client: AsyncClient, config: SchedulerConfig, identity: str | None = None
) -> SchedulerService:
    """A service with the placement engine its configuration describes (the simulator's engine)."""
    from gpufrac.scheduler.placement_engine import build_engine

    return SchedulerService(client=client, config=config, engine=build_engine(config), identity=identity)


__all__ = ["COMPONENT", "LeadershipLost", "PodFilter", "PostFilter", "SchedulerService", "build_service"]
