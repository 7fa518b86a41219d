"""Consolidation: plans checked against the GPU rules from their placements alone, and exact against a
brute-force oracle on small fragmented clusters; the opt-in and priority rules and the move bound by
example.

The oracle tries every set of allowed pods on one node (allowed: movable, priority no higher than the
pending pod's, written here again from the issue's words), smallest sets first, with the planner's
own trial (``relocate``); the planner must find a set of the same size, or none when the oracle finds
none. Whether a plan is sound is checked without the engine's ledgers: the pods' placements after the
plan is applied must leave every GPU within its memory, one compute mode per GPU, an exclusive GPU to
one pod.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import fraction, mib, node, pod, whole
from test_placement_preemption import books, untouched

from gpufrac.contract.request import ComputeMode
from gpufrac.placement.consolidation import (
    Consolidation,
    MoveBudget,
    NoConsolidation,
    Why,
    plan_consolidation,
    relocate,
)
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import PendingPod

SM = ComputeMode.SM_SHARING


def sound(e: Engine, placements: dict[str, Placement]) -> None:
    """Every GPU within its memory, of one mode, and an exclusive GPU held by one pod only."""
    capacity = {ledger.uuid: ledger.capacity_mib for n in e.node_names for ledger in e.ledger(n)}
    used: dict[str, int] = defaultdict(int)
    modes: dict[str, set] = defaultdict(set)
    holders: dict[str, set] = defaultdict(set)
    for uid, placement in placements.items():
        for c in placement.containers:
            for d in c.devices:
                used[d.uuid] += d.request_mib
                modes[d.uuid].add("exclusive" if c.exclusive else c.mode)
                holders[d.uuid].add(uid)
    for uuid, total in used.items():
        assert total <= capacity[uuid], f"GPU {uuid} over-committed: {total} > {capacity[uuid]}"
        assert len(modes[uuid]) == 1, f"GPU {uuid} mixes {modes[uuid]}"
        if "exclusive" in modes[uuid]:
            assert len(holders[uuid]) == 1, f"exclusive GPU {uuid} shared by {holders[uuid]}"


def applied(e: Engine, plan: Consolidation, pending: PendingPod) -> dict[str, Placement]:
    """Every pod's placement once the plan is carried out."""
    placements = {uid: e.placement_of(uid) for uid in e.bound_uids}
    for move in plan.moves:
        assert placements[move.uid] == move.source
        placements[move.uid] = move.target
    placements[pending.uid] = plan.placement
    return placements  # type: ignore[return-value]


shapes = st.sampled_from(
    [
        fraction(0.25),
        fraction(0.25),
        fraction(0.5),
        fraction(0.75),
        fraction(0.25, mode=SM),
        fraction(0.5, count=2),
        mib(3000),
        mib(6000),
        whole(1),
    ]
)
# What waits: mostly more than the pieces of free memory a busy cluster leaves.
pending_shapes = st.sampled_from(
    [fraction(0.5), fraction(0.75), fraction(0.5, count=2), fraction(0.5, mode=SM), mib(6000), whole(1)]
)


@st.composite
def fragmented(draw):
    e = Engine(policy=draw(st.sampled_from(["fgd", "binpack", "spread"])), seed=draw(st.integers(0, 3)))
    for i in range(draw(st.integers(2, 3))):
        e.add_node(node(f"n{i}", gpus=draw(st.integers(1, 2)), mib=draw(st.sampled_from([8000, 16000]))))
    placed = []
    for i in range(draw(st.integers(3, 10))):
        p = pod(
            draw(shapes),
            name=f"b{i}",
            priority=draw(st.integers(0, 3)),
            movable=draw(st.sampled_from([True, True, False])),
            queue=draw(st.sampled_from(["a", "b"])),
        )
        if isinstance(e.place(p), Placement):
            placed.append(p)
    # Often a request between the largest free piece and all the free memory: fragmentation on purpose.
    ledgers = [ledger for n in e.node_names for ledger in e.ledger(n)]
    low = max(ledger.free_mib for ledger in ledgers) + 1
    high = min(sum(ledger.free_mib for ledger in ledgers), min(ledger.capacity_mib for ledger in ledgers))
    fragmented = low <= high and draw(st.booleans())  # fits in the sum of free MiB, on no single GPU
    gpu = mib(draw(st.integers(low, high))) if fragmented else draw(pending_shapes)
    pending = pod(gpu, name="pending", priority=draw(st.integers(0, 3)), queue="a")
    return e, placed, pending


