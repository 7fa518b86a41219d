"""Victim selection: which placed pods to remove so that a pending pod fits, and where it then goes.

Three uses, one search. **Preemption** inside a queue: pods of the pending pod's queue with a lower
PriorityClass value may be removed, never a pod of another queue, whatever the priority. **Reclaim**
across queues: a queue below its deserved share takes back from queues above theirs, and never pushes a
victim queue below its own share (the victims taken from one queue may add up to at most that queue's
usage over its deserved MiB). **Consolidation**
(``gpufrac.placement.consolidation``): movable pods of no higher priority are moved rather than
removed; its trial also finds each moved pod a new home, so a set is only chosen when all of them have one.

What counts as freed is the pending pod's exact shape, not a MiB total: the search asks the same
filters placement runs (per-GPU memory, compute mode, device count, sm-sharing tenancy, compute
portions, the limit cap, host resources) on hypothetical ledgers, "this node without these pods"
(``PodTable.hypothetical``). Freeing 8 GiB spread over four GPUs is no reclaim for a pod that needs
8 GiB on one GPU, and is never chosen.

The answer is the fewest victims, then the lowest priorities (compared highest first, as
kube-scheduler ranks candidates by their most important victim), then the engine's seeded node order
(the random tie-break placement uses, so that equal choices spread over the cluster rather than pile
on the first node), then, between sets on that node, the least GPU memory taken.

The search is exact: victim sets are tried by size, so the first size with a fitting set is the
fewest. Single victims are tried first, over the whole cluster; then a node is dropped when even all
its eligible victims leaving would not let the pod fit, and sets of 2, 3, ... on the remaining nodes
are generated. Within a size the sets are sorted by the order above and tried a chunk at a time (one
vectorised filter run per chunk), so the first chunk holding a fitting set holds the best one; only as
many sets are sorted as are tried (``_CostOrder``: on a full cluster a reclaim has one single-victim
set per pod of the other queues, and the first chunk usually ends the search). When
the number of sets of the next size would exceed ``budget`` the search stops enumerating and falls
back to a minimal set per node (kube-scheduler's "reprieve": start from all eligible victims and give
back, most important first, each one the pod does not need) on the ``REPRIEVE_NODES`` candidate
nodes with the fewest eligible victims: no victim of the result can be spared, but a smaller set may
exist; docs/scheduler.md says so.

Nothing is decided on the hypothetical ledgers alone: the best set is then simulated on the engine
itself (``simulate``: one ``Engine.statement`` that evicts the victims and places the pod, then is
discarded), and a set after which the engine
would not place the pod on that node (a multi-container pod whose devices cannot be assigned together,
a queue limit) is skipped for the next. The caller gets the placement the engine produced, so it never
evicts for a pod that would not fit after the victims leave.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Protocol

import numpy as np

from gpufrac.contract.request import ComputeMode

from .decision import ContainerPlacement, DeviceAssignment, Placement
from .demand import Demand
from .engine import Engine
from .filters import resource_fit
from .model import PendingPod, QueueResource
from .queue_shares import Amount, QueueAmount, QueueShares, placed_amount, request_amount
from .state import PodTable, Released

DEFAULT_BUDGET = 20_000
"""Most (node, victim set) hypotheses one size may try before the search falls back to reprieve."""

REPRIEVE_NODES = 64
"""How many candidate nodes the fallback computes a minimal set on at a time (the next ones only when
no set of these survives the simulation)."""

_VERIFY_PER_CHUNK = 16
_FIRST_CHUNK = 256


class Kind(StrEnum):
    PREEMPT = "preempt"
    RECLAIM = "reclaim"
    CONSOLIDATE = "consolidate"


class Trial(Protocol):
    """Where the engine would place ``pod`` once ``victims`` are gone (None: nowhere, or the removal is
    not acceptable); the engine must be left exactly as it was. ``simulate`` is the plain one."""

    def __call__(self, engine: Engine, pod: PendingPod, victims: list[str]) -> Placement | None: ...


ShareBook = QueueShares
"""What reclaim and the limit checks read about queues: ``gpufrac.placement.queue_shares.QueueShares``
(the books as they will be, one fair share). Without one, ``find_victims`` builds it from the engine
(``Engine.queue_shares``: its nominees counted, nothing leaving, the pod itself the only waiting one)."""


@dataclass(frozen=True, slots=True)
class _Room:
    """What reclaim may take from the queues below one over-share queue: victims of the queues whose
    ids are in ``ids`` may take at most ``room`` of ``resource`` in all (see ``QueueShares.reclaimable``)."""

    ids: np.ndarray
    resource: QueueResource
    room: int


@dataclass(frozen=True, slots=True)
class Preemption:
    """Remove ``victims`` (pod uids, most important first) from ``node``; the pod then gets
    ``placement`` (what the engine placed in the simulation)."""

    kind: Kind
    node: str
    victims: tuple[str, ...]
    placement: Placement


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Hypotheses: one row per (node, victim set); ``victims`` holds PodTable slots, padded with
    ``PodTable.NOTHING``."""

    nodes: np.ndarray
    victims: np.ndarray


