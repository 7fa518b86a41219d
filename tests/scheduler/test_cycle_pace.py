"""The scheduling cycle's size: as many pods as the measured cost fits in the loop budget."""

from __future__ import annotations

from gpufrac.scheduler.cycle_pace import CyclePace


def _timed(pace: CyclePace, now: list[float], *, pods: int, seconds: float) -> None:
    with pace.cycle(pods):
        now[0] += seconds


def test_expensive_pods_get_small_cycles_and_cheap_ones_large() -> None:
    now = [0.0]
    pace = CyclePace(max_batch=512, budget_s=0.025, min_batch=8, clock=lambda: now[0])
    assert pace.size == 512  # nothing measured yet: the configured batch
    _timed(pace, now, pods=100, seconds=0.2)  # 2 ms a pod (claims): 12 fit in 25 ms
    assert pace.size == 12
    for _ in range(60):  # the cost falls to 0.1 ms a pod: 250 fit
        _timed(pace, now, pods=50, seconds=0.005)
    assert 249 <= pace.size <= 250  # (float rounding of the average)
    for _ in range(30):  # 0.01 ms a pod: capped at the configured batch
        _timed(pace, now, pods=100, seconds=0.001)
    assert pace.size == 512


def test_a_cycle_never_shrinks_below_the_floor_nor_learns_from_an_empty_one() -> None:
    now = [0.0]
    pace = CyclePace(max_batch=512, budget_s=0.025, min_batch=8, clock=lambda: now[0])
    _timed(pace, now, pods=0, seconds=5.0)  # every pod of the batch was gone: no cost learnt
    assert pace.size == 512
    _timed(pace, now, pods=1, seconds=1.0)  # a pod that took a second
    assert pace.size == 8
    assert CyclePace(max_batch=4, min_batch=8).size == 4  # a configured batch below the floor holds
