"""The scheduler service: informers -> queue -> engine -> binder, with a Lease deciding who binds.

State. Three informers feed one engine: our pods (``spec.schedulerName`` = ours), other schedulers' pods
already bound (they take cpu, memory, pod slots, host ports and other resources on managed nodes, their
labels and anti-affinity count for affinity and spread, and GPUs if they carry the contract) and managed
nodes. Three more read what some pod fields refer to: namespaces (labels, for ``namespaceSelector``),
claims and volumes (a bound volume's node affinity); ``pod_fields`` says which fields are honoured.
Every replica keeps the engine current from the moment it starts, leader or not, so a standby takes
over with warm ledgers. At start-up the ledgers are rebuilt from what the API says: every bound pod is
booked from its annotations as the informers list it, before anything is placed (the scheduling loop
waits for every informer to sync). Nothing about placements is kept anywhere
else, so a restart never double-books a GPU.

Assumed pods. A placement is held in the engine the moment it is decided, so the next batch sees it
without waiting for the watch; the bind runs in the background. The watch later confirms the pod bound
(the held placement is kept as is) or the bind fails (the placement is released and the pod retried with
backoff). A pod held but not yet confirmed is never queued again, whatever events its own bind causes.

Unschedulable pods get PodScheduled=False with the engine's counted reasons (or the contract's sentence
for an invalid request, or the queue's name when the pod names a queue that is not configured) and a
FailedScheduling Event, written only when the message changes, and wait until the cluster changes: a
node added or changed, a pod released. One pod never stops the others: an unexpected error while reading
or placing a pod is logged and reported on that pod (PodScheduled=False, reason SchedulerError), and the
loop goes on.

Node agents prove they are alive by re-writing their condition (a heartbeat). A node whose heartbeat is
older than ``node_heartbeat_expiry_s`` takes no new pods; since an expiry is time passing and not an API
event, a timer re-evaluates nodes as their heartbeats expire (``gpufrac.scheduler.heartbeat``), and a
heartbeat that resumes is a Node update like any other.

Shutdown order matters: stop placing, let binds in flight finish (bounded), then release the lease, so a
successor never places while this replica still writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Namespace, Node, PersistentVolume, PersistentVolumeClaim, Pod

from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from gpufrac.kube.informer import Informer, object_key
from gpufrac.kube.lease import LeaderElector, LeadershipLost, LeaseTiming
from gpufrac.kube.patch import set_pod_condition
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.placement.decision import Decision, Placement
from gpufrac.placement.model import ModePolicy, NodeSpec, PendingPod
from gpufrac.process.probes import ProbeServer
from gpufrac.scheduler.binder import Binder, BindMode, BindResult, Outcome, stale_binding_keys
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.heartbeat import AgentHeartbeats
from gpufrac.scheduler.metrics import GpuAllocation, SchedulerMetrics, StateReaders
from gpufrac.scheduler.objects import (
    agent_heartbeat,
    bound_placement,
    gpu_request,
    host_request,
    node_spec,
    pending_pod,
    pod_queue,
    queue_label,
)
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.pod_fields import RefusedPod, refused_fields, scheduling_gates, volume_terms
from gpufrac.scheduler.scheduling_queue import SchedulingQueue

log = logging.getLogger(__name__)

COMPONENT = "gpufrac-scheduler"

#: PodScheduled reasons: no node fits (or the pod's request cannot be placed as written), and the
#: scheduler itself failed on the pod (kube-scheduler's two reasons).
UNSCHEDULABLE = "Unschedulable"
SCHEDULER_ERROR = "SchedulerError"

#: How much of an unexpected error's text goes into a pod's condition.
_ERROR_TEXT_MAX = 300


@dataclass(slots=True)
class _Held:
    """A pod whose placement the engine holds: ``bound`` once the API shows it on ``node``."""

    pod: Pod
    node: str
    bound: bool


def default_identity() -> str:
    return f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


def _meaningful_change(old: Pod, new: Pod) -> bool:
    """A change a user made (spec, labels, annotations), not a status write."""
    return (
        old.spec != new.spec
        or old.metadata.annotations != new.metadata.annotations
        or old.metadata.labels != new.metadata.labels
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
    ) -> None:
        self.config = config
        self.identity = identity or default_identity()
        self._client = client
        self._engine = engine
        self._shutdown_grace = shutdown_grace
        self._mode_policy = ModePolicy(config.mode_policy)
        self._specs: dict[str, NodeSpec] = {}  # before the metrics: their collector reads it at once
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
        self.pods.add_handler(_Handler(changed=self._pod_changed, deleted=self._pod_deleted))
        self.foreign_pods.add_handler(_Handler(changed=self._foreign_changed, deleted=self._pod_deleted))
        self.nodes.add_handler(_Handler(changed=self._node_changed, deleted=self._node_deleted))
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
        self.namespaces.add_handler(_Handler(changed=self._namespace_changed, deleted=self._storage_changed))
        self.claims.add_handler(_Handler(changed=self._storage_changed, deleted=self._storage_changed))
        self.volumes.add_handler(_Handler(changed=self._storage_changed, deleted=self._storage_changed))

        election = config.leader_election
        self.elector: LeaderElector | None = None
        self._lease_client: AsyncClient | None = None
        self._owns_lease_client = False
        if election.enabled:
            # Its own connection pool, as kube-scheduler does: a renew must never queue behind a burst
            # of binds for a free connection, or a busy leader loses its lease for being busy.
            self._lease_client = lease_client or AsyncClient(
                config=client.config, timeout=httpx2.Timeout(5.0)
            )
            self._owns_lease_client = lease_client is None
            self.elector = LeaderElector(
                client=self._lease_client,
                name=election.lease_name,
                namespace=election.lease_namespace,
                identity=self.identity,
                timing=LeaseTiming(
                    lease_duration=election.lease_duration_s,
                    renew_deadline=election.renew_deadline_s,
                    retry_period=election.retry_period_s,
                ),
            )
        self.events = EventRecorder(client=client, component=COMPONENT, instance=self.identity)
        self.binder = Binder(
            client=client,
            fence=self.is_leader,
            device_style=config.device_names,
            mode=BindMode(config.bind_mode),
        )
        self.queue: SchedulingQueue[Pod] = SchedulingQueue(
            backoff_initial=config.backoff_initial_s,
            backoff_max=config.backoff_max_s,
            unschedulable_resync=config.unschedulable_resync_s,
        )
        self.metrics = SchedulerMetrics()
        self.metrics.watch_state(
            StateReaders(
                pending_by_queue=self.queue.pending_by_queue,
                gpu_allocations=self._gpu_allocations,
                is_leader=self.is_leader,
                informer_relists=lambda: {i.name: i.relists for i in self._informers},
                heartbeat_expired_nodes=lambda: sum(
                    1 for spec in self._specs.values() if spec.agent_heartbeat_expired
                ),
            )
        )
        self._probes = ProbeServer(
            host=config.http_host,
            port=config.http_port,
            registry=self.metrics.registry,
            healthy=self._healthy,
            ready=self._ready,
        )
        self._bind_gate = asyncio.Semaphore(config.bind_concurrency)
        self._queue_names = frozenset(q.name for q in config.queues)
        self._heartbeats = AgentHeartbeats(expiry_s=config.node_heartbeat_expiry_s)
        self._heartbeat_wake = asyncio.Event()
        self._heartbeat_due = math.inf

        self._gpu_mib: dict[str, int] = {}
        self._held: dict[str, _Held] = {}
        self._on_node: dict[str, set[str]] = {}
        self._waiting_for_node: dict[str, dict[str, Pod]] = {}
        self._in_flight: set[str] = set()
        self._first_seen: dict[str, float] = {}
        self._reported: dict[str, str] = {}
        self._arrivals = 0
        self._binds: set[asyncio.Task[None]] = set()
        self._chores: set[asyncio.Task[None]] = set()
        self._scheduling = False
        self._started = False
        self._failed: BaseException | None = None
        self.bound_total = 0

    # -- running ------------------------------------------------------------------------------------------

    @property
    def _informers(self) -> tuple[Informer[Any], ...]:
        return (self.pods, self.foreign_pods, self.nodes, self.namespaces, self.claims, self.volumes)

    @property
    def probe_port(self) -> int:
        return self._probes.port

    def is_leader(self) -> bool:
        return self.elector is None or self.elector.is_leader

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self._informers)

    async def wait_scheduling(self, timeout: float | None = None) -> None:
        """Wait until this replica leads and has started placing pods (for callers and tests)."""

        async def poll() -> None:
            while not self._scheduling:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(poll(), timeout=timeout)

    async def run(self) -> None:
        await self._probes.start()
        self._started = True
        log.info(
            "scheduler %s starting as %s; probes and metrics on port %d",
            self.config.scheduler_name,
            self.identity,
            self._probes.port,
        )
        background = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self._informers]
        background.append(asyncio.create_task(self.events.run(), name="events"))
        background.append(asyncio.create_task(self._expire_heartbeats(), name="heartbeats"))
        elector = asyncio.create_task(self.elector.run(), name="lease") if self.elector else None
        lead = asyncio.create_task(self._lead(), name="schedule")
        watched = [*background, lead, *([elector] if elector else [])]
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
            raise RuntimeError(f"task {next(iter(done)).get_name()} ended unexpectedly")
        except BaseException as error:
            if not isinstance(error, asyncio.CancelledError):
                self._failed = error
            raise
        finally:
            # 1. stop placing; 2. let binds in flight finish; 3. only then give up the lease, so a
            # successor never places pods while this replica still writes; 4. the rest.
            self._scheduling = False
            await _cancel(lead)
            await self._drain_binds()
            await _cancel(*self._chores)
            if elector is not None:
                await _cancel(elector)
            await _cancel(*background)
            await self._probes.stop()
            if self._lease_client is not None and self._owns_lease_client:
                await self._lease_client.close()
            log.info("scheduler %s stopped", self.identity)

    async def _drain_binds(self) -> None:
        if self._binds:
            _, pending = await asyncio.wait(set(self._binds), timeout=self._shutdown_grace)
            if pending:
                log.warning(
                    "%d binds did not finish before shutdown; the next leader cleans them", len(pending)
                )
            await _cancel(*pending)

    async def _lead(self) -> None:
        for informer in self._informers:
            await informer.synced.wait()
        log.info(
            "informers synced: %d managed nodes, %d pods booked, %d pending",
            len(self._specs),
            len(self._held),
            len(self.queue),
        )
        if self.elector is not None:
            await self.elector.leading.wait()
        self._scheduling = True
        log.info("placing pods as leader %s", self.identity)
        window = self.config.batch_window_ms / 1000.0
        while True:
            batch = await self.queue.next_batch(window=window, max_batch=self.config.max_batch)
            if not self.is_leader():
                for key, pod in batch:
                    self.queue.add(key, pod, queue=pod_queue(pod, default=self.config.default_queue))
                await asyncio.sleep(self.config.leader_election.retry_period_s)
                continue
            self._schedule(batch)
            await asyncio.sleep(0)  # let binds and the watch run between batches

    def _healthy(self) -> tuple[bool, str]:
        if self._failed is not None:
            return False, f"failed: {self._failed}"
        return self._started, "running" if self._started else "starting"

    def _ready(self) -> tuple[bool, str]:
        if not self.synced:
            return False, "informers not synced"
        if self._scheduling:
            return True, "leading"
        return True, "standby (synced)"

    # -- placing ------------------------------------------------------------------------------------------

    def _schedule(self, batch: list[tuple[str, Pod]]) -> None:
        todo: list[tuple[PendingPod, Pod, PodGpuRequest]] = []
        for uid, queued in batch:
            pod = self.pods.store.get(object_key(queued))
            if pod is None or pod.metadata.uid != uid:
                continue  # deleted (or replaced by a new pod of the same name) since it was queued
            if (pod.spec and pod.spec.nodeName) or uid in self._held or uid in self._in_flight:
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
        for (pending, pod, gpu), decision in zip(todo, self._decide(todo), strict=True):
            if isinstance(decision, Placement):
                self._book(pod, decision.node, bound=False)
                self._in_flight.add(pending.uid)
                self._spawn(self._bind(pod, gpu, decision), self._binds)
            elif isinstance(decision, BaseException):
                self._failed_on(pod, decision, doing="placing")
            else:
                self._unschedulable(pod, decision.message)

    def _prepare(self, pod: Pod) -> tuple[PendingPod, PodGpuRequest] | str:
        """The engine's view of a pending pod, or the sentence that says why it cannot be placed as is."""
        named = queue_label(pod)
        if named is not None and named[1] not in self._queue_names:
            label, queue = named
            return f"queue {queue} (label {label}) is not configured"
        try:
            gpu = gpu_request(pod)
        except InvalidPodRequest as error:
            return str(error)
        refused = refused_fields(pod)
        if refused is not None:
            return refused
        self._arrivals += 1
        try:
            pending = pending_pod(
                pod,
                gpu=gpu,
                arrival=self._arrivals,
                default_queue=self.config.default_queue,
                mode_policy=self._mode_policy,
                volume_terms=volume_terms(
                    pod,
                    claim=lambda ns, name: self.claims.store.get(f"{ns}/{name}"),
                    volume=self.volumes.store.get,
                ),
            )
        except RefusedPod as error:
            return str(error)
        return pending, gpu

    def _decide(self, todo: list[tuple[PendingPod, Pod, PodGpuRequest]]) -> list[Decision | BaseException]:
        """The engine's decisions for the batch; if the engine fails on the batch, each pod is placed on
        its own so that the failure stays with the pod that causes it (the engine undoes a failed
        batch, see ``Statement``)."""
        pods = [pending for pending, _, _ in todo]
        try:
            return list(self._engine.schedule(pods))
        except Exception:
            log.exception("placing a batch of %d pods failed; placing them one at a time", len(pods))
        decisions: list[Decision | BaseException] = []
        for pending in pods:
            try:
                decisions.extend(self._engine.schedule([pending]))
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

    async def _bind(self, pod: Pod, gpu: PodGpuRequest, placement: Placement) -> None:
        uid = pod.metadata.uid
        try:
            async with self._bind_gate:
                result = await self.binder.bind(pod, request=gpu, placement=placement, gpu_mib=self._gpu_mib)
        finally:
            self._in_flight.discard(uid)
        self._after_bind(pod, placement, result)

    def _after_bind(self, pod: Pod, placement: Placement, result: BindResult) -> None:
        uid, meta = pod.metadata.uid, pod.metadata
        if result.outcome is Outcome.BOUND:
            self.bound_total += 1
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
            )
            return
        self._release_assumed(uid)
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
        delay = self.queue.back_off(uid, latest, queue=pod_queue(latest, default=self.config.default_queue))
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
            self.queue.add(uid, latest, queue=pod_queue(latest, default=self.config.default_queue))
        else:
            self.queue.back_off(uid, latest, queue=pod_queue(latest, default=self.config.default_queue))

    def _unschedulable(self, pod: Pod, message: str, *, reason: str = UNSCHEDULABLE) -> None:
        uid, meta = pod.metadata.uid, pod.metadata
        self.metrics.attempts.labels("unschedulable" if reason == UNSCHEDULABLE else "error").inc()
        self.queue.park(uid, pod, queue=pod_queue(pod, default=self.config.default_queue))
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

    # -- booking ------------------------------------------------------------------------------------------

    def _book(self, pod: Pod, node: str, *, bound: bool) -> None:
        """Record a placement the engine already holds (it just placed it)."""
        uid = pod.metadata.uid
        self._held[uid] = _Held(pod=pod, node=node, bound=bound)
        self._on_node.setdefault(node, set()).add(uid)

    def _hold_bound(self, pod: Pod) -> None:
        """Book a bound pod from its annotations (the engine did not place it, or forgot it)."""
        node = pod.spec.nodeName
        try:
            gpu = gpu_request(pod)
        except Exception as error:  # InvalidPodRequest, or anything else one pod's data may raise
            log.warning(
                "bound pod %s/%s has an invalid GPU request; booking its host resources only: %s",
                pod.metadata.namespace,
                pod.metadata.name,
                error,
            )
            gpu = PodGpuRequest()
        spec = self._specs[node]
        placement = bound_placement(pod, gpu=gpu, gpus_by_uuid={g.uuid: g for g in spec.gpus})
        try:
            pending = pending_pod(
                pod,
                gpu=gpu,
                arrival=0,
                default_queue=self.config.default_queue,
                mode_policy=self._mode_policy,
            )
        except RefusedPod as error:  # a bound pod still takes its resources; its rules cannot be read
            log.warning("bound pod %s/%s: %s", pod.metadata.namespace, pod.metadata.name, error)
            cpu, memory = host_request(pod)
            pending = PendingPod(
                namespace=pod.metadata.namespace,
                name=pod.metadata.name,
                uid=pod.metadata.uid,
                gpu=gpu,
                cpu_milli=cpu,
                memory_bytes=memory,
                labels=dict(pod.metadata.labels or {}),
            )
        try:
            self._engine.assume(pending, placement)
        except ValueError as error:
            log.error(
                "cannot book pod %s/%s on %s: %s", pod.metadata.namespace, pod.metadata.name, node, error
            )
            return
        self._book(pod, node, bound=True)

    def _release(self, uid: str) -> bool:
        held = self._held.pop(uid, None)
        if held is None:
            return False
        self._engine.forget(uid)
        on_node = self._on_node.get(held.node)
        if on_node is not None:
            on_node.discard(uid)
        return True

    def _release_assumed(self, uid: str) -> None:
        held = self._held.get(uid)
        if held is not None and not held.bound:
            self._release(uid)
            self.queue.cluster_changed()

    # -- informer handlers (synchronous: memory only) -----------------------------------------------------

    def _pod_changed(self, old: Pod | None, pod: Pod) -> None:
        if pod.spec and pod.spec.nodeName:
            self.queue.remove(pod.metadata.uid)
            self._observe_bound(pod)
            return
        uid = pod.metadata.uid
        if pod.metadata.deletionTimestamp is not None:
            self.queue.remove(uid)
            return
        if uid in self._in_flight or uid in self._held:
            return  # its own bind (or clean) is writing it
        self._nominated(pod)
        queue = pod_queue(pod, default=self.config.default_queue)
        if old is None or uid not in self.queue or _meaningful_change(old, pod):
            self._first_seen.setdefault(uid, time.monotonic())
            self.queue.add(uid, pod, queue=queue)
        else:
            self.queue.update(uid, pod)

    def _nominated(self, pod: Pod) -> None:
        """Hold room on the node a preemptor nominated for this pending pod (status.nominatedNodeName)."""
        node = (pod.status.nominatedNodeName if pod.status else None) or None
        meta = pod.metadata
        if node is None:
            if self._engine.drop_nomination(meta.uid):
                self.queue.cluster_changed()  # the room it held is free
            return
        try:
            pending = pending_pod(
                pod,
                gpu=gpu_request(pod),
                arrival=0,
                default_queue=self.config.default_queue,
                mode_policy=self._mode_policy,
            )
        except Exception as error:  # its own scheduling attempt reports the problem
            log.debug("not holding room for %s/%s: %s", meta.namespace, meta.name, error)
            return
        self._engine.nominate(pending, node)

    def _namespace_changed(self, old: Namespace | None, namespace: Namespace) -> None:
        self._engine.set_namespace(namespace.metadata.name, dict(namespace.metadata.labels or {}))
        if old is not None and old.metadata.labels != namespace.metadata.labels:
            self.queue.cluster_changed()

    def _storage_changed(self, *objects: Any) -> None:
        """A claim, volume or namespace changed: pods waiting on one may fit now."""
        self.queue.cluster_changed()

    def _foreign_changed(self, old: Pod | None, pod: Pod) -> None:
        if pod.spec and pod.spec.nodeName:
            self._observe_bound(pod)

    def _observe_bound(self, pod: Pod) -> None:
        uid, node = pod.metadata.uid, pod.spec.nodeName
        held = self._held.get(uid)
        if held is not None:
            if held.node == node:
                held.bound, held.pod = True, pod
                return
            self._release(uid)
        if node not in self._specs:
            self._waiting_for_node.setdefault(node, {})[uid] = pod
            return
        self._hold_bound(pod)

    def _pod_deleted(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if self._engine.drop_nomination(uid):
            self.queue.cluster_changed()
        self.queue.remove(uid)
        self._first_seen.pop(uid, None)
        self._reported.pop(uid, None)
        node = pod.spec.nodeName if pod.spec else None
        if node and node in self._waiting_for_node:
            self._waiting_for_node[node].pop(uid, None)
        if self._release(uid):
            self.queue.cluster_changed()

    def _node_changed(self, old: Node | None, node: Node) -> None:
        loop = asyncio.get_running_loop()
        expires = self._heartbeats.observe(
            node.metadata.name, agent_heartbeat(node), now=loop.time(), wall_now=datetime.now(UTC)
        )
        if expires < self._heartbeat_due:
            self._heartbeat_wake.set()
        self._set_node(node, now=loop.time())

    def _set_node(self, node: Node, *, now: float) -> None:
        name = node.metadata.name
        expired = self._heartbeats.expired(name, now=now)
        spec = node_spec(node, agent_heartbeat_expired=expired)
        previous = self._specs.get(spec.name)
        if previous == spec:
            return
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
        if previous is None:
            self._add_node(spec)
        elif previous.gpus == spec.gpus:
            self._engine.update_node(spec)
            self._specs[spec.name] = spec
        else:
            log.info("GPUs of node %s changed; rebooking its pods", spec.name)
            self._drop_node(spec.name)
            self._add_node(spec)
        self.queue.cluster_changed()

    def _node_deleted(self, node: Node) -> None:
        self._heartbeats.forget(node.metadata.name)
        if node.metadata.name in self._specs:
            self._drop_node(node.metadata.name)

    async def _expire_heartbeats(self) -> None:
        """Re-evaluate nodes when their agents' heartbeats expire: time passing is no API event."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for name, spec in list(self._specs.items()):
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

    def _add_node(self, spec: NodeSpec) -> None:
        self._engine.add_node(spec)
        self._specs[spec.name] = spec
        for gpu in spec.gpus:
            self._gpu_mib[gpu.uuid] = gpu.memory_mib
        for pod in self._waiting_for_node.pop(spec.name, {}).values():
            self._hold_bound(pod)

    def _drop_node(self, name: str) -> None:
        """Release every pod on the node (bound ones wait for it to come back) and forget it."""
        waiting = self._waiting_for_node.setdefault(name, {})
        for uid in list(self._on_node.pop(name, set())):
            held = self._held.get(uid)
            if held is not None and held.bound:
                waiting[uid] = held.pod
            self._release(uid)
        spec = self._specs.pop(name)
        for gpu in spec.gpus:
            self._gpu_mib.pop(gpu.uuid, None)
        self._engine.remove_node(name)

    # -- metrics ------------------------------------------------------------------------------------------

    def _gpu_allocations(self) -> Iterable[GpuAllocation]:
        for node in self._engine.node_names:
            for ledger in self._engine.ledger(node):
                yield GpuAllocation(
                    node=node,
                    gpu=ledger.uuid,
                    index=ledger.index,
                    capacity_mib=ledger.capacity_mib,
                    request_mib=ledger.capacity_mib - ledger.free_mib,
                    limit_mib=ledger.limit_sum_mib,
                )


@dataclass(frozen=True, slots=True)
class _Handler:
    """Adapts the informer's three callbacks to (old or None, new) and delete."""

    changed: Callable[[Any, Any], None]
    deleted: Callable[[Any], None]

    def on_add(self, obj: Any) -> None:
        self.changed(None, obj)

    def on_update(self, old: Any, new: Any) -> None:
        self.changed(old, new)

    def on_delete(self, obj: Any) -> None:
        self.deleted(obj)


def _ref(pod: Pod) -> ObjectRef:
    meta = pod.metadata
    return ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid or "")


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def build_service(
    *, client: AsyncClient, config: SchedulerConfig, identity: str | None = None
) -> SchedulerService:
    """A service with the placement engine its configuration describes (the simulator's engine)."""
    from gpufrac.scheduler.placement_engine import build_engine

    return SchedulerService(client=client, config=config, engine=build_engine(config), identity=identity)


__all__ = ["COMPONENT", "LeadershipLost", "SchedulerService", "build_service", "default_identity"]