class _Fits(Protocol):
    def __call__(self, c: _Candidates, *, within_slack: bool = True) -> np.ndarray: ...


def eligible_victims(
    engine: Engine,
    pod: PendingPod,
    *,
    kind: Kind,
    shares: ShareBook | None = None,
    exclude: Iterable[str] = (),
) -> tuple[np.ndarray, list[_Room]]:
    """PodTable slots that may be removed for ``pod``, and the rooms the victims taken from over-share
    queues must stay within (reclaim only).

    Preemption: same queue, lower priority. Reclaim: only when the pod's queue (and its ancestors) would
    stay within its fair share with the pod placed; victims from other queues above their fair share,
    each no bigger than what its queue holds over it (``QueueShares.reclaimable``). Consolidation:
    movable pods (``PendingPod.movable``) of any queue whose priority is not higher.
    """
    table = engine.pods
    rooms: list[_Room] = []
    book = None
    if kind is Kind.RECLAIM:
        # The common answer, no reclaim for this pod's queue, before any work on the table's rows.
        book = shares or default_shares(engine, pod)
        if not book.may_reclaim(pod.queue, least_ask(engine, pod)):
            return np.empty(0, dtype=np.int64), rooms
    mask = table.live.copy()
    for uid in exclude:
        slot = table.slot_of.get(uid)
        if slot is not None:
            mask[slot] = False
    if kind is Kind.PREEMPT:
        q = table.known_queue(pod.queue)
        if q is None:
            return np.empty(0, dtype=np.int64), rooms
        mask &= (table.queue == q) & (table.priority < pod.priority)
    elif kind is Kind.CONSOLIDATE:
        mask &= table.movable & (table.priority <= pod.priority)
    else:
        assert book is not None
        allowed = np.zeros(table.rows, dtype=bool)
        under: dict[str, list[int]] = {}  # over-share queue -> ids of the victim queues below it
        bounds: dict[str, dict[QueueResource, int]] = {}
        for q, name in enumerate(table.queue_names):
            path = book.reclaimable(pod.queue, name)
            if not path:
                continue
            for over, room in path.items():
                under.setdefault(over, []).append(q)
                bounds[over] = room
            least = {r: min(room[r] for room in path.values()) for r in book.counted}
            ok = (table.queue == q) & (table.mib <= least[QueueResource.GPU_MEMORY])
            allowed |= ok
        mask &= allowed
        for over, ids in under.items():
            for resource, room in bounds[over].items():
                rooms.append(_Room(np.array(ids, dtype=np.int64), resource, room))
    return np.flatnonzero(mask), rooms


@dataclass(frozen=True, slots=True)
class Eligible:
    """What ``kind`` may take for the pod ``uid`` under each of its strategies (reclaim: the fair share,
    then the deserved quota, as ``find_victims`` tries them): per strategy its book, its slots (sorted,
    unique, nothing excluded yet) and its rooms. Read once for the cheap check (``slots``) and handed to
    ``find_victims``, which would otherwise mask the whole pod table again; valid while the engine is
    unchanged."""

    uid: str
    kind: Kind
    strategies: tuple[tuple[ShareBook, np.ndarray, list[_Room]], ...]

    @property
    def slots(self) -> np.ndarray:
        """The slots of every strategy: empty when there is nobody to take."""
        # Each strategy's slots come sorted and unique (``flatnonzero``): merged only when two have any.
        found = [slots for _, slots, _ in self.strategies if slots.size]
        if len(found) > 1:
            return np.unique(np.concatenate(found))
        return found[0] if found else np.empty(0, dtype=np.int64)


