"""``Queue`` status: what each queue holds, asks for, deserves and should hold, written by the leader.

The numbers are the ones reclaim decides with (``Engine.queue_shares``, one tree, one capacity, one
fair share): the engine's books as they will be (pods leaving gone, nominees held) and the scheduling
queue's waiting pods as demand. A waiting pod's request in MiB is resolved against the largest GPU of
the cluster when it asks for a portion (where it will run is not known yet); an exclusive request asks
for whole GPUs (and their memory). A waiting pod that cannot join the queue it names (unknown, or a parent) is
no demand on any queue.

With time-based fair share on (``time_fairness.k`` > 0) each pass first ticks the usage history
(``gpufrac.scheduler.queue_usage``) on every replica, leader or not, and the status gains
``historicalUsage``; a scheduler that writes no status (``interval`` 0) still ticks it every
``TICK_S`` seconds.

Writes are rate-limited: one pass every ``interval`` seconds, and a pass patches only the queues whose
status differs from what the API server has (the informer's copy), so a quiet cluster costs no writes.
Only the leader writes, and only our own ``Queue`` objects: a KAI queue's status is KAI's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.errors import ContractError
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.patch import merge_patch
from gpufrac.placement.model import Queue, QueueResource
from gpufrac.placement.queue_shares import Amount, QueueAmount, QueueShares, request_amount
from gpufrac.scheduler.config import TimeFairnessConfig
from gpufrac.scheduler.objects import gpu_request
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.queue_usage import STATUS_FIELD, QueueUsageClock
from gpufrac.scheduler.queues import RESOURCE_FIELDS, GpufracQueue, QueueDirectory

log = logging.getLogger(__name__)

RESOURCES = tuple(QueueResource)
#: How often the usage history is sampled when no status is written.
TICK_S = 5.0
STATUS_KEYS = ("allocated", "requested", "deserved", "fairShare")


@dataclass(frozen=True, slots=True)
class Capacity:
    """The cluster's GPUs as fair share divides them."""

    gpu_memory_mib: int
    gpus: int
    largest_gpu_mib: int

    def of(self, resource: QueueResource) -> int:
        return self.gpu_memory_mib if resource is QueueResource.GPU_MEMORY else self.gpus


def engine_capacity(engine: PlacementEngine) -> Capacity:
    """The GPUs of every node the engine knows."""
    total_mib, gpus, largest_mib = engine.gpu_capacity()
    return Capacity(gpu_memory_mib=total_mib, gpus=gpus, largest_gpu_mib=largest_mib)


def waiting_besides(
    engine: PlacementEngine, asks: Iterable[tuple[str, QueueAmount]], skip: Container[str]
) -> list[QueueAmount]:
    """The demand of ``asks`` (``QueueStatus.waiting_asks``) but a nominee's or a pod's of ``skip``
    (its queue counts it as held already)."""
    return [ask for uid, ask in asks if uid not in skip and not engine.nominated(uid)]


def pod_demand(pod: Pod, *, largest_gpu_mib: int) -> Amount | None:
    """What a waiting pod asks for; None for a pod whose request is invalid."""
    try:
        request = gpu_request(pod)
    except ContractError:
        return None
    return request_amount(request, largest_gpu_mib)


def queue_statuses(*, queues: Iterable[Queue], shares: QueueShares) -> dict[str, dict[str, dict[str, int]]]:
    """The status of every queue: ``allocated`` and ``requested`` (its subtree's), ``deserved`` and
    ``fairShare``, each per resource field (``gpuMemory``, ``gpus``); fair share rounded down. The
    numbers are the ones reclaim decides with: pods leaving are gone, nominees held."""
    return {
        q.name: {
            "allocated": {RESOURCE_FIELDS[r]: shares.allocated(q.name, r) for r in RESOURCES},
            "requested": {RESOURCE_FIELDS[r]: shares.requested(q.name, r) for r in RESOURCES},
            "deserved": {RESOURCE_FIELDS[r]: shares.deserved(q.name, r) for r in RESOURCES},
            "fairShare": {RESOURCE_FIELDS[r]: shares.fair_share(q.name, r) for r in RESOURCES},
        }
        for q in queues
    }


