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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.errors import ContractError
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.patch import merge_patch
from gpufrac.placement.model import Queue, QueueResource
from gpufrac.placement.queue_shares import Amount, QueueAmount, QueueShares, request_amount
from gpufrac.placement.queue_tally import count
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


#: What a waiting pod's answer was read from (``QueueStatusWriter.waiting_asks``), and the answer: its
#: demand on its queue, or None (refused, or an invalid request).
Answer = tuple[tuple[Any, ...], QueueAmount | None]


class WaitingAsks:
    """(uid, demand) of the waiting pods (``QueueStatusWriter.waiting_asks``), with their sums per queue:
    the demand besides a few pods (nominees, an open plan's) is the sums less theirs, a look at those
    few, not at every waiting pod again after each filed plan. Iterating gives the pairs."""

    def __init__(self, asks: Iterable[tuple[str, QueueAmount]] = ()) -> None:
        pairs = list(asks)
        by_uid: dict[str, list[QueueAmount]] = {}
        totals: dict[str, list[int]] = {}
        for uid, ask in pairs:
            by_uid.setdefault(uid, []).append(ask)
            count(totals, ask, 1)
        self._pairs: Callable[[], Iterator[tuple[str, QueueAmount]]] = lambda: iter(pairs)
        self._of: Callable[[str], Iterable[QueueAmount]] = lambda uid: by_uid.get(uid, ())
        self._totals = totals

    @classmethod
    def kept(cls, answers: Mapping[str, Answer], totals: Mapping[str, list[int]]) -> WaitingAsks:
        """The asks of ``answers`` by uid, whose sums per queue ``totals`` are (copied)."""
        view = cls()
        view._pairs = lambda: ((uid, ask) for uid, (_, ask) in answers.items() if ask is not None)
        view._of = lambda uid: (
            () if (answer := answers.get(uid)) is None or answer[1] is None else (answer[1],)
        )
        view._totals = {queue: list(total) for queue, total in totals.items() if total[2]}
        return view

    def __iter__(self) -> Iterator[tuple[str, QueueAmount]]:
        return self._pairs()

    def besides(self, engine: PlacementEngine, skip: Iterable[str]) -> list[QueueAmount]:
        """The demand per queue but a nominee's or a pod's of ``skip`` (its queue counts it as held
        already): one entry a queue with a pod left, as the pods' own entries would sum."""
        totals = {queue: list(total) for queue, total in self._totals.items()}
        for uid in {*skip, *engine.nominated_uids()}:
            for ask in self._of(uid):
                count(totals, ask, -1)
        return [QueueAmount(queue, Amount(mib, gpus)) for queue, (mib, gpus, pods) in totals.items() if pods]


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
        planned: Callable[[], Mapping[str, QueueAmount]],
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
        # A waiting pod's ask by uid (None: refused, or an invalid request), for what it was read from
        # (``waiting_asks``): a pass re-reads only pods that changed (tens of thousands may wait).
        self._answers: dict[str, Answer] = {}
        self._totals: dict[str, list[int]] = {}  # their asks' sums: queue -> [MiB, whole GPUs, pods]
        # Each namespace's labels as last read, and a version bumped when they change.
        self._namespaces: dict[str, tuple[int, dict[str, str]]] = {}

    def waiting_demand(
        self, skip: Iterable[str] = frozenset(), also: Iterable[Pod] = ()
    ) -> list[QueueAmount]:
        """What the pods still waiting ask for, per queue: not a pod its queue refuses (no demand on
        it), nor a nominee or a pod of ``skip`` (its queue counts it as held already). ``also``: pods
        out of the scheduling queue for the cycle that is placing them, waiting all the same."""
        return self.waiting_asks(also).besides(self._engine(), skip)

    def waiting_asks(self, also: Iterable[Pod] = ()) -> WaitingAsks:
        """(uid, demand) of every waiting pod (and of ``also``) that may join its queue, nominees
        included (``WaitingAsks.besides`` leaves them out): what ``waiting_demand`` reads, for a caller
        that asks often while nothing it reads changes. Each pod's answer (its queue's refusal, its
        demand) is kept across calls and read again only when the pod changed (its resourceVersion),
        its queue, the queues (``QueueDirectory.epoch``), its namespace's labels or the largest GPU
        did: thousands of pods wait in a preemption burst, and their refusals were most of the cost."""
        engine = self._engine()
        largest = engine_capacity(engine).largest_gpu_mib
        epoch = self._directory.epoch
        namespaces: dict[str, int] = {}
        known_answers, totals = self._answers, self._totals
        answers: dict[str, Answer] = {}
        cycle = [(self._directory.queue_of(pod), pod) for pod in also]
        for queue, pod in [*self._waiting(), *cycle]:
            meta = pod.metadata
            uid = meta.uid or ""
            if uid in answers:
                continue
            namespace = meta.namespace or ""
            labels = namespaces.get(namespace)
            if labels is None:
                labels = namespaces[namespace] = self._labels_version(namespace)
            version = meta.resourceVersion
            key = (version, queue, epoch, labels, largest)
            known = known_answers.get(uid)
            if version and known is not None and known[0] == key:
                answers[uid] = known
                continue
            ask = self._ask(queue, pod, largest)
            answers[uid] = (key, ask)
            if known is not None and known[1] is not None:
                count(totals, known[1], -1)
            if ask is not None:
                count(totals, ask, 1)
        for uid in known_answers.keys() - answers.keys():  # bound, deleted: waiting no more
            if (gone := known_answers[uid][1]) is not None:
                count(totals, gone, -1)
        self._answers = answers
        # Only the namespaces with a pod waiting now: no kept answer refers to another's version, and
        # the namespaces a cluster creates and deletes over months are not remembered for ever.
        self._namespaces = {name: self._namespaces[name] for name in namespaces}
        return WaitingAsks.kept(answers, totals)

    def _ask(self, queue: str, pod: Pod, largest_gpu_mib: int) -> QueueAmount | None:
        """``pod``'s demand on ``queue``; None when its queue refuses it or its request is invalid."""
        if self._directory.refusal(pod) is not None:
            return None
        demand = pod_demand(pod, largest_gpu_mib=largest_gpu_mib)
        return None if demand is None else QueueAmount(queue, demand)

    def _labels_version(self, namespace: str) -> int:
        """A number that changes when ``namespace``'s labels (what a queue's access reads) do."""
        labels = dict(self._directory.namespace_labels(namespace) or {})
        seen = self._namespaces.get(namespace)
        if seen is None or seen[1] != labels:
            seen = self._namespaces[namespace] = ((seen[0] + 1) if seen else 0, labels)
        return seen[0]

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