def eligible_by_strategy(
    engine: Engine, pod: PendingPod, *, kind: Kind, shares: ShareBook | None = None
) -> Eligible:
    """``eligible_victims`` for each strategy of ``kind`` (see ``Eligible``)."""
    book = shares or default_shares(engine, pod)
    books = (book, book.by_deserved()) if kind is Kind.RECLAIM else (book,)
    return Eligible(
        pod.uid, kind, tuple((b, *eligible_victims(engine, pod, kind=kind, shares=b)) for b in books)
    )


def any_victims(
    engine: Engine, pod: PendingPod, *, kind: Kind, shares: ShareBook | None = None
) -> np.ndarray:
    """The slots ``kind`` may take for ``pod`` under any of its strategies: the cheap check before a
    search (``eligible_by_strategy(...).slots``)."""
    return eligible_by_strategy(engine, pod, kind=kind, shares=shares).slots


def default_shares(engine: Engine, pod: PendingPod) -> ShareBook:
    """The queues as the engine alone knows them: its nominees counted, nothing leaving, ``pod`` the
    only waiting pod (its request resolved against the cluster's largest GPU)."""
    largest = int(engine.state.cap.max()) if engine.state.cap.size else 0
    return engine.queue_shares(
        waiting=[QueueAmount(pod.queue, request_amount(pod.gpu, largest))], besides=pod.uid
    )


def least_ask(engine: Engine, pod: PendingPod) -> Amount:
    """The least the pod can book anywhere (its portions resolved against the smallest GPU): the exact
    amount is only known where it is placed, and ``_verify`` checks that one."""
    caps = engine.state.cap[engine.state.cap > 0]
    smallest = int(caps.min()) if caps.size else 0
    return request_amount(pod.gpu, smallest)


def find_victims(
    engine: Engine,
    pod: PendingPod,
    *,
    kind: Kind,
    shares: ShareBook | None = None,
    exclude: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
    trial: Trial | None = None,
    verify_per_chunk: int = _VERIFY_PER_CHUNK,
    eligible: Eligible | None = None,
) -> Preemption | None:
    """The best victims for ``pod`` (see the module docstring), or None when no set makes it fit.

    Call it for a pod the engine could not place. ``exclude`` names pods that must not be chosen (an
    eviction a PodDisruptionBudget refused, a pod already being evicted). The engine is left exactly
    as it was. ``trial`` replaces ``simulate`` as the last word on a set (consolidation's also re-places
    the moved pods); ``verify_per_chunk`` is how many hypotheses of a chunk it is asked about.
    ``eligible``: ``eligible_by_strategy``'s answer for this pod and kind on the engine as it is now (the
    caller's cheap check), so that the search does not read the pod table again; ``shares`` is then
    the one it was read with.
    """
    if not pod.gpu.containers:
        return None
    if eligible is not None:
        if eligible.uid != pod.uid or eligible.kind is not kind:
            raise ValueError(
                f"eligible victims of {eligible.uid} ({eligible.kind}) given for {pod.uid} ({kind})"
            )
        barred = _slots_of(engine.pods, exclude)
        # KAI's strategies in its order (reclaim: fair share first, then the deserved quota).
        for bar, slots, rooms in eligible.strategies:
            if barred.size:
                slots = slots[~np.isin(slots, barred)]
            found = _search(engine, pod, kind, bar, exclude, budget, trial, verify_per_chunk, (slots, rooms))
            if found is not None:
                return found
        return None
    book = shares or default_shares(engine, pod)
    if kind is not Kind.RECLAIM:
        return _search(engine, pod, kind, book, exclude, budget, trial, verify_per_chunk)
    # KAI's strategies in its order: fair share first, then the deserved quota (``QueueShares.by_deserved``).
    for bar in (book, book.by_deserved()):
        found = _search(engine, pod, kind, bar, exclude, budget, trial, verify_per_chunk)
        if found is not None:
            return found
    return None


