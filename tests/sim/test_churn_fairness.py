"""The churn replay's fairness report: allocation against fair share, evictions, and reclaim before and
after #36 (against deserved quotas alone, and against fair shares first) side by side."""

from __future__ import annotations

import math

import pytest

from gpufrac.sim.churn import DESERVED_RULE, FAIR_SHARE_RULE, churn_replay
from gpufrac.sim.fairness import FairnessMeter, jain, weighted_percentile
from gpufrac.sim.trace import TraceNode, TracePod


def pod(name: str, qos: str, milli: int, created: int, runs: int) -> TracePod:
    return TracePod(name, 100, 1024, 1, milli, qos=qos, created=created, deleted=created + runs)


# One node of four 32 GiB GPUs (G1): 32 units of 4096 MiB, an eighth of a GPU each (125 milli). Four
# queues of equal GPU-time (5,500,000 GPU-thousandths x s each), so each deserves 8 units. D runs only
# long after the others: until then its deserved quota is spare, divided between the queues that ask.
# binpack fills GPU0 with B's two halves, GPU1 and GPU2 with C's four halves, and GPU3 with B's 3/8 and
# C's 2/8, 1/8, 1/8: one unit free. At t=20 A asks for a half (4 units), which fits nowhere.
#
# Fair shares then (demand A 4, B 11, C 20): deserved A 4, B 8, C 8; the 12 left are split evenly
# between B and C, B capped by its demand at 3: B 11, C 17. B is at its fair share, C 3 units over.
# * Reclaim against deserved quotas (before #36): B is 3 over its deserved 8, and its 3/8 on GPU3 is the
#   one victim that frees a half (with the free unit), and takes the least memory of the single victims:
#   B falls to 8, below its fair share of 11.
# * Against fair shares: B may not lose anything; C may lose 3 units: its 2/8 and one 1/8 on GPU3, two
#   victims, and C ends at 17, its fair share.
FOUR_GPUS = [TraceNode("n0", 64_000, 262_144, 4, "G1")]
CROWDED = [
    pod("b0", "B", 500, 0, 4000),
    pod("b1", "B", 500, 1, 4000),
    pod("c0", "C", 500, 2, 2200),
    pod("c1", "C", 500, 3, 2200),
    pod("c2", "C", 500, 4, 2200),
    pod("c3", "C", 500, 5, 2200),
    pod("b2", "B", 375, 6, 4000),
    pod("c4", "C", 250, 7, 2200),
    pod("c5", "C", 125, 8, 2200),
    pod("c6", "C", 125, 9, 2200),
    pod("a0", "A", 500, 20, 11000),
    pod("d0", "D", 500, 100_000, 11000),
]


def replay(rule: str):
    return churn_replay(
        nodes=FOUR_GPUS, pods=CROWDED, policy="binpack", seed=0, reclaim=True, reclaim_rule=rule
    )


def by_queue(result):
    return {q.queue: q for q in result.queues}


def test_the_old_rule_takes_from_a_queue_at_its_fair_share_and_the_new_one_does_not() -> None:
    old, new = replay(DESERVED_RULE), replay(FAIR_SHARE_RULE)
    assert [q.deserved_share for q in old.queues] == [0.25] * 4
    assert (old.reclaim_rule, new.reclaim_rule) == (DESERVED_RULE, FAIR_SHARE_RULE)
    assert {q: r.preempted for q, r in by_queue(old).items()} == {"A": 0, "B": 1, "C": 0, "D": 0}
    assert {q: r.preempted for q, r in by_queue(new).items()} == {"A": 0, "B": 0, "C": 2, "D": 0}
    # Once the plan is carried out: B's victim leaves B at 8 of its fair share 11; C's at 17 of 17.
    assert (old.below_share_evictions, new.below_share_evictions) == (1, 0)
    # The pod the victims were evicted for ran its 11,000 s: nothing wasted either way.
    assert old.wasted_evictions == new.wasted_evictions == 0
    # Both start A's pod at once.
    assert by_queue(old)["A"].pending_p99_s == by_queue(new)["A"].pending_p99_s == 0.0
    # Evictions per hour of trace time: the replay runs from t=0 to d0's departure at t=111,000.
    assert old.hours == pytest.approx(111_000 / 3600, abs=1e-3)
    assert old.evictions_per_hour == pytest.approx(1 / (111_000 / 3600), abs=1e-3)
    assert new.evictions_per_hour == pytest.approx(2 / (111_000 / 3600), abs=1e-3)


