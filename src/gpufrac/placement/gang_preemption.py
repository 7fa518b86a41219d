"""Victims for a gang: which placed pods to remove so that at least ``minMember`` of a gang's pending
pods can be placed together.

A gang is all or nothing, so its victims are too: either a set after which the engine's own gang
statement (``Engine.schedule(..., gang=True, min_member=n)``) places enough members, or no victim at
all. Evicting for one member of a gang that still cannot start would cost pods and start nothing.

The search builds on the single-pod one (``gpufrac.placement.preemption.find_victims``), member after
member on the engine itself: the largest member first (the hardest to fit), each either placed where
it fits already or given ``find_victims``' best set on the books as the members before it left them
(their victims gone, their placements booked), so two members never count on the same freed room.
A member for whom no set exists is skipped; once ``minMember`` members have a place the rest are not
preempted for. Then the plan is checked with the gang statement itself, on the books without the
victims (it may place members elsewhere than the search did), and each victim the statement can do
without is given back, most important first (kube-scheduler's reprieve, one statement per victim).
The engine is left exactly as it was.

The result is minimal (no victim can be spared) but, unlike the single-pod search, not guaranteed the
fewest: an exact search over victim sets for several pods at once grows as the product of the
members' searches. docs/scheduler.md says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .decision import Placement
from .engine import Engine
from .model import PendingPod
from .preemption import DEFAULT_BUDGET, Kind, ShareBook, find_victims


@dataclass(frozen=True, slots=True)
class GangPreemption:
    """Remove ``victims`` (pod uids, most important first) from ``nodes`` (each once); the gang
    statement then gives the members ``placements`` (what it placed in the check, at least
    ``minMember`` of them)."""

    kind: Kind
    victims: tuple[str, ...]
    nodes: tuple[str, ...]
    placements: tuple[Placement, ...]

    @property
    def node_of(self) -> dict[str, str]:
        """Per member uid the node the check placed it on."""
        return {p.pod_uid: p.node for p in self.placements}


def find_gang_victims(
    engine: Engine,
    members: Sequence[PendingPod],
    *,
    min_member: int,
    kind: Kind,
    shares: ShareBook | None = None,
    exclude: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
) -> GangPreemption | None:
    """Victims after which the gang statement places at least ``min_member`` of ``members`` (see the
    module docstring), or None. Call it for a gang the engine could not place; ``exclude`` as for
    ``find_victims``. The engine is left exactly as it was."""
    if min_member < 1 or not any(m.gpu.containers for m in members):
        return None
    barred = set(exclude) | {m.uid for m in members}
    removed: list[tuple[PendingPod, Placement]] = []  # victims booked off, in order
    tentative: list[str] = []  # members booked by the search
    try:
        for pod in sorted(members, key=lambda p: engine.demand(p).size, reverse=True):
            if len(tentative) >= min_member:
                break
            decision = engine.place(pod)
            if isinstance(decision, Placement):
                tentative.append(pod.uid)
                continue
            plan = find_victims(engine, pod, kind=kind, shares=shares, exclude=barred, budget=budget)
            if plan is None:
                continue
            for uid in plan.victims:
                removed.append(_book_off(engine, uid))
                barred.add(uid)
            engine.assume(pod, plan.placement)
            tentative.append(pod.uid)
        if len(tentative) < min_member or not removed:
            return None
        _forget_all(engine, tentative)
        placements = _gang_fits(engine, members, min_member)
        if placements is None:
            return None
        # Reprieve: give back each victim the statement can do without, most important first.
        victims = sorted(removed, key=lambda r: -r[0].priority)
        needed: list[tuple[PendingPod, Placement]] = []
        for booked, placement in victims:
            engine.assume(booked, placement)
            without = _gang_fits(engine, members, min_member)
            if without is None:
                engine.forget(booked.uid)
                needed.append((booked, placement))
            else:
                placements = without
        nodes = tuple(dict.fromkeys(p.node for _, p in needed))
        return GangPreemption(kind, tuple(b.uid for b, _ in needed), nodes, placements)
    finally:
        _forget_all(engine, tentative)
        for booked, placement in reversed(removed):
            if engine.bound_pod(booked.uid) is None:
                engine.assume(booked, placement)


def _gang_fits(
    engine: Engine, members: Sequence[PendingPod], min_member: int
) -> tuple[Placement, ...] | None:
    """What the gang statement places now (at least ``min_member``), undone at once; None if too few."""
    decisions = engine.schedule(members, gang=True, min_member=min_member)
    placed = tuple(d for d in decisions if isinstance(d, Placement))
    for p in placed:
        engine.forget(p.pod_uid)
    return placed if len(placed) >= min_member else None


def _book_off(engine: Engine, uid: str) -> tuple[PendingPod, Placement]:
    booked, placement = engine.bound_pod(uid), engine.placement_of(uid)
    if booked is None or placement is None:
        raise ValueError(f"victim {uid} is not placed")
    engine.forget(uid)
    return booked, placement


def _forget_all(engine: Engine, uids: list[str]) -> None:
    for uid in reversed(uids):
        engine.forget(uid)
    uids.clear()