def _slots_of(table: PodTable, uids: Iterable[str]) -> np.ndarray:
    """The table slots of those of ``uids`` it holds."""
    return np.array([slot for uid in uids if (slot := table.slot_of.get(uid)) is not None], dtype=np.int64)


def _search(
    engine: Engine,
    pod: PendingPod,
    kind: Kind,
    book: ShareBook,
    exclude: Iterable[str],
    budget: int,
    trial: Trial | None,
    verify_per_chunk: int,
    eligible: tuple[np.ndarray, list[_Room]] | None = None,
) -> Preemption | None:
    """``find_victims`` for one share book (for reclaim: one strategy); ``eligible``: its slots, less
    ``exclude``, and rooms when the caller read them already."""
    if eligible is None:
        eligible = eligible_victims(engine, pod, kind=kind, shares=book, exclude=exclude)
    slots, rooms = eligible
    if slots.size == 0:
        return None
    table = engine.pods
    demand = engine.demand(pod)
    if demand.mig and not demand.containers:
        return _mig_search(engine, pod, kind, book, slots, rooms, trial)
    sm = any(c.mode is ComputeMode.SM_SHARING and not c.exclusive for c in demand.containers)
    tenant = (
        engine.state.namespace_id(pod.namespace) if sm and engine.rules.sm_sharing_single_tenant else None
    )
    charges = None if tenant is None else table.tenant_charges(engine.state, tenant)

    def fits_after(nodes: np.ndarray, released: Released) -> np.ndarray:
        hyp = table.hypothetical(engine.state, nodes, released, tenant=tenant, tenant_charges=charges)
        return resource_fit(hyp, demand, np.arange(nodes.size), engine.rules).reasons == 0

    within = _RoomCheck(engine, slots, rooms)

    def fits(c: _Candidates, *, within_slack: bool = True) -> np.ndarray:
        ok = fits_after(c.nodes, table.of_sets(c.victims, tenant=tenant))
        return ok & within(c.victims) if within_slack else ok

    # Per candidate node its eligible victims, least important first (rows padded with NOTHING).
    static_ok = np.zeros(engine.state.rows, dtype=bool)
    static_ok[engine.static_fits(pod)] = True
    slots = slots[static_ok[table.node[slots]]]
    if slots.size == 0:
        return None

    def first_fitting(order: _CostOrder, *, stop: int | None = None) -> Preemption | None:
        """Sets in cost order, tried a chunk at a time: the first chunk holding a fitting set holds the
        best one, and on a big cluster the first chunk usually does. ``stop``: try no set past it."""
        at, chunk = 0, _FIRST_CHUNK
        while at < (order.size if stop is None else min(order.size, stop)):
            part = order.rows(at, at + chunk)
            ok = fits(part)
            if ok.any():
                good = _Candidates(part.nodes[ok], part.victims[ok])
                found = _verify(engine, pod, kind, book, good, trial, verify_per_chunk)
                if found is not None:
                    return found
            at, chunk = at + chunk, chunk * 4
        return None

    # One victim is tried on its own first, without grouping by node: most decisions end here. Removing
    # one pod changes only the GPUs it holds, so a node with fewer GPUs that fit now than a container
    # needs, less the victim's GPUs, cannot be the answer for that victim alone.
    hosts = np.flatnonzero(static_ok)
    now = resource_fit(engine.state, demand, hosts, engine.rules)
    host_at = np.zeros(engine.state.rows, dtype=np.int64)
    host_at[hosts] = np.arange(hosts.size)
    at = host_at[table.node[slots]]
    touched = table.gpus[slots]
    alone = np.ones(slots.size, dtype=bool)
    for container, mask in zip(demand.containers, now.masks, strict=True):
        alone &= mask.sum(axis=1)[at] + touched >= container.count
    single = slots[alone]
    found = first_fitting(
        _CostOrder(engine, _Candidates(table.node[single], single[:, None])), stop=_FIRST_CHUNK
    )
    if found is None and single.size > _FIRST_CHUNK:
        # The first chunk held no answer: before trying the rest, drop the victims after whose leaving,
        # even with their own memory given back, fewer of the node's GPUs hold what a device needs than
        # a container asks (on a full cluster of equal pods no one victim frees a GPU, and every single
        # victim would be tried). Only sets that cannot fit go, so the first fitting one is unchanged.
        single = single[_may_free_alone(engine, demand, single)]
        found = first_fitting(_CostOrder(engine, _Candidates(table.node[single], single[:, None])))
    if found is not None:
        return found

    # Grouped by node (a stable sort on one key: within a node, slots stay ascending).
    slots = slots[np.argsort(table.node[slots], kind="stable")]
    on_node = table.node[slots]
    starts = np.flatnonzero(np.diff(on_node, prepend=-1))
    nodes = on_node[starts]

    # Optimistic first cut: a node where even all its eligible victims leaving is not enough is out
    # (removing pods only ever frees room; the reclaim slack is checked per set, later).
    keep = fits_after(nodes, table.of_groups(slots, starts, tenant=tenant))
    if not keep.any():
        return None
    counts = np.diff(np.append(starts, slots.size))
    slots = slots[np.repeat(keep, counts)]
    nodes, counts = nodes[keep], counts[keep]

    def victims_on(rows: np.ndarray) -> np.ndarray:
        """Per node ``nodes[rows]``, in that order, its eligible victims least important first (by
        priority, then MiB, then slot), padded with NOTHING to the most any of them has."""
        where = np.full(engine.state.rows, -1, dtype=np.int64)
        where[nodes[rows]] = np.arange(rows.size)
        mine = slots[where[table.node[slots]] >= 0]
        group = where[table.node[mine]]
        order = np.lexsort((table.mib[mine], table.priority[mine], group))
        mine, group = mine[order], group[order]
        have = counts[rows]
        first = np.concatenate(([0], np.cumsum(have)[:-1]))
        out = np.full((rows.size, int(have.max())), PodTable.NOTHING, dtype=np.int64)
        out[group, np.arange(mine.size) - first[group]] = mine
        return out

    per_node = None  # built when sets are enumerated; the fallback asks only for its nodes' victims
    size = 2
    while size <= int(counts.max()):
        sizes, nodes_with = np.unique(counts[counts >= size], return_counts=True)
        total = sum(math.comb(int(m), size) * int(k) for m, k in zip(sizes, nodes_with, strict=True))
        if total > budget:
            # The fallback looks at the nodes with the fewest eligible victims (then the seeded order).
            order = np.lexsort((-engine.tie_rank(nodes), counts))
            for at in range(0, order.size, REPRIEVE_NODES):
                best = order[at : at + REPRIEVE_NODES]
                every = _Candidates(nodes[best], victims_on(best))
                found = _reprieve(
                    engine, pod, kind, book, every, fits, fits_after, tenant, trial, verify_per_chunk
                )
                if found is not None:
                    return found
            return None
        if per_node is None:
            per_node = victims_on(np.arange(nodes.size))
        found = first_fitting(_CostOrder(engine, _sets_of_size(nodes, per_node, counts, size)))
        if found is not None:
            return found
        size += 1
    return None