def oracle(e: Engine, pending: PendingPod, allowed: list[PendingPod]) -> int | None:
    """The fewest moves of allowed pods of one node after which the pending pod and every moved pod are
    placed (by the planner's trial), or None."""
    by_node: dict[str, list[str]] = defaultdict(list)
    for p in allowed:
        placement = e.placement_of(p.uid)
        assert placement is not None
        by_node[placement.node].append(p.uid)
    for size in range(1, len(allowed) + 1):
        for uids in by_node.values():
            for moved in itertools.combinations(uids, size):
                if relocate(e, pending, list(moved)) is not None:
                    return size
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(fragmented())
def test_a_plan_places_everyone_soundly_and_is_as_small_as_the_oracle_finds(case):
    e, placed, pending = case
    if isinstance(e.place(pending), Placement):
        return  # nothing to consolidate for
    before = books(e)
    allowed = [p for p in placed if p.movable and p.priority <= pending.priority]
    fewest = oracle(e, pending, allowed)
    found = plan_consolidation(e, pending)
    assert untouched(e, before), "the planner left the engine as it was"
    if fewest is None:
        assert isinstance(found, NoConsolidation)
        return
    assert isinstance(found, Consolidation), found
    assert len(found.moves) == fewest
    assert {m.uid for m in found.moves} <= {p.uid for p in allowed}, "only movable pods of no higher priority"
    # The pending pod gets its exact shape on the node the moves free.
    assert found.placement.node == found.node
    wanted = {c.name: c.count for c in e.demand(pending).containers}
    assert {c.container: len(c.devices) for c in found.placement.containers} == wanted
    taken = {u for c in found.placement.containers for u in c.uuids}
    for move in found.moves:
        assert move.source.node == found.node
        new = {u for c in move.target.containers for u in c.uuids}
        assert not new & taken, "a moved pod never lands on the pending pod's GPUs"
        assert (move.target.node, new) != (
            move.source.node,
            {u for c in move.source.containers for u in c.uuids},
        )
    sound(e, applied(e, found, pending))


def fragmented_pair(
    *, movable: bool = True, priority: int = 0, room_b: int = 8000
) -> tuple[Engine, PendingPod]:
    """Two one-GPU nodes of 16000 MiB. a: a 8000 MiB pod that may move and a fixed 4000 (4000 free);
    b: a fixed pod leaving ``room_b`` free. A 10000 MiB pod fits on neither, and fits on a once the
    8000 MiB pod is on b."""
    e = Engine(policy="binpack")
    for name in ("a", "b"):
        e.add_node(node(name, gpus=1, mib=16000, labels={"host": name}))
    for name, request, where, can_move, prio in (
        ("mover", 8000, "a", movable, priority),
        ("fixed-a", 4000, "a", False, 0),
        ("fixed-b", 16000 - room_b, "b", False, 0),
    ):
        p = pod(mib(request), name=name, movable=can_move, priority=prio)
        # Put where the example needs it, then booked without the selector: a moved pod may go anywhere.
        placed = e.place(pod(mib(request), name=f"{name}-probe", node_selector={"host": where}))
        assert isinstance(placed, Placement) and placed.node == where, placed
        e.forget(placed.pod_uid)
        e.assume(p, Placement(p.uid, where, placed.containers))
    return e, pod(mib(10000), name="pending", priority=1)


def test_fragmented_free_memory_is_repacked_by_moving_the_movable_pod():
    e, pending = fragmented_pair()
    assert not isinstance(e.place(pending), Placement)
    plan = plan_consolidation(e, pending)
    assert isinstance(plan, Consolidation)
    assert [(m.pod, m.source.node, m.target.node) for m in plan.moves] == [("ns/mover", "a", "b")]
    assert plan.placement.node == "a" and plan.victims == (plan.moves[0].uid,)


def test_a_pod_that_did_not_opt_in_is_never_moved():
    e, pending = fragmented_pair(movable=False)
    e.place(pending)
    plan = plan_consolidation(e, pending)
    assert isinstance(plan, NoConsolidation) and plan.why is Why.NO_MOVABLE
    assert "gpufrac.io/movable" in plan.detail


def test_a_pod_of_higher_priority_than_the_pending_one_is_never_moved():
    e, pending = fragmented_pair(priority=2)
    e.place(pending)
    plan = plan_consolidation(e, pending)
    assert isinstance(plan, NoConsolidation) and plan.why is Why.NO_MOVABLE
    e, pending = fragmented_pair(priority=1)  # equal priority may move: it is recreated, not removed
    e.place(pending)
    assert isinstance(plan_consolidation(e, pending), Consolidation)


def test_no_plan_when_the_moved_pod_would_have_no_home():
    e, pending = fragmented_pair(room_b=6000)  # 4000 + 6000 free: enough in total, but the mover fits nowhere
    e.place(pending)
    plan = plan_consolidation(e, pending)
    assert isinstance(plan, NoConsolidation) and plan.why is Why.NO_PLAN


def test_no_plan_when_the_cluster_lacks_the_memory_whatever_is_moved():
    e, pending = fragmented_pair(room_b=2000)  # 4000 + 2000 free < 10000
    e.place(pending)
    plan = plan_consolidation(e, pending)
    assert isinstance(plan, NoConsolidation) and plan.why is Why.NOT_FRAGMENTED
    assert "6000 MiB of free GPU memory" in plan.detail


def test_the_move_budget_refills_one_move_per_share_of_a_minute():
    budget = MoveBudget(4, now=0.0)
    assert budget.take(3, now=0.0) and budget.take(1, now=0.0)
    assert not budget.take(1, now=0.0), "four moves at once, then none"
    assert budget.wait_s(1, now=0.0) == pytest.approx(15.0)
    assert not budget.take(1, now=14.9)
    assert budget.take(1, now=15.0)
    assert budget.wait_s(5, now=100.0) == float("inf"), "more than a minute's moves never fit"
    assert budget.take(4, now=1000.0) and not budget.take(1, now=1000.0), "the bucket holds four at most"
    with pytest.raises(ValueError, match="per_minute=0 must be at least 1"):
        MoveBudget(0, now=0.0)
