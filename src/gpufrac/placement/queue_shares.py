"""One queue tree, one capacity, one share: what each queue holds and should hold, as the books will be.

Reclaim, the queue limits it checks, the order pending pods go in and the ``Queue`` status all read a
``QueueShares``. It is built from the engine's queue book (``QueueBook``: what placed pods hold, per
queue and subtree, in GPU MiB and whole GPUs) and corrected to what the books *will* hold once the
decisions already taken are carried out:

* a pod that is leaving (evicted, or deleted and still terminating) still holds its GPUs in the engine,
  so nothing binds onto memory in use, but it no longer counts for its queue: it is gone;
* a pending pod nominated to a node (a preemptor whose victims are leaving) counts for its queue
  already: the room is being made for it.

Without both, each reclaim decision a cycle apart saw the victim queue still over its share (its
victims were terminating) and the reclaiming queue still under it (its nominees were not placed), and
took another victim from the same queue: five reclaims for five pods emptied one queue far below its
share (issue #36).

The fair share is ``gpufrac.placement.fair_share.fair_shares`` over the same tree and capacity, with a
queue's demand being what it will hold plus what its waiting pods ask for. Reclaim is KAI Scheduler's
(NVIDIA/KAI-Scheduler, ``pkg/scheduler/plugins/proportion/reclaimable/reclaimable.go``): the reclaiming
queue, and each of its ancestors, must stay within its fair share with the pod placed
(``CanReclaimResources``, ``reclaimingQueuesRemainWithinBoundaries``); victims come only from queues
above their fair share. gpufrac is stricter on the victim side than KAI, which lets a queue that is over
its share by less than a pod lose that pod: here what is taken from a queue never exceeds what it holds
over its fair share, at every level of its tree below the level it shares with the reclaimer, so no
reclaim leaves a victim queue below its fair share. When that finds nothing (a whole-GPU pod is more than
its queue's excess), KAI's second strategy is tried (``by_deserved``): a queue within its *deserved*
quota with the pod placed takes back from queues above theirs, never below their deserved quota. The
deserved quota is a guarantee; the over-quota part of a fair share is not (docs/queues.md, "Reclaim").

Both resources count: GPU memory always, whole GPUs where the tree gives any queue a whole-GPU quota
(a deserved amount or a limit; KAI's queues map to whole GPUs). A tree with no whole-GPU terms divides
whole GPUs by weight alone, which would refuse reclaims nobody configured.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpufrac.contract.request import MigRequest, PodGpuRequest
from gpufrac.mig.profiles import MIG_MODELS

from .decision import Placement
from .fair_share import QueueBook, fair_shares
from .model import Queue, QueueResource

RESOURCES = tuple(QueueResource)
FAIR_SHARE = "fair share"
DESERVED = "deserved"


@dataclass(frozen=True, slots=True)
class Amount:
    """GPU memory (MiB) and whole GPUs: what a pod holds or asks for, in both queue resources."""

    mib: int = 0
    gpus: int = 0

    def of(self, resource: QueueResource) -> int:
        return self.mib if resource is QueueResource.GPU_MEMORY else self.gpus

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.mib + other.mib, self.gpus + other.gpus)


@dataclass(frozen=True, slots=True)
class QueueAmount:
    """An ``Amount`` charged to a queue (a leaving pod, a nominee, a waiting pod)."""

    queue: str
    amount: Amount


@dataclass(frozen=True, slots=True)
class Standing:
    """One queue's numbers in one resource, for Events and tools: what it will hold, should hold and
    is guaranteed."""

    queue: str
    allocated: int
    fair_share: int
    deserved: int

    @property
    def over(self) -> int:
        """How far above its fair share (negative: below)."""
        return self.allocated - self.fair_share


class QueueShares:
    """What each queue will hold (``allocated``), should hold (``fair_share``) and may take, in one
    resource or both; built once per decision from the engine's book (see the module docstring).

    ``capacity`` is per resource; ``leaving`` and ``nominated`` correct the book; ``waiting`` is the
    demand of pending pods that are neither placed nor nominated; ``usage`` and ``k``, when given, make
    the fair share time-based (``gpufrac.placement.usage_history``).
    """

    def __init__(
        self,
        book: QueueBook,
        capacity: Mapping[QueueResource, int],
        *,
        leaving: Iterable[QueueAmount] = (),
        nominated: Iterable[QueueAmount] = (),
        waiting: Iterable[QueueAmount] = (),
        usage: Mapping[QueueResource, Mapping[str, float]] | None = None,
        k: float = 0.0,
    ) -> None:
        self._book = book
        self.capacity = {r: int(capacity.get(r, 0)) for r in RESOURCES}
        queues = book.queues
        names = {q.name for q in queues} | set(book.usage) | set(book.whole_gpus)
        self._own: dict[QueueResource, dict[str, int]] = {
            r: {n: book.own(n, r) for n in names} for r in RESOURCES
        }
        self._queues = queues
        self._usage, self._k = usage, k
        #: What reclaim protects and may fill up to: the fair share, or (``by_deserved``) the deserved quota.
        self.bar = FAIR_SHARE
        self.counted = tuple(r for r in RESOURCES if r is QueueResource.GPU_MEMORY or _has_terms(queues, r))
        self._apply(moved=nominated, gone=leaving, asked=waiting)

    def _apply(
        self, *, moved: Iterable[QueueAmount], gone: Iterable[QueueAmount], asked: Iterable[QueueAmount]
    ) -> None:
        """Count ``moved`` as held, ``gone`` as no longer held nor asked for, ``asked`` as demand; then
        the subtree totals and the fair shares again."""
        for entry, sign in [(e, -1) for e in gone] + [(e, 1) for e in moved]:
            for r in RESOURCES:
                own = self._own[r]
                own[entry.queue] = own.get(entry.queue, 0) + sign * entry.amount.of(r)
        self._allocated: dict[QueueResource, dict[str, int]] = {r: {} for r in RESOURCES}
        for r in RESOURCES:
            for name, amount in self._own[r].items():
                for q in self._book.lineage(name):
                    self._allocated[r][q] = self._allocated[r].get(q, 0) + amount
        self._asked = [*getattr(self, "_asked", ()), *asked]
        demand = {r: dict(self._own[r]) for r in RESOURCES}
        for entry in self._asked:
            for r in RESOURCES:
                demand[r][entry.queue] = demand[r].get(entry.queue, 0) + entry.amount.of(r)
        self._demand = demand
        self._shares = {
            r: fair_shares(
                self._queues,
                demand[r],
                self.capacity[r],
                resource=r,
                usage=(self._usage or {}).get(r),
                k=self._k,
            )
            for r in RESOURCES
        }

    def after(self, *, taken: Iterable[QueueAmount] = (), freed: Iterable[QueueAmount] = ()) -> QueueShares:
        """The same books once the pods ``taken`` are placed (moved from waiting to held: demand
        unchanged) and the pods ``freed`` are gone, as a plan for several pods (a gang's members, one
        after the other) must see them: each later member is judged with the earlier ones placed and
        their victims gone. ``self`` is left as it is."""
        view = copy.copy(self)
        view._own = {r: dict(v) for r, v in self._own.items()}
        taken = list(taken)
        negative = [QueueAmount(e.queue, Amount(-e.amount.mib, -e.amount.gpus)) for e in taken]
        view._apply(moved=taken, gone=freed, asked=negative)
        return view

    # -- reading ----------------------------------------------------------------------------------------

    def queue(self, name: str) -> Queue:
        return self._book.get(name)

    def lineage(self, name: str) -> list[str]:
        return self._book.lineage(name)

    def allocated(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> int:
        """What the queue and its subtree will hold (leaving pods gone, nominees placed)."""
        return self._allocated[resource].get(name, 0)

    def fair_share(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> int:
        """The queue's fair share now, rounded down (the unit of ``resource``)."""
        return int(self._shares[resource].get(name, 0.0))

    def deserved(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> int:
        return self._book.get(name).deserved(resource, self.capacity[resource])

    def requested(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> int:
        """What the queue's subtree will hold plus what its waiting pods ask for."""
        return sum(self._demand[resource].get(q, 0) for q in self._subtree(name))

    def by_deserved(self) -> QueueShares:
        """The same books, with reclaim judged against deserved quotas instead of fair shares (KAI's
        second strategy, ``GuaranteeDeservedQuota``: a queue within its deserved quota takes back from
        queues above theirs, down to their deserved quota)."""
        view = copy.copy(self)
        view.bar = DESERVED
        return view

    def share_bar(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> int:
        """What reclaim protects for the queue and lets a reclaimer fill up to (``bar``)."""
        if self.bar == DESERVED:
            return self.deserved(name, resource)
        return self.fair_share(name, resource)

    def standing(self, name: str, resource: QueueResource = QueueResource.GPU_MEMORY) -> Standing:
        return Standing(
            name,
            self.allocated(name, resource),
            self.fair_share(name, resource),
            self.deserved(name, resource),
        )

    def _subtree(self, name: str) -> list[str]:
        return [q for q in self._demand[QueueResource.GPU_MEMORY] if name in self._book.lineage(q)]

    # -- deciding -------------------------------------------------------------------------------------

    def exceeded(
        self, name: str, amount: Amount, *, freed: Iterable[QueueAmount] = ()
    ) -> tuple[str, QueueResource, int] | None:
        """(queue, resource, limit) of the first queue on ``name``'s lineage that ``amount`` more would
        take past its limit, counting nominees, not counting leaving pods nor the victims ``freed``;
        None when none would."""
        after = self._after(name, freed)
        for q in self.lineage(name):
            for r in RESOURCES:
                more = amount.of(r)
                limit = self.queue(q).quota(r).limit
                if more and limit is not None and after[q][r] + more > limit:
                    return q, r, limit
        return None

    def may_reclaim(self, name: str, amount: Amount, *, freed: Iterable[QueueAmount] = ()) -> bool:
        """Whether a pod of queue ``name`` asking ``amount`` may reclaim: with it placed (and the victims
        ``freed`` gone), the queue and each of its ancestors stay within their fair share in every
        counted resource (KAI's ``CanReclaimResources`` and ``reclaimingQueuesRemainWithinBoundaries``)."""
        after = self._after(name, freed)
        for q in self.lineage(name):
            for r in self.counted:
                if after[q][r] + amount.of(r) > self.share_bar(q, r):
                    return False
        return True

    def _after(self, name: str, freed: Iterable[QueueAmount]) -> dict[str, dict[QueueResource, int]]:
        """What each queue on ``name``'s lineage will hold once ``freed`` is gone."""
        path = self.lineage(name)
        after = {q: {r: self.allocated(q, r) for r in RESOURCES} for q in path}
        for entry in freed:
            for q in self.lineage(entry.queue):
                if q in after:
                    for r in RESOURCES:
                        after[q][r] -= entry.amount.of(r)
        return after

    def reclaimable(self, reclaimer: str, victim_queue: str) -> dict[str, dict[QueueResource, int]]:
        """What may be taken from ``victim_queue`` for a pod of ``reclaimer``: per queue on the victim's
        lineage below the level it shares with the reclaimer, per counted resource, how far the queue is
        above its fair share (all of them bound what is taken). Empty when the victim queue is the
        reclaimer's, an ancestor of it, or any queue on that path is not above its share."""
        ours = set(self.lineage(reclaimer))
        path = []
        for q in self.lineage(victim_queue):
            if q in ours:
                break
            path.append(q)
        if not path or victim_queue in ours:
            return {}
        room: dict[str, dict[QueueResource, int]] = {}
        for q in path:
            over = {r: self.allocated(q, r) - self.share_bar(q, r) for r in self.counted}
            if over[QueueResource.GPU_MEMORY] <= 0:
                return {}
            room[q] = {r: max(0, v) for r, v in over.items()}
        return room


def placed_amount(placement: Placement) -> Amount:
    """What a placement books: the guaranteed MiB of every device, and the devices held exclusively."""
    mib = sum(d.request_mib for c in placement.containers for d in c.devices)
    gpus = sum(len(c.devices) for c in placement.containers if c.exclusive)
    return Amount(mib, gpus)


def request_amount(request: PodGpuRequest, gpu_mib: int) -> Amount:
    """What a GPU request asks for on GPUs of ``gpu_mib`` (a portion resolves against it; an exclusive
    device is the whole GPU and one whole GPU; a MIG container its slices, ``mig_request_mib``)."""
    mib = sum(
        mig_request_mib(c.mig) if c.mig is not None else c.request_mib(gpu_mib) * c.device_count
        for c in request.containers
    )
    gpus = sum(c.device_count for c in request.containers if c.exclusive)
    return Amount(mib, gpus)


def mig_request_mib(mig: MigRequest) -> int:
    """The least GPU memory a MIG request books: its size, or its profile's memory on the supported
    model where that profile is smallest (the exact slice is known only where it is placed); per slice
    times the count."""
    if mig.min_mib is not None:
        return mig.min_mib * mig.count
    sizes = [p.memory_mib for m in MIG_MODELS.values() if (p := m.profile(mig.profile or "")) is not None]
    return min(sizes, default=0) * mig.count


def _has_terms(queues: Iterable[Queue], resource: QueueResource) -> bool:
    return any(q.quota(resource).deserved or q.quota(resource).limit is not None for q in queues)


__all__ = ["Amount", "QueueAmount", "QueueShares", "Standing", "placed_amount", "request_amount"]