def _mig_search(
    engine: Engine,
    pod: PendingPod,
    kind: Kind,
    book: ShareBook,
    slots: np.ndarray,
    rooms: list[_Room],
    trial: Trial | None,
) -> Preemption | None:
    """Victims for a pod that asks only for MIG slices: a slice is freed whole by its holder leaving,
    and only holders of slices the pod could take help (``MigDemand.wants``). Per candidate node its
    eligible holders of such slices, least important first (priority, then MiB), are tried as growing
    prefixes: the first prefix after which the engine places the pod there is the node's set. Sets are
    then tried in the search's cost order (fewest victims, lowest priorities, seeded node order) by the
    same verification as every other search (``_verify``: simulated on the engine, the queue's limit and
    fair share checked). The prefix is minimal for its order, not necessarily the fewest victims overall.
    """
    table, st = engine.pods, engine.state
    static_ok = np.zeros(st.rows, dtype=bool)
    static_ok[engine.static_fits(pod)] = True
    demand = engine.demand(pod)
    holders: dict[int, list[int]] = {}
    for s in slots.tolist():
        node = int(table.node[s])
        placement = engine.placement_of(table.uid[s] or "")
        if not static_ok[node] or placement is None:
            continue
        held = [st.mig.slots.get(d.uuid) for c in placement.containers if c.mig for d in c.devices]
        if any(h is not None and any(m.wants(h.slice) for m in demand.mig) for h in held):
            holders.setdefault(node, []).append(s)
    within = _RoomCheck(engine, slots, rooms)
    found: list[tuple[int, np.ndarray]] = []
    for node, mine in holders.items():
        mine.sort(key=lambda s: (int(table.priority[s]), int(table.mib[s]), s))
        uids = [table.uid[s] for s in mine]
        for k in range(1, len(mine) + 1):
            placed = (trial or simulate)(engine, pod, uids[:k])
            if placed is not None and placed.node == st.nodes[node].name:  # type: ignore[union-attr]
                found.append((node, np.array(mine[:k], dtype=np.int64)))
                break
    if not found:
        return None
    width = max(v.size for _, v in found)
    victims = np.full((len(found), width), PodTable.NOTHING, dtype=np.int64)
    for i, (_, v) in enumerate(found):
        victims[i, : v.size] = v
    cand = _Candidates(np.array([n for n, _ in found], dtype=np.int64), victims)
    cand = _Candidates(cand.nodes[within(cand.victims)], cand.victims[within(cand.victims)])
    if cand.nodes.size == 0:
        return None
    return _verify(engine, pod, kind, book, _in_cost_order(engine, cand), trial, limit=cand.nodes.size)


