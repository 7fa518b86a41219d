"""Consolidation: move a few pods so that a pod that fits nowhere gets room of its exact shape.

Why: with fractions, a cluster can hold enough free GPU memory for a pod and still have no GPU (or no
node with enough GPUs) that takes it, because the free memory lies in pieces on many GPUs. Preemption
and reclaim remove pods for good; consolidation only relocates pods that allow it, so nobody loses
their place. A pod allows it by opting in (``PendingPod.movable``: the scheduler sets it from the
``gpufrac.io/movable: "true"`` annotation on a pod a controller owns, since only a controller recreates
an evicted pod); a pod of a higher priority than the pending one is never moved.

How: the victim search of ``gpufrac.placement.preemption`` runs with ``Kind.CONSOLIDATE`` (which pods
are candidates) and a trial of its own (``relocate``): in one ``Engine.statement`` the moved pods are
evicted, the pending pod is placed, then each moved pod, largest first, is placed again, and the
statement is discarded. A set counts only when the pending pod lands on the node the set frees and
every moved pod finds a new home that is not on a GPU the pending pod takes and not where it was. So
the answer is the fewest moves (then the lowest priorities, the engine's seeded node order, the least
MiB moved, as for preemption) after which the pending pod and every moved pod are placed without
over-committing any GPU. The search is exact over the sets it verifies; a set whose moved pods find no
home in the engine's own choice of places is skipped, although another order of placing them might
have found homes (the engine's policy decides where a replacement goes, so that is what is simulated).

Before searching, two cheap facts say when repacking cannot help, and the answer then says which
(``NoConsolidation``): no node admits the pod at all (taints, selectors, readiness: no move changes
that), or the cluster's free GPU memory is less than the least the pod asks for. The
``MoveBudget`` bounds how many moves a caller makes per minute (a token bucket on the caller's clock).

Pure: no I/O, no clock; the scheduler executes a plan through the Eviction API
(``gpufrac.scheduler.preemption``) and the simulator applies it to its replay (``gpufrac.sim.churn``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from gpufrac.contract.keys import MOVABLE_ANNOTATION

from .decision import Placement
from .engine import Engine
from .filters import resource_fit
from .model import PendingPod
from .preemption import DEFAULT_BUDGET, Kind, eligible_victims, find_victims

#: How many hypotheses of a chunk are verified on the engine: more than preemption's, because a set
#: that frees the room can still fail when a moved pod has nowhere to go.
VERIFY_PER_CHUNK = 64


@dataclass(frozen=True, slots=True)
class Move:
    """Pod ``uid`` (``pod``: namespace/name) leaves ``source``; ``target`` is a home it has elsewhere."""

    uid: str
    pod: str
    source: Placement
    target: Placement


@dataclass(frozen=True, slots=True)
class Consolidation:
    """Move ``moves`` (most important first) off ``node``; the pending pod then gets ``placement``."""

    node: str
    moves: tuple[Move, ...]
    placement: Placement

    @property
    def kind(self) -> Kind:
        return Kind.CONSOLIDATE

    @property
    def victims(self) -> tuple[str, ...]:
        """The moved pods' uids (what the scheduler evicts)."""
        return tuple(m.uid for m in self.moves)


class Why(StrEnum):
    """Why no consolidation is offered."""

    NO_GPU = "no-gpu"
    NO_NODE = "no-node"
    NOT_FRAGMENTED = "not-fragmented"
    NO_MOVABLE = "no-movable"
    NO_PLAN = "no-plan"


@dataclass(frozen=True, slots=True)
class NoConsolidation:
    why: Why
    detail: str


def relocate(
    engine: Engine, pod: PendingPod, moved: Sequence[str]
) -> tuple[Placement, tuple[Move, ...]] | None:
    """The pending pod's placement and each moved pod's new home once ``moved`` leave (see the module
    docstring), or None: one statement, discarded either way (so each moved pod gets its slot back and
    the search's slot arrays stay valid)."""
    with engine.statement() as st:
        gone = [st.evict(uid) for uid in moved]
        decision = st.place(pod)
        if not isinstance(decision, Placement):
            return None
        taken = _gpus(decision)
        moves = []
        for booked, source in sorted(gone, key=lambda g: (-_mib(g[1]), g[0].uid)):
            target = st.place(replace(booked, nominated_node=None))
            if not isinstance(target, Placement):
                return None
            if _gpus(target) & taken or (target.node == source.node and _gpus(target) == _gpus(source)):
                return None
            moves.append(Move(booked.uid, booked.key, source, target))
        moves.sort(key=lambda m: moved.index(m.uid))
        return decision, tuple(moves)


