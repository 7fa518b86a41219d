"""The victim search as it was before its speed work (issue #15), kept as the reference the search is
compared with: every hypothesis of a size sorted in full, every kept node's victims laid out, the
fallback over every column. Only the search order's bookkeeping changed since; the answers must not,
so ``test_placement_preemption`` asks both the same questions and wants the same node and victims.

The helpers that did not change (eligibility, the cost order, the engine simulation) are imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from gpufrac.contract.request import ComputeMode
from gpufrac.placement.engine import Engine
from gpufrac.placement.filters import resource_fit
from gpufrac.placement.model import PendingPod
from gpufrac.placement.preemption import (
    _FIRST_CHUNK,
    DEFAULT_BUDGET,
    REPRIEVE_NODES,
    Kind,
    Preemption,
    ShareBook,
    _Candidates,
    _Fits,
    _in_cost_order,
    _RoomCheck,
    _sets_of_size,
    _verify,
    default_shares,
    eligible_victims,
    simulate,
)
from gpufrac.placement.state import PodTable, Released


def find_victims(
    engine: Engine,
    pod: PendingPod,
    *,
    kind: Kind,
    shares: ShareBook | None = None,
    exclude: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
) -> Preemption | None:
    """The best victims for ``pod`` (see the module docstring), or None when no set makes it fit.

    Call it for a pod the engine could not place. ``exclude`` names pods that must not be chosen (an
    eviction a PodDisruptionBudget refused, a pod already being evicted). The engine is left exactly
    as it was. Reclaim tries the fair share, then the deserved quota (issue #36).
    """
    if not pod.gpu.containers:
        return None
    book = shares or default_shares(engine, pod)
    for bar in (book,) if kind is not Kind.RECLAIM else (book, book.by_deserved()):
        found = _search_one(engine, pod, kind, bar, exclude, budget)
        if found is not None:
            return found
    return None


def _search_one(
    engine: Engine, pod: PendingPod, kind: Kind, book: ShareBook, exclude: Iterable[str], budget: int
) -> Preemption | None:
    slots, rooms = eligible_victims(engine, pod, kind=kind, shares=book, exclude=exclude)
    if slots.size == 0:
        return None
    table = engine.pods
    demand = engine.demand(pod)
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

    def first_fitting(cand: _Candidates) -> Preemption | None:
        """Sets in cost order, tried a chunk at a time: the first chunk holding a fitting set holds the
        best one, and on a big cluster the first chunk usually does."""
        at, chunk = 0, _FIRST_CHUNK
        while at < cand.nodes.size:
            part = _Candidates(cand.nodes[at : at + chunk], cand.victims[at : at + chunk])
            ok = fits(part)
            if ok.any():
                found = _verify(engine, pod, kind, book, _Candidates(part.nodes[ok], part.victims[ok]))
                if found is not None:
                    return found
            at, chunk = at + chunk, chunk * 4
        return None

    # One victim is tried on its own first, without grouping by node: most decisions end here. Removing
    # one pod changes only the GPUs it holds, so a node with fewer GPUs that fit now than a container
    # needs, less the victim's GPUs, cannot be the answer for that victim alone.
    hosts = np.unique(table.node[slots])
    now = resource_fit(engine.state, demand, hosts, engine.rules)
    at = np.searchsorted(hosts, table.node[slots])
    touched = (table.on[slots] > 0).sum(axis=1)
    alone = np.ones(slots.size, dtype=bool)
    for container, mask in zip(demand.containers, now.masks, strict=True):
        alone &= mask.sum(axis=1)[at] + touched >= container.count
    single = slots[alone]
    found = first_fitting(_in_cost_order(engine, _Candidates(table.node[single], single[:, None])))
    if found is not None:
        return found

    order = np.lexsort((table.mib[slots], table.priority[slots], table.node[slots]))
    slots = slots[order]
    on_node = table.node[slots]
    starts = np.flatnonzero(np.diff(on_node, prepend=-1))
    nodes = on_node[starts]

    # Optimistic first cut: a node where even all its eligible victims leaving is not enough is out
    # (removing pods only ever frees room; the reclaim slack is checked per set, later).
    keep = fits_after(nodes, table.of_groups(slots, starts, tenant=tenant))
    if not keep.any():
        return None
    counts = np.diff(np.append(starts, slots.size))
    group = np.repeat(np.arange(nodes.size), counts)
    kept = keep[group]
    slots, group = slots[kept], np.cumsum(keep)[group[kept]] - 1
    nodes, counts = nodes[keep], counts[keep]
    per_node = np.full((nodes.size, int(counts.max())), PodTable.NOTHING, dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    per_node[group, np.arange(slots.size) - first[group]] = slots

    size = 2
    while size <= int(counts.max()):
        sizes, nodes_with = np.unique(counts[counts >= size], return_counts=True)
        total = sum(math.comb(int(m), size) * int(k) for m, k in zip(sizes, nodes_with, strict=True))
        if total > budget:
            # The fallback looks at the nodes with the fewest eligible victims (then the seeded order).
            order = np.lexsort((-engine.tie_rank(nodes), counts))
            for at in range(0, order.size, REPRIEVE_NODES):
                best = order[at : at + REPRIEVE_NODES]
                every = _Candidates(nodes[best], per_node[best])
                found = _reprieve(engine, pod, kind, book, every, fits, fits_after, tenant)
                if found is not None:
                    return found
            return None
        found = first_fitting(_in_cost_order(engine, _sets_of_size(nodes, per_node, counts, size)))
        if found is not None:
            return found
        size += 1
    return None


def _reprieve(
    engine: Engine,
    pod: PendingPod,
    kind: Kind,
    book: ShareBook,
    every: _Candidates,
    fits: _Fits,
    fits_after: Callable[[np.ndarray, Released], np.ndarray],
    tenant: int | None,
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
        trial = released.minus(table.of_sets(every.victims[:, col : col + 1], tenant=tenant))
        ok = fits_after(nodes, trial) & present
        if together:
            for i in np.flatnonzero(ok).tolist():
                kept = [table.uid[s] for s in removed[i].tolist() if s != PodTable.NOTHING]
                kept.remove(table.uid[int(every.victims[i, col])])
                placed = simulate(engine, pod, kept)
                ok[i] = placed is not None and placed.node == engine.state.nodes[int(nodes[i])].name  # type: ignore[union-attr]
        removed[ok, col] = PodTable.NOTHING
        released = released.minus(table.of_sets(every.victims[:, col : col + 1], tenant=tenant), ok)
    ok = fits(_Candidates(nodes, removed))
    return _verify(engine, pod, kind, book, _in_cost_order(engine, _Candidates(nodes[ok], removed[ok])))