class _RoomCheck:
    """Per victim set (rows of PodTable slots, padded with NOTHING): whether what it takes from the
    queues below each over-share queue stays within that queue's room (``eligible_victims``' rooms)."""

    def __init__(self, engine: Engine, slots: np.ndarray, rooms: list[_Room]) -> None:
        self._table = engine.pods
        self._rooms = rooms
        self._whole: np.ndarray | None = None
        if any(r.resource is QueueResource.GPUS for r in rooms):
            # The GPUs each eligible pod holds exclusively (the table counts MiB only).
            self._whole = np.zeros(self._table.rows, dtype=np.int64)
            for s in slots.tolist():
                held = engine.booked_amount(self._table.uid[s] or "")
                self._whole[s] = 0 if held is None else held.amount.gpus

    def __call__(self, victims: np.ndarray) -> np.ndarray:
        table = self._table
        ok = np.ones(victims.shape[0], dtype=bool)
        present = victims != PodTable.NOTHING
        for room in self._rooms:
            amount = table.mib if room.resource is QueueResource.GPU_MEMORY else self._whole
            assert amount is not None
            mine = np.isin(table.queue[victims], room.ids) & present
            ok &= (amount[victims] * mine).sum(axis=1) <= room.room
        return ok


def _may_free_alone(engine: Engine, demand: Demand, slots: np.ndarray) -> np.ndarray:
    """Per victim slot: whether, with its memory given back, its node has as many GPUs holding what one
    device of each container needs as the container asks (memory only: a necessary condition)."""
    table, st = engine.pods, engine.state
    on = table.node[slots]
    cap = st.cap[on]
    after = st.free[on].copy()
    cols = min(after.shape[1], table.req.shape[1])
    after[:, :cols] += table.req[slots, :cols]
    ok = np.ones(slots.size, dtype=bool)
    for container in demand.containers:
        ok &= ((cap > 0) & (after >= container.request_mib(cap))).sum(axis=1) >= container.count
    return ok


@cache
def _index_sets(m: int, k: int) -> np.ndarray:
    return np.array(list(itertools.combinations(range(m), k)), dtype=np.int64).reshape(-1, k)