def plan_consolidation(
    engine: Engine,
    pod: PendingPod,
    *,
    exclude: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
) -> Consolidation | NoConsolidation:
    """The fewest moves that give ``pod`` a place (see the module docstring), or why there is none.

    Call it for a pod the engine could not place. ``exclude`` names pods that must not be moved (a
    move a disruption budget refused, a pod already leaving). The engine is left exactly as it was.
    """
    if not pod.gpu.containers:
        return NoConsolidation(Why.NO_GPU, "the pod asks for no GPU")
    nodes = engine.static_fits(pod)
    if nodes.size == 0:
        return NoConsolidation(Why.NO_NODE, "no node admits the pod whatever moves (see the reasons above)")
    need, free = _least_need_mib(engine, pod, nodes), _free_mib(engine)
    if free < need:
        return NoConsolidation(
            Why.NOT_FRAGMENTED,
            f"the cluster has {free} MiB of free GPU memory and the pod needs at least {need} MiB, "
            "so repacking cannot make room",
        )
    excluded = list(exclude)
    candidates, _ = eligible_victims(engine, pod, kind=Kind.CONSOLIDATE, exclude=excluded)
    on_fit = np.isin(engine.pods.node[candidates], nodes)
    if not on_fit.any():
        return NoConsolidation(
            Why.NO_MOVABLE,
            "no pod on the nodes that could take it may be moved (a movable pod has "
            f'{MOVABLE_ANNOTATION}: "true" and a controller owner, and a priority no higher than this '
            "pod's)",
        )
    found = find_victims(
        engine,
        pod,
        kind=Kind.CONSOLIDATE,
        exclude=excluded,
        budget=budget,
        trial=_Trial(),
        verify_per_chunk=VERIFY_PER_CHUNK,
    )
    if found is not None:
        result = relocate(engine, pod, list(found.victims))
        if result is not None:
            placement, moves = result
            return Consolidation(found.node, moves, placement)
    return NoConsolidation(
        Why.NO_PLAN,
        f"no set of the {int(on_fit.sum())} movable pod(s) on the nodes that could take it frees room of its "
        "shape with a new home elsewhere for each moved pod",
    )


class MoveBudget:
    """A bound on disruption: a token bucket that holds up to ``per_minute`` moves and refills one every
    ``60 / per_minute`` seconds, so moves average at most ``per_minute`` a minute and come at most
    ``per_minute`` at once. ``now`` is the caller's clock, in seconds (injectable: the scheduler's
    monotonic clock, the simulator's trace time)."""

    def __init__(self, per_minute: int, *, now: float) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute={per_minute} must be at least 1")
        self.per_minute = per_minute
        self._tokens = float(per_minute)
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(float(self.per_minute), self._tokens + (now - self._at) * self.per_minute / 60)
            self._at = now

    def take(self, moves: int, *, now: float) -> bool:
        """Spend ``moves`` tokens if there are that many (True), else spend nothing (False)."""
        self._refill(now)
        if moves > self._tokens + 1e-9:
            return False
        self._tokens -= moves
        return True

    def wait_s(self, moves: int, *, now: float) -> float:
        """Seconds until ``moves`` tokens are there (inf when more than the bucket holds)."""
        if moves > self.per_minute:
            return float("inf")
        self._refill(now)
        return max(0.0, (moves - self._tokens) * 60 / self.per_minute)


class _Trial:
    """``relocate`` as the search's trial, after a cheap test that skips most sets that cannot work in a
    full cluster. A moved pod that fits on no node now (``_home_now``) can only go back to the node the
    set frees, since every other node only gets fuller; so the pending pod and those pods must fit in
    that node's free memory plus what the set gives back. (A necessary condition: a set that passes is
    still simulated.)"""

    def __init__(self) -> None:
        self._homes: dict[str, bool] = {}
        self._by_kind: dict[object, bool] = {}
        self._need: dict[int, int] = {}

    def __call__(self, engine: Engine, pod: PendingPod, victims: list[str]) -> Placement | None:
        first = engine.placement_of(victims[0])
        assert first is not None
        n = engine.state.index[first.node]
        need = self._need.get(n)
        if need is None:
            need = self._need[n] = _least_need_mib(engine, pod, np.array([n]))
        held = {uid: _mib(engine.placement_of(uid)) for uid in victims}  # type: ignore[arg-type]
        back = sum(mib for uid, mib in held.items() if not self._home_now(engine, uid))
        if need + back > int(engine.state.free_total[n]) + sum(held.values()):
            return None
        result = relocate(engine, pod, victims)
        return None if result is None else result[0]

    def _home_now(self, engine: Engine, uid: str) -> bool:
        """Whether the pod fits on some node as the cluster is now. Asked once per kind of pod (the
        engine's placement kind: everything that decides where a pod can go), not once per pod: in a
        full cluster the search asks it of thousands of movable pods of a few dozen kinds."""
        found = self._homes.get(uid)
        if found is None:
            booked = engine.bound_pod(uid)
            assert booked is not None
            demand = engine.demand(booked)
            found = self._by_kind.get(demand.kind)
            if found is None:
                nodes = engine.static_fits(booked)
                found = bool(nodes.size) and bool(
                    (resource_fit(engine.state, demand, nodes, engine.rules).reasons == 0).any()
                )
                self._by_kind[demand.kind] = found
            self._homes[uid] = found
        return found


def _gpus(placement: Placement) -> set[str]:
    return {uuid for c in placement.containers for uuid in c.uuids}


def _mib(placement: Placement) -> int:
    return sum(d.request_mib for c in placement.containers for d in c.devices)


def _free_mib(engine: Engine) -> int:
    st = engine.state
    live = st.live()
    return int(st.free_total[live].sum())


def _least_need_mib(engine: Engine, pod: PendingPod, nodes: np.ndarray) -> int:
    """The least guaranteed GPU memory the pod takes on any GPU of the nodes that admit it (a portion
    is resolved on the smallest such GPU)."""
    st = engine.state
    caps = st.cap[nodes]
    caps = caps[caps > 0]
    if caps.size == 0:
        return 0
    smallest = np.array([int(caps.min())])
    return sum(int(c.request_mib(smallest)[0]) * c.count for c in engine.demand(pod).containers)