def test_without_reclaim_the_queue_below_its_share_is_starved_until_room_frees() -> None:
    off = churn_replay(nodes=FOUR_GPUS, pods=CROWDED, policy="binpack", seed=0, reclaim=False)
    assert off.reclaim_rule == "" and off.preemptions == 0 and off.evictions_per_hour == 0
    # A waits from t=20 until C's pods leave at t=2202 (c0's departure frees a half on GPU1), and its
    # half would have fitted within its fair share (4 of 4) all that time.
    a = by_queue(off)["A"]
    assert a.pending_p99_s == 2182.0
    assert a.starved_s == 2182.0
    # With reclaim (either rule) A is never starved.
    assert by_queue(replay(FAIR_SHARE_RULE))["A"].starved_s == 0.0
    assert by_queue(replay(DESERVED_RULE))["A"].starved_s == 0.0


def test_jain_and_percentiles_by_hand() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one queue holds everything: 1/n
    assert jain([0.5, 1.0]) == pytest.approx(1.5**2 / (2 * 1.25))
    assert math.isnan(jain([])) and math.isnan(jain([0.0, 0.0]))
    # 0.5 held for 90 s, 1.0 for 10 s: the 10th percentile is 0.5, the 95th is 1.0.
    assert weighted_percentile([1.0, 0.5], [10, 90], 10) == 0.5
    assert weighted_percentile([1.0, 0.5], [10, 90], 95) == 1.0


class Book:
    """A stand-in for ``QueueShares``: what each queue holds and its fair share (MiB)."""

    def __init__(self, held: dict[str, int], fair: dict[str, int]) -> None:
        self.held, self.fair = held, fair

    def allocated(self, name: str) -> int:
        return self.held.get(name, 0)

    def fair_share(self, name: str) -> int:
        return self.fair.get(name, 0)


def test_the_meter_weighs_each_state_by_how_long_it_held() -> None:
    meter = FairnessMeter(["x", "y"])
    # 30 s: x holds its whole share, y half of it with a 10-MiB pod waiting (it would fit: starved).
    meter.hold(Book({"x": 100, "y": 50}, {"x": 100, "y": 100}), {"y": 10}, 30)  # type: ignore[arg-type]
    # 10 s: y has no fair share (asks nothing): only x counts, and Jain's index of one queue is 1.
    meter.hold(Book({"x": 100}, {"x": 100}), {}, 10)  # type: ignore[arg-type]
    # 20 s: y 95 of 100 with a 10-MiB pod waiting: below its share, but by less than the pod: not starved.
    meter.hold(Book({"x": 100, "y": 95}, {"x": 100, "y": 100}), {"y": 10}, 20)  # type: ignore[arg-type]
    x, y = meter.queue("x"), meter.queue("y")
    assert (x.ratio_mean, x.ratio_p10, x.ratio_p90, x.starved_s) == (1.0, 1.0, 1.0, 0.0)
    assert y.ratio_mean == pytest.approx((0.5 * 30 + 0.95 * 20) / 50)
    assert (y.ratio_p10, y.ratio_p90, y.starved_s) == (0.5, 0.95, 30.0)
    jains = (jain([1.0, 0.5]) * 30 + 1.0 * 10 + jain([1.0, 0.95]) * 20) / 60
    assert meter.jain_index == pytest.approx(jains)


def test_a_pod_no_node_could_hold_even_empty_is_left_out_and_starves_nobody() -> None:
    # One node of four GPUs and 256 GiB of host memory. A asks for more host memory than the node has,
    # C for more GPUs: they would wait forever under any rule. Replayed, their demand raised A's and C's
    # fair share by a claim nothing could serve, and A and C counted as starved all the while (the
    # 12-node sample of the default trace and its eight-GPU, 640,000-MiB LS pods, docs/benchmarks.md).
    pods = [
        pod("b0", "B", 1000, 0, 1000),
        TracePod("a0", 100, 500_000, 1, 500, qos="A", created=0, deleted=1000),
        TracePod("c0", 100, 1024, 5, 125, qos="C", created=0, deleted=1000),
    ]
    for reclaim in (False, True):
        result = churn_replay(nodes=FOUR_GPUS, pods=pods, policy="binpack", seed=0, reclaim=reclaim)
        queues = by_queue(result)
        assert (result.pods, result.unfit, result.started) == (1, 2, 1)
        assert (queues["A"].pods, queues["A"].unfit, queues["A"].starved_s) == (0, 1, 0.0)
        assert (queues["C"].pods, queues["C"].unfit, queues["C"].starved_s) == (0, 1, 0.0)
        # B holds its whole fair share: nobody else asks for anything a node could give.
        assert queues["B"].fair_ratio_mean == 1.0 and queues["B"].unfit == 0