def _sets_of_size(nodes: np.ndarray, per_node: np.ndarray, counts: np.ndarray, size: int) -> _Candidates:
    """Every set of ``size`` eligible victims on every node, grouped by how many victims a node has."""
    out_nodes, out_sets = [], []
    for m in np.unique(counts[counts >= size]).tolist():
        rows = np.flatnonzero(counts == m)
        index = _index_sets(m, size)
        sets = per_node[rows][:, index]  # (nodes, sets, size)
        out_nodes.append(np.repeat(nodes[rows], index.shape[0]))
        out_sets.append(sets.reshape(-1, size))
    return _Candidates(np.concatenate(out_nodes), np.concatenate(out_sets))


def _reprieve(
    engine: Engine,
    pod: PendingPod,
    kind: Kind,
    book: ShareBook,
    every: _Candidates,
    fits: _Fits,
    fits_after: Callable[[np.ndarray, Released], np.ndarray],
    tenant: int | None,
    check: Trial | None,
    verify_per_chunk: int,
) -> Preemption | None:
    """A minimal set per node: from all eligible victims, give back the most important first while the
    pod still fits (one vectorised filter run per round, across all nodes; each round subtracts one
    victim's holdings from the running sums). Giving back only lowers what a victim queue loses, so
    the reclaim slack is checked once, on the sets that remain."""
    table = engine.pods
    nodes, removed = every.nodes, every.victims.copy()
    released = table.of_sets(removed, tenant=tenant)
    # The filters check a multi-container pod's containers one by one (a necessary condition); giving
    # back on that alone could keep a set the pod does not fit with, so such pods are asked of the engine.
    together = len(engine.demand(pod).containers) > 1
    for col in range(removed.shape[1] - 1, -1, -1):  # most important victims are at the right
        present = every.victims[:, col] != PodTable.NOTHING
        victim = table.of_sets(every.victims[:, col : col + 1], tenant=tenant)
        trial = released.minus(victim)
        ok = fits_after(nodes, trial) & present
        if together:
            for i in np.flatnonzero(ok).tolist():
                kept = [table.uid[s] for s in removed[i].tolist() if s != PodTable.NOTHING]
                kept.remove(table.uid[int(every.victims[i, col])])
                placed = simulate(engine, pod, kept)
                ok[i] = placed is not None and placed.node == engine.state.nodes[int(nodes[i])].name  # type: ignore[union-attr]
        removed[ok, col] = PodTable.NOTHING
        released = released.minus(victim, ok)
    ok = fits(_Candidates(nodes, removed))
    cand = _in_cost_order(engine, _Candidates(nodes[ok], removed[ok]))
    return _verify(engine, pod, kind, book, cand, check, verify_per_chunk)


class _CostOrder:
    """Sets of one size in the order of ``_in_cost_order``, sorted a prefix at a time.

    Most decisions end in the first chunk, so sorting every hypothesis (for a reclaim on a full cluster,
    one per eligible victim: ~19,000) is mostly wasted. With the size fixed, the first key is a set's
    most important victim's priority: every set whose priority there is at most the ``n``-th smallest
    comes before all others, so sorting just those (stably, as the full sort is) gives exactly the
    full sort's first rows, ``n`` of them at least.
    """

    def __init__(self, engine: Engine, cand: _Candidates) -> None:
        table = engine.pods
        self._cand = cand
        prio = table.priority[cand.victims]
        if prio.shape[1] > 1:
            prio = -np.sort(-prio, axis=1)  # each row's priorities, highest first
        mib = table.mib[cand.victims].sum(axis=1)
        rank = engine.tie_rank(cand.nodes)
        self._keys = [mib, -rank] + [prio[:, j] for j in range(prio.shape[1] - 1, -1, -1)]
        self._head = prio[:, 0]
        self._order = np.empty(0, dtype=np.int64)

    @property
    def size(self) -> int:
        return int(self._cand.nodes.size)

    def rows(self, lo: int, hi: int) -> _Candidates:
        """The sets at positions ``lo`` to ``hi`` (exclusive) of the cost order."""
        hi = min(hi, self.size)
        if hi > self._order.size:
            self._sort(hi)
        pick = self._order[lo:hi]
        return _Candidates(self._cand.nodes[pick], self._cand.victims[pick])

    def _sort(self, n: int) -> None:
        if 4 * n >= self.size:
            self._order = np.lexsort(self._keys)
            return
        bound = np.partition(self._head, n - 1)[n - 1]
        first = np.flatnonzero(self._head <= bound)
        self._order = first[np.lexsort([key[first] for key in self._keys])]