class QueueStatusWriter:
    """See the module docstring. ``passes`` counts completed passes (tests wait on it)."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        directory: QueueDirectory,
        engine: Callable[[], PlacementEngine],
        leaving: Callable[[], Iterable[str]],
        planned: Callable[[], dict[str, QueueAmount]],
        waiting: Callable[[], Iterable[tuple[str, Pod]]],
        is_leader: Callable[[], bool],
        interval: float,
        time_fairness: TimeFairnessConfig | None = None,
    ) -> None:
        self._client = client
        self._directory = directory
        self._engine = engine
        self._leaving = leaving
        self._planned = planned
        self._waiting = waiting
        self._is_leader = is_leader
        self._interval = interval
        self.usage = QueueUsageClock(time_fairness or TimeFairnessConfig())
        self.passes = 0
        self.writes = 0
        # A waiting pod's demand by uid, for its resourceVersion and the largest GPU it was resolved
        # against: a pass re-reads only pods that changed (tens of thousands may wait).
        self._demands: dict[str, tuple[tuple[str, int], Amount | None]] = {}

    def waiting_demand(
        self, skip: Container[str] = frozenset(), also: Iterable[Pod] = ()
    ) -> list[QueueAmount]:
        """What the pods still waiting ask for, per queue: not a pod its queue refuses (no demand on
        it), nor a nominee or a pod of ``skip`` (its queue counts it as held already). ``also``: pods
        out of the scheduling queue for the cycle that is placing them, waiting all the same."""
        return waiting_besides(self._engine(), self.waiting_asks(also), skip)

    def waiting_asks(self, also: Iterable[Pod] = ()) -> list[tuple[str, QueueAmount]]:
        """(uid, demand) of every waiting pod (and of ``also``) that may join its queue, nominees
        included (``waiting_besides`` leaves them out): what ``waiting_demand`` reads, the costly part
        (each pod's queue and access), for a caller that asks often while nothing it reads changes."""
        engine = self._engine()
        capacity = engine_capacity(engine)
        out: list[tuple[str, QueueAmount]] = []
        demands: dict[str, tuple[tuple[str, int], Amount | None]] = {}
        cycle = [(self._directory.queue_of(pod), pod) for pod in also]
        for queue, pod in [*self._waiting(), *cycle]:
            uid = pod.metadata.uid or ""
            if uid in demands:
                continue
            if self._directory.refusal(pod) is not None:
                continue
            version = (pod.metadata.resourceVersion or "", capacity.largest_gpu_mib)
            known = self._demands.get(uid)
            demand = known[1] if known is not None and known[0] == version else None
            if known is None or known[0] != version:
                demand = pod_demand(pod, largest_gpu_mib=capacity.largest_gpu_mib)
            demands[uid] = (version, demand)
            if demand is not None:
                out.append((uid, QueueAmount(queue, demand)))
        self._demands = demands
        return out

    def shares(self) -> QueueShares:
        """The queues as the books will be, with the waiting pods' demand."""
        planned = self._planned()
        return self._engine().queue_shares(
            leaving=self._leaving(), waiting=self.waiting_demand(set(planned)), nominees=planned
        )

    def statuses(self) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = dict(
            queue_statuses(queues=self._directory.queues(), shares=self.shares())
        )
        if self.usage.enabled:
            for name, status in out.items():
                status[STATUS_FIELD] = self.usage.status(name)
        return out

    @property
    def needed(self) -> bool:
        """Whether ``run`` has work: writing status, or ticking the usage history."""
        return self._interval > 0 or self.usage.enabled

    def tick_usage(self) -> None:
        """Sample the books into the usage history, seeded first from our Queue objects' status once
        they are listed (a pass before that waits: a sample would make the seed too late)."""
        if not self.usage.enabled:
            return
        ours = self._directory.ours
        if not ours.synced:
            return
        engine = self._engine()
        known = engine_capacity(engine)
        capacity = {r: known.of(r) for r in RESOURCES}
        self.usage.seed(list(ours.informer.store) if ours.installed else [], capacity)
        self.usage.tick(engine, capacity)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval or TICK_S)
            try:
                self.tick_usage()
            except Exception:  # the history is best effort; the next pass samples again
                log.exception("sampling queue usage failed")
            if self._interval > 0 and self._is_leader() and self._directory.ours.installed:
                try:
                    await self.write_once()
                except Exception:  # one failed pass must not stop the next
                    log.exception("writing queue status failed")
            self.passes += 1

    async def write_once(self) -> int:
        """Patch the status of every ``Queue`` object whose status changed; returns how many."""
        if not len(self._directory.ours.informer.store):
            return 0
        statuses = self.statuses()
        written = 0
        for obj in list(self._directory.ours.informer.store):
            name = obj.metadata.name
            desired = statuses.get(name)
            if desired is None or _current(obj, desired) == desired:
                continue
            try:
                await merge_patch(self._client, GpufracQueue.Status, name=name, patch={"status": desired})
            except NotFound:
                continue  # deleted since the informer saw it
            except KubeError as error:
                log.warning("could not write the status of queue %s: %s", name, error)
                continue
            written += 1
        self.writes += written
        return written


def _current(obj: Any, desired: dict[str, Any]) -> dict[str, Any]:
    status = obj.status or {}
    return {key: status.get(key) for key in (*STATUS_KEYS, *(k for k in desired if k not in STATUS_KEYS))}
