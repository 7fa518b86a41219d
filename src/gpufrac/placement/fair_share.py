"""Fair share between queues: which pending pod goes next, whether a queue may take more, and how much of
the cluster each queue should hold (its fair share).

Order: higher priority first; among equal priority, the queue furthest below its fair share of GPU
memory (guaranteed GPU MiB in use / fair share, lowest first; a queue whose fair share is 0 comes last),
compared level by level down the queue tree (first the top-level ancestors' standing, then the next
level's); then earlier arrival. The fair share is the one reclaim and Queue status use
(``gpufrac.placement.queue_shares``), with the batch's pods as demand: KAI Scheduler orders queues by
allocation against fair share likewise (NVIDIA/KAI-Scheduler,
``pkg/scheduler/plugins/proportion/queue_order/queue_order.go``, ``prioritizeUnderUtilized`` first).
The standing of a queue changes as its pods are placed, so the
order is decided one pod at a time: each queue keeps its pods sorted, and the next pod is the best queue
head.

A policy with look-ahead (``Policy.largest_first``) passes ``size``: within a queue and a priority, the
pods of the batch go largest first (then by arrival). The batch holds only pods the scheduler has
already received, so this reorders a burst, never waits for future pods; it is first-fit-decreasing on
the window the scheduler sees anyway.

Queues form a tree (``Queue.parent``). A queue's allocation is what its own pods hold plus what every
queue below it holds, so a limit on a parent caps the sum of its children; a pod is refused when it
would take its own queue or any ancestor past a limit, in either resource.

Fair share (``fair_shares``) is computed per resource, top-down, the way KAI Scheduler divides a
cluster: at each level the siblings first get their deserved quota (never more than they want, nor than
their limit), and what remains of the parent's share goes to the siblings that still want more in
proportion to their over-quota weight, water-filling: a queue that wants less than its weighted part
gets what it wants and the rest is divided again among the others. Queues with weight 0 share only what
no weighted queue wants. A queue "wants" its demand (what its pods hold plus what its pending pods ask
for), capped by its limit and by what its children want. Each queue's share is then divided among its
children the same way. If the deserved quotas of siblings add up to more than the parent has, each gets
the parent's share in proportion to its (capped) deserved amount.

The arithmetic is floating point (it runs on every status pass and in reclaim decisions; exact
fractions made a 100-queue tree seven times slower), so the properties the tests check hold to within a
millionth of a unit: the shares of siblings add up to their parent's share, or to all the siblings want
if that is less (nothing is left idle that someone wants); no queue gets more than its limit or its
demand; more capacity never lowers a share; a queue that wants more never raises the share of a queue
in another top-level tree (in its own tree it can: a parent's part of a scarce capacity grows with what
its children want, and all its children divide it). Callers that need whole units round down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from .model import PendingPod, Queue, QueueResource

#: The name under which a parent queue's own pods (not its children's) compete with its children.
_OWN = "\0own"


class QueueBook:
    """Known queues and what each holds (kept by the engine on place/forget).

    ``usage`` and ``whole_gpus`` are per queue INCLUDING its descendants (a parent holds what its
    children hold); ``own_*`` are what the queue's own pods hold.
    """

    def __init__(self) -> None:
        self._queues: dict[str, Queue] = {}
        self._own_mib: dict[str, int] = {}
        self._own_gpus: dict[str, int] = {}
        self.usage: dict[str, int] = {}
        self.whole_gpus: dict[str, int] = {}

    def set(self, queue: Queue) -> None:
        self._queues[queue.name] = queue
        self._retotal()

    def replace(self, queues: Iterable[Queue]) -> None:
        """The full set of known queues (what is not in ``queues`` is forgotten; its usage is kept)."""
        self._queues = {q.name: q for q in queues}
        self._retotal()

    def get(self, name: str) -> Queue:
        return self._queues.get(name) or Queue(name)

    @property
    def queues(self) -> list[Queue]:
        return list(self._queues.values())

    def lineage(self, name: str) -> list[str]:
        """``name`` and its ancestors, nearest first; stops at an unknown parent or a cycle."""
        chain = [name]
        seen = {name}
        parent = self.get(name).parent
        while parent is not None and parent in self._queues and parent not in seen:
            chain.append(parent)
            seen.add(parent)
            parent = self._queues[parent].parent
        return chain

    def charge(self, name: str, mib: int, gpus: int = 0) -> None:
        self._own_mib[name] = self._own_mib.get(name, 0) + mib
        self._own_gpus[name] = self._own_gpus.get(name, 0) + gpus
        for q in self.lineage(name):
            self.usage[q] = self.usage.get(q, 0) + mib
            self.whole_gpus[q] = self.whole_gpus.get(q, 0) + gpus

    def _retotal(self) -> None:
        """Recompute the subtree totals after the tree changed."""
        self.usage, self.whole_gpus = {}, {}
        for name in set(self._own_mib) | set(self._own_gpus):
            for q in self.lineage(name):
                self.usage[q] = self.usage.get(q, 0) + self._own_mib.get(name, 0)
                self.whole_gpus[q] = self.whole_gpus.get(q, 0) + self._own_gpus.get(name, 0)

    def own(self, name: str, resource: QueueResource) -> int:
        """What the queue's own pods hold (not its children's)."""
        own = self._own_mib if resource is QueueResource.GPU_MEMORY else self._own_gpus
        return own.get(name, 0)

    def allocated(self, name: str, resource: QueueResource) -> int:
        totals = self.usage if resource is QueueResource.GPU_MEMORY else self.whole_gpus
        return totals.get(name, 0)

    def exceeded(
        self, name: str, mib: int, gpus: int = 0, *, held: Mapping[str, tuple[int, int]] | None = None
    ) -> tuple[str, QueueResource, int] | None:
        """(queue, resource, limit) of the first queue on ``name``'s lineage that taking ``mib`` and
        ``gpus`` more would take past a limit; None when none would. ``held``: per queue, (MiB, GPUs)
        promised to pods not booked yet (nominees), counted as allocated."""
        for q in self.lineage(name):
            queue = self.get(q)
            promised = (held or {}).get(q, (0, 0))
            for i, (resource, more) in enumerate(
                ((QueueResource.GPU_MEMORY, mib), (QueueResource.GPUS, gpus))
            ):
                limit = queue.quota(resource).limit
                if more and limit is not None and self.allocated(q, resource) + promised[i] + more > limit:
                    return q, resource, limit
        return None

    def over_limit(self, name: str, mib: int) -> bool:
        return self.exceeded(name, mib) is not None

    def standing_path(self, name: str, fair: Callable[[str], float]) -> tuple[float, ...]:
        """What the queue and each ancestor hold over their fair share (``fair``, per queue), from the
        top-level ancestor down: lower is further below its share, a queue of no share comes last, and
        queues compare level by level, so the children of a parent below its share go before those of
        a parent above it."""
        out = []
        for q in reversed(self.lineage(name)):
            share = fair(q)
            out.append(math.inf if share <= 0 else self.usage.get(q, 0) / share)
        return tuple(out)


def scheduling_order(
    pods: Sequence[PendingPod],
    book: QueueBook,
    fair: Callable[[str], float],
    place: Callable[[int], None],
    *,
    size: Callable[[int], tuple[int, ...]] | None = None,
) -> None:
    """Call ``place(i)`` for every pod index in queue order, re-reading queue standing after each.

    ``fair(queue)`` is the queue's fair share of GPU memory for this batch (its demand includes the
    batch: placing a pod moves it from waiting to held, so the shares stay put while the standing
    moves). ``size(i)``, when given, orders pods of one queue and priority largest first (see module
    docstring).
    """
    heads: dict[str, list[int]] = {}
    for i, pod in enumerate(pods):
        heads.setdefault(pod.queue, []).append(i)
    sizes = {i: tuple(-v for v in size(i)) for i in range(len(pods))} if size else None
    for members in heads.values():
        # Reverse so the next pod is members[-1] (pop from the end is O(1)).
        if sizes is None:
            members.sort(key=lambda i: (-pods[i].priority, pods[i].arrival, i), reverse=True)
        else:
            members.sort(key=lambda i: (-pods[i].priority, sizes[i], pods[i].arrival, i), reverse=True)
    while heads:
        best_queue = min(
            heads,
            key=lambda q: (
                -pods[heads[q][-1]].priority,
                book.standing_path(q, fair),
                pods[heads[q][-1]].arrival,
                heads[q][-1],
            ),
        )
        members = heads[best_queue]
        place(members.pop())
        if not members:
            del heads[best_queue]


# -- fair share ---------------------------------------------------------------------------------------


def fair_shares(
    queues: Iterable[Queue],
    demand: Mapping[str, int],
    capacity: int,
    *,
    resource: QueueResource = QueueResource.GPU_MEMORY,
    usage: Mapping[str, float] | None = None,
    k: float = 0.0,
) -> dict[str, float]:
    """Each queue's fair share of ``capacity`` units of ``resource`` (see the module docstring).

    ``usage`` (per queue, its subtree's historical usage normalized to the cluster's capacity,
    ``gpufrac.placement.usage_history``) and ``k`` > 0 make the share time-based: the over-quota part
    is divided by weights corrected for past use (``_time_weights``); deserved quotas are not touched.

    ``demand`` is per queue, for its OWN pods (held plus pending, in the resource's unit); a parent's
    demand adds its children's. A queue named in ``demand`` but not in ``queues`` is a top-level queue
    with no quota. A queue whose parent is unknown, or that is part of a parent cycle, is top-level.
    Every queue (known or named in ``demand``) gets an entry.
    """
    known = {q.name: q for q in queues}
    for name in demand:
        known.setdefault(name, Queue(name))
    children: dict[str | None, list[str]] = {}
    for name in known:
        children.setdefault(_parent(name, known), []).append(name)
    for members in children.values():
        members.sort()
    wants: dict[str, float] = {}

    def want(name: str) -> float:
        """What the queue's subtree can use: its demand, capped by its limit (bottom-up)."""
        total = float(max(0, demand.get(name, 0)))
        for child in children.get(name, ()):
            total += want(child)
        limit = known[name].quota(resource).limit
        wants[name] = total if limit is None else min(total, float(limit))
        return wants[name]

    for root in children.get(None, ()):
        want(root)
    shares: dict[str, float] = {}

    def divide(parent: str | None, available: float) -> None:
        members = list(children.get(parent, ()))
        terms: dict[str, tuple[float, float, float]] = {}
        for name in members:
            q = known[name]
            quota = q.quota(resource)
            deserved = float(max(0, q.deserved(resource, capacity)))
            terms[name] = (deserved, max(0.0, float(quota.over_quota_weight)), wants[name])
        if parent is not None and demand.get(parent, 0) > 0:
            # The parent's own pods compete with its children as a queue of no quota and weight 1.
            own = float(demand[parent])
            terms[_OWN] = (0.0, 1.0, own)
        past: dict[str, float] | None = None
        if usage and k > 0:
            past = {name: float(usage.get(name, 0.0)) for name in members}
            if _OWN in terms and parent is not None:
                past[_OWN] = max(0.0, float(usage.get(parent, 0.0)) - sum(past.values()))
        given = _water_fill(terms, available, past=past, k=k)
        for name in members:
            shares[name] = given[name]
            divide(name, given[name])

    divide(None, float(max(0, capacity)))
    return shares


def fair_shares_by_resource(
    queues: Iterable[Queue],
    demand: Mapping[QueueResource, Mapping[str, int]],
    capacity: Mapping[QueueResource, int],
) -> dict[QueueResource, dict[str, float]]:
    """``fair_shares`` for each resource in ``capacity``."""
    queues = list(queues)
    return {r: fair_shares(queues, demand.get(r, {}), capacity[r], resource=r) for r in capacity}


def _parent(name: str, known: Mapping[str, Queue]) -> str | None:
    """The queue's parent, or None for a top-level queue (no parent, an unknown one, or a cycle)."""
    parent = known[name].parent
    if parent is None or parent not in known:
        return None
    seen = {name}
    walk: str | None = parent
    while walk is not None and walk in known:
        if walk in seen:
            return None
        seen.add(walk)
        walk = known[walk].parent
    return parent


def _water_fill(
    terms: Mapping[str, tuple[float, float, float]],
    available: float,
    *,
    past: Mapping[str, float] | None = None,
    k: float = 0.0,
) -> dict[str, float]:
    """Divide ``available`` among siblings given (deserved, weight, want) each: deserved first, then the
    rest by weight among those that want more, then what is still left equally among weight-0 ones.
    With ``past`` (historical usage per sibling) the weights of each round are ``_time_weights``."""
    given = {name: min(deserved, want) for name, (deserved, _, want) in terms.items()}
    promised = sum(given.values())
    if promised >= available:
        if promised == 0:
            return dict.fromkeys(terms, 0.0)
        return {name: g * available / promised for name, g in given.items()}
    left = available - promised
    for weighted in (True, False):
        active = {
            name
            for name, (_, weight, want) in terms.items()
            if given[name] < want and ((weight > 0) if weighted else (weight == 0))
        }
        while left > 0 and active:
            weights = {n: terms[n][1] if weighted else 1.0 for n in active}
            if past is not None:
                weights = _time_weights(weights, past, k)
            total = sum(weights.values())
            full = [n for n in active if (terms[n][2] - given[n]) * total <= left * weights[n]]
            if not full:
                for n in active:
                    given[n] += left * weights[n] / total
                left = 0.0
                break
            for n in full:
                left -= terms[n][2] - given[n]
                given[n] = terms[n][2]
                active.discard(n)
    return given


def _time_weights(weights: Mapping[str, float], past: Mapping[str, float], k: float) -> dict[str, float]:
    """KAI Scheduler's time-aware over-quota weights (``time-aware-fairness.md``, "Penalizing queues with
    historical usage"): with ``w`` a queue's weight normalized over the queues still asking in this
    round and ``u`` its historical usage normalized to the cluster's capacity, its portion is
    ``max(w + k * (w - u), 0)``. A queue that used less than its weight gets more, one that used more
    gets less, ``k`` says how much. When every portion is 0 (all used far more than their weight) the
    plain weights divide the round, so nothing wanted is left idle."""
    total = sum(weights.values())
    if total <= 0:
        return dict(weights)
    portions = {}
    for name, weight in weights.items():
        share = weight / total
        portions[name] = max(0.0, share + k * (share - past.get(name, 0.0)))
    if sum(portions.values()) <= 0:
        return dict(weights)
    return portions