def _in_cost_order(engine: Engine, cand: _Candidates) -> _Candidates:
    """Best first: fewest victims, then priorities compared highest first, then the engine's seeded node
    order, then (between sets on one node) the least MiB taken."""
    table = engine.pods
    valid = cand.victims != PodTable.NOTHING
    prio = np.where(valid, table.priority[cand.victims], np.iinfo(np.int64).min)
    prio = -np.sort(-prio, axis=1)  # each row's priorities, highest first
    count = valid.sum(axis=1)
    mib = table.mib[cand.victims].sum(axis=1)
    rank = engine.tie_rank(cand.nodes)
    keys = [mib, -rank] + [prio[:, j] for j in range(prio.shape[1] - 1, -1, -1)] + [count]
    order = np.lexsort(keys)
    return _Candidates(cand.nodes[order], cand.victims[order])


def _verify(
    engine: Engine,
    pod: PendingPod,
    kind: Kind,
    shares: ShareBook,
    cand: _Candidates,
    trial: Trial | None = None,
    limit: int = _VERIFY_PER_CHUNK,
) -> Preemption | None:
    """Try the hypotheses (in cost order) on the engine itself; the first one that places the pod wins."""
    table = engine.pods
    # Slots are read before any simulation: forgetting and re-booking victims may move them.
    tries = [
        (
            engine.state.nodes[int(cand.nodes[i])],
            [table.uid[s] for s in cand.victims[i].tolist() if s != PodTable.NOTHING],
        )
        for i in range(min(cand.nodes.size, limit))
    ]
    engine_amounts = {uid: engine.booked_amount(uid) for _, victims in tries for uid in victims}
    attempt = trial or simulate
    for node, victims in tries:
        assert node is not None
        placement = attempt(engine, pod, victims)
        if placement is None or placement.node != node.name:
            continue
        # The books as they will be: what the victims free, what the pod then books, the nominees of
        # its queue. A pod its queue's limit (or, reclaiming, its fair share) would refuse evicts nobody.
        asked = placed_amount(placement)
        freed = [a for a in (engine_amounts.get(uid) for uid in victims) if a is not None]
        if shares.exceeded(pod.queue, asked, freed=freed) is not None:
            continue
        if kind is Kind.RECLAIM and not shares.may_reclaim(pod.queue, asked, freed=freed):
            continue
        ordered = sorted(victims, key=lambda uid: -table.priority[table.slot_of[uid]])
        return Preemption(kind, node.name, tuple(uid for uid in ordered if uid is not None), placement)
    return None


def free_part(engine: Engine, key: str, placement: Placement) -> Placement | None:
    """The part of ``placement`` that is free already (per device, its GPU's free memory up to what the
    device asks), as a placement ``key`` can ``Engine.hold`` while the victims leave; None when nothing
    of it is free."""
    free = {ledger.uuid: ledger.free_mib for ledger in engine.ledger(placement.node)}
    containers = []
    for c in placement.containers:
        devices = tuple(
            DeviceAssignment(d.uuid, d.index, mib, mib, None)
            for d in c.devices
            if (mib := min(d.request_mib, free.get(d.uuid, 0))) > 0
        )
        if devices:
            containers.append(ContainerPlacement(c.container, c.mode, c.exclusive, devices))
    return Placement(key, placement.node, tuple(containers)) if containers else None


def simulate(engine: Engine, pod: PendingPod, victims: Iterable[str | None]) -> Placement | None:
    """Where the engine would place ``pod`` with ``victims`` gone: a statement that evicts them and
    places the pod, then is discarded. Undone newest first, each victim gets its slot back, so the
    search's slot arrays stay valid across simulations."""
    with engine.statement() as st:
        for uid in victims:
            assert uid is not None
            st.evict(uid)
        decision = st.place(pod)
        return decision if isinstance(decision, Placement) else None
