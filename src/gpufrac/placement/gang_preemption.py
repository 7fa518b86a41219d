"""Victims for a gang: which placed pods to remove so that at least ``minMember`` of a gang's pending
pods can be placed together.

A gang is all or nothing, so its victims are too: either a set after which the engine's own gang
statement (``Engine.schedule(..., gang=True, min_member=n)``) places enough members, or no victim at
all. Evicting for one member of a gang that still cannot start would cost pods and start nothing.

The search builds on the single-pod one (``gpufrac.placement.preemption.find_victims``), member after
member on the engine itself: the largest member first (the hardest to fit), each either placed where
it fits already or given ``find_victims``' best set on the books as the members before it left them
(their victims gone, their placements booked, and the queue shares a caller passed moved the same way),
so two members never count on the same freed room, nor on the same part of their queue's share.
A member for whom no set exists is skipped; once ``minMember`` members have a place the rest are not
preempted for. Then the plan is checked with the gang statement itself, on the books without the
victims (it may place members elsewhere than the search did), and each victim the statement can do
without is given back, most important first (kube-scheduler's reprieve: the victim assumed again, the
gang statement tried, and rolled back to a checkpoint when the gang needs it gone). All of it is one
``Engine.statement``, discarded at the end: the engine is left exactly as it was, every pod in its slot.

The result is minimal (no victim can be spared) but, unlike the single-pod search, not guaranteed the
fewest: an exact search over victim sets for several pods at once grows as the product of the
members' searches. docs/scheduler.md says so.

Consolidation for a gang (``plan_gang_consolidation``) goes the same way with
``gpufrac.placement.consolidation.plan_consolidation`` per member: each moved pod is booked at the new
home its plan found, so the next members plan around it and no pod is moved twice; the plan counts
when the gang statement then places ``minMember`` members. Its moves are each member's fewest; no
reprieve is run (giving a moved pod back would mean undoing its new home too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from .consolidation import Consolidation, Move, NoConsolidation, Why, plan_consolidation
from .decision import Placement
from .engine import Engine, Statement
from .model import PendingPod
from .preemption import DEFAULT_BUDGET, Kind, ShareBook, find_victims
from .queue_shares import QueueAmount, placed_amount


@dataclass(frozen=True, slots=True)
class GangPreemption:
    """Remove ``victims`` (pod uids, most important first) from ``nodes`` (each once); the gang
    statement then gives the members ``placements`` (what it placed in the check, at least
    ``minMember`` of them). For consolidation (``kind`` CONSOLIDATE) the victims are moved: ``moves``
    says where each found a new home."""

    kind: Kind
    victims: tuple[str, ...]
    nodes: tuple[str, ...]
    placements: tuple[Placement, ...]
    moves: tuple[Move, ...] = ()

    @property
    def node_of(self) -> dict[str, str]:
        """Per member uid the node the check placed it on."""
        return {p.pod_uid: p.node for p in self.placements}


class _Room:
    """What a gang's plan has done so far, all of it through one statement (``Engine.statement``): the
    members it booked, the pods it booked off (victims, moved pods) and the moves. Discarding the
    statement undoes it all."""

    def __init__(self, st: Statement, exclude: Iterable[str], members: Sequence[PendingPod]) -> None:
        self.st = st
        self.barred = set(exclude) | {m.uid for m in members}
        self.members: list[str] = []  # members booked by the search
        self.removed: list[tuple[PendingPod, Placement]] = []  # pods booked off (victims, moved pods)
        self.moves: list[Move] = []

    def place(self, pod: PendingPod) -> bool:
        if isinstance(self.st.place(pod), Placement):
            self.members.append(pod.uid)
            return True
        return False

    def take(self, pod: PendingPod, placement: Placement, victims: Iterable[str]) -> None:
        """Book ``victims`` off and ``pod`` at ``placement``."""
        for uid in victims:
            self.removed.append(self.st.evict(uid))
            self.barred.add(uid)
        self.st.assume(pod, placement)
        self.members.append(pod.uid)

    def move(self, pod: PendingPod, plan: Consolidation) -> None:
        """Apply a member's consolidation: its moved pods at their new homes, the member in its room."""
        start = len(self.removed)
        self.take(pod, plan.placement, [m.uid for m in plan.moves])
        for (booked, _), m in zip(self.removed[start:], plan.moves, strict=True):
            self.st.assume(replace(booked, nominated_node=None), m.target)
            self.moves.append(m)


