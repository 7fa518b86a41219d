"""Victims for a gang: enough members placed together after the victims leave, or no victim at all.

The rules checked on random small clusters: a plan's victims are only pods the rules allow; once they
are gone the engine's own gang statement places at least minMember members; no victim can be spared;
the engine is left as it was; and when even every allowed victim leaving is not enough, there is no plan.
Consolidation for a gang likewise: only movable pods of no higher priority move, each at most once, and
with each at the new home the plan names, the gang statement places minMember members.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import fraction, mib, node, pod, whole
from test_placement_preemption import books, untouched

from gpufrac.placement.consolidation import NoConsolidation, Why
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.gang_preemption import GangPreemption, find_gang_victims, plan_gang_consolidation
from gpufrac.placement.model import PendingPod, Queue
from gpufrac.placement.preemption import Kind
from gpufrac.placement.queue_shares import QueueAmount, request_amount


def gang_fits_without(e: Engine, members: list[PendingPod], min_member: int, victims) -> bool:
    """The gang statement on the books with ``victims`` gone; the engine is restored."""
    with e.statement() as what_if:
        for uid in victims:
            what_if.evict(uid)
        decisions = e.schedule(members, gang=True, min_member=min_member, statement=what_if)
        return sum(isinstance(d, Placement) for d in decisions) >= min_member


def test_a_gang_takes_room_on_two_nodes_in_one_plan():
    e = Engine(policy="binpack")
    for name in ("a", "b"):
        e.add_node(node(name, gpus=1))
    low = [pod(whole(1), name=f"low-{n}", priority=0) for n in ("a", "b")]
    for p in low:
        assert isinstance(e.place(p), Placement)
    gang = [pod(whole(1), name=f"member-{i}", priority=5) for i in range(2)]
    before = books(e)
    plan = find_gang_victims(e, gang, min_member=2, kind=Kind.PREEMPT)
    assert untouched(e, before)
    assert plan is not None
    assert set(plan.victims) == {p.uid for p in low}
    assert sorted(plan.nodes) == ["a", "b"]
    assert sorted(plan.node_of.values()) == ["a", "b"]
    assert set(plan.node_of) == {m.uid for m in gang}


def test_no_victim_is_taken_for_half_a_gang():
    # Node b's GPU is held by a pod of the gang's own priority: one member could preempt on a, the
    # other has nowhere to go, so nobody is evicted.
    e = Engine(policy="binpack")
    for name in ("a", "b"):
        e.add_node(node(name, gpus=1))
    assert isinstance(e.place(pod(whole(1), name="low", priority=0)), Placement)
    assert isinstance(e.place(pod(whole(1), name="peer", priority=5)), Placement)
    gang = [pod(whole(1), name=f"member-{i}", priority=5) for i in range(2)]
    before = books(e)
    assert find_gang_victims(e, gang, min_member=2, kind=Kind.PREEMPT) is None
    assert untouched(e, before)
    # With minMember 1 the one member that can get room is enough.
    plan = find_gang_victims(e, gang, min_member=1, kind=Kind.PREEMPT)
    assert plan is not None and len(plan.victims) == 1 and len(plan.placements) == 1


def test_two_members_never_count_on_the_same_freed_room():
    # One GPU: a low pod of 8000 MiB and 8000 MiB free. Two 8000 MiB members fit once it leaves;
    # three do not, whatever is evicted.
    e = Engine(policy="binpack")
    e.add_node(node("a", gpus=1, mib=16000))
    low = pod(mib(8000), name="low", priority=0)
    assert isinstance(e.place(low), Placement)
    two = [pod(mib(8000), name=f"two-{i}", priority=5) for i in range(2)]
    plan = find_gang_victims(e, two, min_member=2, kind=Kind.PREEMPT)
    assert plan is not None and plan.victims == (low.uid,)
    three = [pod(mib(8000), name=f"three-{i}", priority=5) for i in range(3)]
    assert find_gang_victims(e, three, min_member=3, kind=Kind.PREEMPT) is None


def test_a_gang_reclaims_only_up_to_its_queue_share():
    e = Engine(policy="binpack", queues=[Queue("a", deserved_share=0.5), Queue("b", deserved_share=0.5)])
    e.add_node(node("n", gpus=4, mib=16000))
    for i in range(4):
        assert isinstance(e.place(pod(whole(1), name=f"b{i}", queue="b")), Placement)
    two = [pod(whole(1), name=f"a2-{i}", queue="a") for i in range(2)]
    plan = find_gang_victims(e, two, min_member=2, kind=Kind.RECLAIM)
    assert plan is not None and len(plan.victims) == 2
    # Three GPUs would put queue a past its deserved half of the cluster.
    three = [pod(whole(1), name=f"a3-{i}", queue="a") for i in range(3)]
    assert find_gang_victims(e, three, min_member=3, kind=Kind.RECLAIM) is None
    # The same with the scheduler's books, taken once before the search (the gang as waiting demand):
    # each member is judged with the members before it placed, not against the books as they began.
    waiting = [QueueAmount("a", request_amount(m.gpu, 16000)) for m in three]
    assert (
        find_gang_victims(e, three, min_member=3, kind=Kind.RECLAIM, shares=e.queue_shares(waiting=waiting))
        is None
    )
    plan = find_gang_victims(
        e, two, min_member=2, kind=Kind.RECLAIM, shares=e.queue_shares(waiting=waiting[:2])
    )
    assert plan is not None and len(plan.victims) == 2


def test_excluded_pods_are_not_victims():
    e = Engine(policy="binpack")
    e.add_node(node("a", gpus=2))
    a, b = pod(whole(1), name="a", priority=0), pod(whole(1), name="b", priority=0)
    for p in (a, b):
        assert isinstance(e.place(p), Placement)
    gang = [pod(whole(1), name="m", priority=5)]
    plan = find_gang_victims(e, gang, min_member=1, kind=Kind.PREEMPT, exclude=[a.uid])
    assert plan is not None and plan.victims == (b.uid,)
    assert find_gang_victims(e, gang, min_member=1, kind=Kind.PREEMPT, exclude=[a.uid, b.uid]) is None


shapes = st.sampled_from([fraction(0.25), fraction(0.5), fraction(0.75), whole(1), whole(2), mib(6000)])


@st.composite
def cases(draw):
    e = Engine(policy=draw(st.sampled_from(["fgd", "binpack", "spread"])), seed=draw(st.integers(0, 3)))
    for i in range(draw(st.integers(1, 3))):
        e.add_node(node(f"n{i}", gpus=draw(st.integers(1, 3)), mib=draw(st.sampled_from([8000, 16000]))))
    placed = []
    for i in range(draw(st.integers(1, 9))):
        p = pod(draw(shapes), name=f"b{i}", priority=draw(st.integers(0, 3)), queue="a")
        if isinstance(e.place(p), Placement):
            placed.append(p)
    priority = draw(st.integers(1, 4))
    size = draw(st.integers(1, 4))
    gang = [pod(draw(shapes), name=f"m{i}", priority=priority, queue="a") for i in range(size)]
    return e, placed, gang, draw(st.integers(1, size))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_a_plan_places_the_gang_and_spares_no_victim_it_could(case):
    e, placed, gang, min_member = case
    if gang_fits_without(e, gang, min_member, []):
        return  # no preemption needed
    allowed = {p.uid for p in placed if p.priority < gang[0].priority}
    before = books(e)
    plan = find_gang_victims(e, gang, min_member=min_member, kind=Kind.PREEMPT)
    assert untouched(e, before), "the search left the engine as it was"
    if plan is None:
        return
    assert plan.victims and set(plan.victims) <= allowed
    assert len(set(plan.victims)) == len(plan.victims)
    assert gang_fits_without(e, gang, min_member, plan.victims)
    assert len(plan.placements) >= min_member
    for spared in plan.victims:
        assert not gang_fits_without(e, gang, min_member, [v for v in plan.victims if v != spared])
    assert untouched(e, before)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_no_plan_when_every_allowed_victim_leaving_is_not_enough(case):
    e, placed, gang, min_member = case
    allowed = [p.uid for p in placed if p.priority < gang[0].priority]
    if gang_fits_without(e, gang, min_member, allowed):
        return
    assert find_gang_victims(e, gang, min_member=min_member, kind=Kind.PREEMPT) is None


def test_a_gang_that_asks_for_no_gpu_has_no_victims():
    e = Engine(policy="binpack")
    e.add_node(node("a", gpus=1))
    assert find_gang_victims(e, [pod(name="cpu-only", priority=5)], min_member=1, kind=Kind.PREEMPT) is None


@pytest.mark.parametrize("min_member", [0, -1])
def test_min_member_below_one_has_no_plan(min_member):
    e = Engine(policy="binpack")
    e.add_node(node("a", gpus=1))
    assert find_gang_victims(e, [pod(whole(1), priority=5)], min_member=min_member, kind=Kind.PREEMPT) is None


def gang_fits_after_moves(
    e: Engine, members: list[PendingPod], min_member: int, plan: GangPreemption
) -> bool:
    """The gang statement with each moved pod at its new home; the engine is restored."""
    with e.statement() as what_if:
        moved = [what_if.evict(m.uid)[0] for m in plan.moves]
        for booked, m in zip(moved, plan.moves, strict=True):
            what_if.assume(booked, m.target)
        decisions = e.schedule(members, gang=True, min_member=min_member, statement=what_if)
        return sum(isinstance(d, Placement) for d in decisions) >= min_member


def test_a_gang_gets_two_whole_gpus_by_one_move():
    # Three one-GPU nodes: two hold a movable half each, one is free. Moving one half next to the other
    # frees a second GPU for a gang of two full-GPU pods.
    e = Engine(policy="spread")
    for name in ("a", "b", "c"):
        e.add_node(node(name, gpus=1, mib=16000))
    halves = [pod(mib(8000), name=f"half-{n}", movable=True) for n in ("a", "b")]
    for p in halves:
        assert isinstance(e.place(p), Placement)
    assert len({e.placement_of(p.uid).node for p in halves}) == 2
    gang = [pod(mib(16000), name=f"full-{i}") for i in range(2)]
    assert not gang_fits_without(e, gang, 2, [])
    before = books(e)
    plan = plan_gang_consolidation(e, gang, min_member=2)
    assert untouched(e, before)
    assert isinstance(plan, GangPreemption) and plan.kind is Kind.CONSOLIDATE
    assert len(plan.moves) == 1 and plan.victims == (plan.moves[0].uid,)
    assert plan.moves[0].target.node != plan.moves[0].source.node
    assert gang_fits_after_moves(e, gang, 2, plan)


def test_no_pod_is_moved_for_a_gang_that_still_would_not_fit():
    e = Engine(policy="spread")
    for name in ("a", "b"):
        e.add_node(node(name, gpus=1, mib=16000))
    for n in ("a", "b"):
        assert isinstance(e.place(pod(mib(8000), name=f"half-{n}", movable=True)), Placement)
    three = [pod(mib(16000), name=f"full-{i}") for i in range(2)]
    plan = plan_gang_consolidation(e, three, min_member=2)
    assert isinstance(plan, NoConsolidation)
    assert plan.why in (Why.NO_PLAN, Why.NOT_FRAGMENTED)


@st.composite
def fragmented(draw):
    """Spread fractions (many of them movable) over a few GPUs, and a gang of larger pieces: free memory
    in pieces, the case consolidation is for."""
    e = Engine(policy="spread", seed=draw(st.integers(0, 3)))
    for i in range(draw(st.integers(2, 4))):
        e.add_node(node(f"n{i}", gpus=draw(st.integers(1, 2)), mib=16000))
    for i in range(draw(st.integers(2, 8))):
        p = pod(
            draw(st.sampled_from([fraction(0.25), fraction(0.5), mib(6000)])),
            name=f"f{i}",
            priority=draw(st.integers(0, 3)),
            movable=draw(st.booleans()),
        )
        e.place(p)
    size = draw(st.integers(1, 3))
    shape = draw(st.sampled_from([fraction(0.75), mib(16000), whole(1), fraction(0.5, count=2)]))
    priority = draw(st.integers(1, 4))
    gang = [pod(shape, name=f"m{i}", priority=priority) for i in range(size)]
    return e, gang, draw(st.integers(1, size))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(fragmented())
def test_a_gang_consolidation_moves_only_movable_pods_once_and_places_the_gang(case):
    e, gang, min_member = case
    if gang_fits_without(e, gang, min_member, []):
        return
    before = books(e)
    plan = plan_gang_consolidation(e, gang, min_member=min_member)
    assert untouched(e, before), "the search left the engine as it was"
    if isinstance(plan, NoConsolidation):
        return
    moved = [m.uid for m in plan.moves]
    assert moved and len(set(moved)) == len(moved)
    for uid in moved:
        booked = e.bound_pod(uid)
        assert booked.movable and booked.priority <= gang[0].priority
    assert gang_fits_after_moves(e, gang, min_member, plan)
    assert len(plan.placements) >= min_member
    assert untouched(e, before)
