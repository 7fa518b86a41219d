"""Time-based fair share: the decayed usage history (gpufrac.placement.usage_history) and how it moves the
over-quota part of the fair share (KAI Scheduler's time-aware fairness), never the deserved quota."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import mib, node, pod
from test_fair_share import check_conservation_caps_and_deserved, trees

from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.fair_share import QueueBook, fair_shares
from gpufrac.placement.model import Queue, QueueResource, Quota
from gpufrac.placement.queue_shares import QueueAmount, request_amount
from gpufrac.placement.usage_history import ALL, OVER_QUOTA, UsageHistory
from gpufrac.placement.usage_history import held as counted_held

MEM = QueueResource.GPU_MEMORY
GPUS = QueueResource.GPUS
HOUR = 3600.0


def held(**amounts: int) -> dict[QueueResource, dict[str, int]]:
    return {MEM: dict(amounts), GPUS: {}}


def cap(mib_total: int) -> dict[QueueResource, int]:
    return {MEM: mib_total, GPUS: 0}


# -- the history --------------------------------------------------------------------------------------


def test_a_queue_scores_its_part_of_the_capacity_not_of_what_was_used():
    history = UsageHistory(HOUR)
    history.record(0.0, held(a=50, b=10), cap(100))
    history.record(600.0, held(a=50, b=10), cap(100))
    scores = history.normalized(MEM)
    # a held half the cluster, b a tenth: a quiet cluster does not make b's tenth look like a lot.
    assert scores["a"] == pytest.approx(0.5)
    assert scores["b"] == pytest.approx(0.1)


def test_usage_halves_after_one_half_life_of_holding_nothing():
    history = UsageHistory(HOUR)
    history.seed([("a", MEM, 0.8)], cap(100))
    history.record(0.0, held(), cap(100))
    history.record(HOUR, held(), cap(100))
    assert history.normalized(MEM)["a"] == pytest.approx(0.4)
    history.record(2 * HOUR, held(), cap(100))
    assert history.normalized(MEM)["a"] == pytest.approx(0.2)


def test_recent_use_counts_more_than_old_use():
    history = UsageHistory(HOUR)
    history.record(0.0, held(old=100), cap(100))
    history.record(HOUR, held(new=100), cap(100))  # old had all of it for the first hour
    history.record(2 * HOUR, held(), cap(100))  # new had all of it for the second hour
    scores = history.normalized(MEM)
    assert scores["new"] == pytest.approx(2 * scores["old"])  # an hour younger: twice the weight
    assert scores["new"] + scores["old"] == pytest.approx(1.0)


def test_a_seed_is_taken_only_by_an_empty_history_and_is_clipped():
    history = UsageHistory(HOUR)
    history.seed([("a", MEM, 1.7), ("b", MEM, -1.0)], cap(100))
    assert history.normalized(MEM) == {"a": pytest.approx(1.0)}
    history.record(0.0, held(), cap(100))
    history.seed([("c", MEM, 0.5)], cap(100))
    assert "c" not in history.normalized(MEM)


def test_a_clock_that_goes_back_adds_nothing_and_a_bad_half_life_is_refused():
    history = UsageHistory(HOUR)
    history.record(100.0, held(a=100), cap(100))
    history.record(50.0, held(a=100), cap(100))
    assert history.normalized(MEM) == {}
    with pytest.raises(ValueError, match="half_life_s must be positive"):
        UsageHistory(0)


def test_by_default_only_use_above_the_deserved_quota_counts():
    book = QueueBook()
    book.replace([Queue("guaranteed", gpu_memory=Quota(deserved=60)), Queue("burst"), Queue("parent")])
    book.replace([*book.queues, Queue("child", parent="parent", gpu_memory=Quota(deserved=10))])
    book.charge("guaranteed", 50)
    book.charge("burst", 30)
    book.charge("child", 25)
    capacity = cap(200)
    assert counted_held(book, capacity)[MEM] == {"guaranteed": 0, "burst": 30, "parent": 25, "child": 15}
    assert counted_held(book, capacity, ALL)[MEM] == {
        "guaranteed": 50,
        "burst": 30,
        "parent": 25,
        "child": 25,
    }
    assert OVER_QUOTA != ALL
    with pytest.raises(ValueError, match="counted='some'"):
        counted_held(book, capacity, "some")


# -- the share ----------------------------------------------------------------------------------------


def pair(**extra) -> list[Queue]:
    return [Queue(name, gpu_memory=Quota(**extra)) for name in ("a", "b")]


def test_a_queue_that_used_the_cluster_gets_less_of_the_over_quota_part():
    queues, demand = pair(over_quota_weight=1.0), {"a": 160, "b": 160}
    assert fair_shares(queues, demand, 160) == {"a": 80.0, "b": 80.0}
    # KAI's portion max(w + k (w - u), 0): a (u = 1) gets 0.5 + 0.5 (0.5 - 1) = 0.25, b 0.75.
    shares = fair_shares(queues, demand, 160, usage={"a": 1.0}, k=0.5)
    assert shares["a"] == pytest.approx(40.0)
    assert shares["b"] == pytest.approx(120.0)
    # k = 0, or no history: the plain share.
    assert fair_shares(queues, demand, 160, usage={"a": 1.0}, k=0.0) == {"a": 80.0, "b": 80.0}


def test_the_deserved_quota_is_not_touched_by_history():
    queues, demand = pair(deserved=60, over_quota_weight=1.0), {"a": 160, "b": 160}
    shares = fair_shares(queues, demand, 160, usage={"a": 1.0}, k=10.0)
    assert shares["a"] == pytest.approx(60.0)  # the over-quota 40 all went to b
    assert shares["b"] == pytest.approx(100.0)


def test_when_every_queue_used_too_much_the_plain_weights_still_divide_everything():
    queues, demand = pair(over_quota_weight=1.0), {"a": 160, "b": 160}
    shares = fair_shares(queues, demand, 160, usage={"a": 1.0, "b": 1.0}, k=4.0)
    assert shares == {"a": pytest.approx(80.0), "b": pytest.approx(80.0)}


def test_a_parents_own_pods_are_judged_by_what_its_children_did_not_use():
    queues = [Queue("p", gpu_memory=Quota(over_quota_weight=1.0)), Queue("c", parent="p")]
    demand = {"p": 100, "c": 100}
    plain = fair_shares(queues, demand, 100)
    assert plain["c"] == pytest.approx(50.0)
    # p's subtree used 0.6 of the cluster, all of it by c: c gets less than its plain half.
    timed = fair_shares(queues, demand, 100, usage={"p": 0.6, "c": 0.6}, k=1.0)
    assert timed["c"] < 50.0
    assert timed["p"] == pytest.approx(100.0)


@given(
    trees(leaf_demand_only=True),
    st.lists(st.floats(0, 1.5, allow_nan=False), min_size=8, max_size=8),
    st.sampled_from([0.1, 0.5, 1.0, 3.0]),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_history_moves_shares_but_keeps_conservation_caps_and_deserved(case, scores, k):
    queues, demand, capacity = case
    usage = {q.name: scores[i] for i, q in enumerate(queues)}
    shares = fair_shares(queues, demand, capacity, usage=usage, k=k)
    check_conservation_caps_and_deserved(queues, demand, capacity, shares)


# -- the engine ---------------------------------------------------------------------------------------


def test_the_engine_orders_and_reclaims_by_the_time_based_share():
    engine = Engine(policy="binpack", queues=pair(over_quota_weight=1.0))
    engine.add_node(node("n1", gpus=2, mib=80 * 1024))
    pending = [pod(mib(40 * 1024), name=f"{q}{i}", queue=q) for q in ("a", "b") for i in range(4)]
    plain = engine.queue_shares(waiting=[])
    assert plain.fair_share("a") == plain.fair_share("b") == 0  # nobody asks yet
    waiting = [QueueAmount(p.queue, request_amount(p.gpu, 80 * 1024)) for p in pending]
    assert engine.queue_shares(waiting=waiting).fair_share("a") == 80 * 1024
    engine.set_usage_history({MEM: {"a": 1.0}}, k=0.5)
    shares = engine.queue_shares(waiting=waiting)
    assert (shares.fair_share("a"), shares.fair_share("b")) == (40 * 1024, 120 * 1024)
    # Queue order follows it: of one batch, b (which used nothing) is placed first and gets 3 GPUs' worth.
    decisions = engine.schedule(pending)
    placed = [p.name for p, d in zip(pending, decisions, strict=True) if isinstance(d, Placement)]
    assert sorted(placed) == ["a0", "b0", "b1", "b2"]