def _plan(
    engine: Engine,
    members: Sequence[PendingPod],
    min_member: int,
    room: _Room,
    make_room: Callable[[PendingPod], bool],
) -> tuple[Placement, ...] | None:
    """Members largest first, each placed or given room by ``make_room`` (through the plan's
    statement), until ``min_member`` have a place; then the gang statement on the books without the
    members. None when too few members got a place, no room had to be made, or the statement places
    too few."""
    for pod in sorted(members, key=lambda p: engine.demand(p).size, reverse=True):
        if len(room.members) >= min_member:
            break
        if not room.place(pod):
            make_room(pod)
    if len(room.members) < min_member or not room.removed:
        return None
    for uid in reversed(room.members):
        room.st.evict(uid)
    room.members.clear()
    return _gang_fits(room.st, members, min_member)


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
    with engine.statement() as st:
        room = _Room(st, exclude, members)

        def make_room(pod: PendingPod) -> bool:
            book = None if shares is None else _as_left(engine, shares, room)
            plan = find_victims(engine, pod, kind=kind, shares=book, exclude=room.barred, budget=budget)
            if plan is not None:
                room.take(pod, plan.placement, plan.victims)
            return plan is not None

        placements = _plan(engine, members, min_member, room, make_room)
        if placements is None:
            return None
        # Reprieve: give back each victim the statement can do without, most important first.
        needed: list[tuple[PendingPod, Placement]] = []
        for booked, placement in sorted(room.removed, key=lambda r: -r[0].priority):
            back = st.checkpoint()
            st.assume(booked, placement)
            without = _gang_fits(st, members, min_member)
            if without is None:
                st.rollback(back)
                needed.append((booked, placement))
            else:
                placements = without
        nodes = tuple(dict.fromkeys(p.node for _, p in needed))
        return GangPreemption(kind, tuple(b.uid for b, _ in needed), nodes, placements)


def plan_gang_consolidation(
    engine: Engine,
    members: Sequence[PendingPod],
    *,
    min_member: int,
    exclude: Iterable[str] = (),
    budget: int = DEFAULT_BUDGET,
) -> GangPreemption | NoConsolidation:
    """Moves after which the gang statement places at least ``min_member`` of ``members`` (see the
    module docstring), or why there are none (the first member's reason when no member got a plan).
    The engine is left exactly as it was."""
    if min_member < 1 or not any(m.gpu.containers for m in members):
        return NoConsolidation(Why.NO_GPU, "the gang asks for no GPU")
    first: list[NoConsolidation] = []
    with engine.statement() as st:
        room = _Room(st, exclude, members)

        def make_room(pod: PendingPod) -> bool:
            plan = plan_consolidation(engine, pod, exclude=room.barred, budget=budget)
            if isinstance(plan, NoConsolidation):
                first.append(plan)
                return False
            room.move(pod, plan)
            return True

        placements = _plan(engine, members, min_member, room, make_room)
        if placements is not None:
            moves = tuple(room.moves)
            nodes = tuple(dict.fromkeys(m.source.node for m in moves))
            return GangPreemption(Kind.CONSOLIDATE, tuple(m.uid for m in moves), nodes, placements, moves)
        if first and not room.removed:
            return first[0]
        return NoConsolidation(
            Why.NO_PLAN,
            f"no moves of movable pods make room for {min_member} of the gang's {len(members)} pods together",
        )


def _as_left(engine: Engine, shares: ShareBook, room: _Room) -> ShareBook:
    """``shares`` (taken before the search) as the members before this one left the books: the members
    placed count as held by their queue, their victims as gone. Without it every member was judged on
    the same books, and a gang could take its queue past its share one member at a time."""
    taken = [a for a in (engine.booked_amount(uid) for uid in room.members) if a is not None]
    freed = [QueueAmount(booked.queue, placed_amount(placement)) for booked, placement in room.removed]
    return shares.after(taken=taken, freed=freed)


def _gang_fits(st: Statement, members: Sequence[PendingPod], min_member: int) -> tuple[Placement, ...] | None:
    """What the gang statement places now (at least ``min_member``), rolled back at once; None if too
    few."""
    back = st.checkpoint()
    decisions = st.engine.schedule(members, gang=True, min_member=min_member, statement=st)
    st.rollback(back)
    placed = tuple(d for d in decisions if isinstance(d, Placement))
    return placed if len(placed) >= min_member else None
