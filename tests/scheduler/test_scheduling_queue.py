"""The scheduling queue: batches of pods that arrive together, backoff, and parking of unfit pods."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpufrac.scheduler.scheduling_queue import SchedulingQueue


async def test_pods_created_together_come_out_as_one_batch_in_arrival_order() -> None:
    q: SchedulingQueue[str] = SchedulingQueue()

    async def arrive() -> None:
        for i in range(5):
            q.add(f"p{i}", f"pod{i}", queue="default")
            await asyncio.sleep(0.002)

    feeder = asyncio.create_task(arrive())
    batch = await q.next_batch(window=0.05, max_batch=100)
    await feeder
    assert [k for k, _ in batch] == [f"p{i}" for i in range(5)]


async def test_max_batch_splits_a_burst() -> None:
    q: SchedulingQueue[int] = SchedulingQueue()
    for i in range(10):
        q.add(str(i), i, queue="default")
    first = await q.next_batch(window=0, max_batch=4)
    second = await q.next_batch(window=0, max_batch=100)
    assert [v for _, v in first] == [0, 1, 2, 3]
    assert [v for _, v in second] == [4, 5, 6, 7, 8, 9]


async def test_a_failed_bind_waits_a_doubling_delay() -> None:
    q: SchedulingQueue[str] = SchedulingQueue(backoff_initial=0.05, backoff_max=1.0)
    started = time.monotonic()  # before the back-off: a pause between the two cannot shorten the wait
    assert q.back_off("a", "pod", queue="default") == pytest.approx(0.05)
    batch = await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=2)
    assert batch == [("a", "pod")]
    assert time.monotonic() - started >= 0.04
    assert q.back_off("a", "pod", queue="default") == pytest.approx(0.1)
    q.forget_failures("a")
    q.remove("a")
    assert q.back_off("a", "pod", queue="default") == pytest.approx(0.05)


async def test_parked_pods_wait_for_a_cluster_change() -> None:
    q: SchedulingQueue[str] = SchedulingQueue(unschedulable_resync=60)
    q.park("big", "pod", queue="research")
    assert q.pending_by_queue() == {"research": 1}
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=0.1)
    q.cluster_changed()
    assert await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=1) == [("big", "pod")]


async def test_parked_pods_are_retried_after_the_resync_period_anyway() -> None:
    q: SchedulingQueue[str] = SchedulingQueue(unschedulable_resync=0.1)
    q.park("big", "pod", queue="default")
    assert await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=2) == [("big", "pod")]


async def test_an_edited_pod_leaves_the_parking_but_a_status_update_does_not() -> None:
    q: SchedulingQueue[str] = SchedulingQueue()
    q.park("p", "v1", queue="default")
    q.update("p", "v2")  # status write: stays parked, newest version kept
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=0.05)
    q.add("p", "v3", queue="default")  # user edit
    assert await q.next_batch(window=0, max_batch=10) == [("p", "v3")]


async def test_removed_pods_never_come_out() -> None:
    q: SchedulingQueue[str] = SchedulingQueue()
    q.add("a", "x", queue="default")
    q.back_off("b", "y", queue="default")
    q.park("c", "z", queue="default")
    for key in "abc":
        q.remove(key)
    assert len(q) == 0 and q.pending_by_queue() == {}


async def test_a_cancellation_that_arrives_with_a_pod_stops_the_wait_and_loses_no_pod() -> None:
    """The scheduler stops by cancelling the loop that waits here; on Python 3.11 a cancellation that
    arrived as a pod was added used to be swallowed, and the scheduler's shutdown then hung."""
    q: SchedulingQueue[str] = SchedulingQueue(unschedulable_resync=60.0)
    q.park("unfit", "parked pod", queue="default")  # gives the wait a deadline (its resync)
    waiting = asyncio.create_task(q.next_batch(window=0, max_batch=10))
    await asyncio.sleep(0)  # one step: next_batch runs until it waits on the wake-up event
    q.add("p", "pod", queue="default")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert [k for k, _ in await q.next_batch(window=0, max_batch=10)] == ["p"]
    assert q.pending_by_queue() == {"default": 1}  # the parked pod is still parked


async def test_a_deferred_pod_comes_back_after_its_delay_in_delay_order_without_a_failure() -> None:
    q: SchedulingQueue[str] = SchedulingQueue(backoff_initial=0.05)
    q.defer("later", "pod-later", queue="default", delay_s=0.2)
    q.defer("sooner", "pod-sooner", queue="default", delay_s=0.05)
    first = await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=2)
    assert first == [("sooner", "pod-sooner")], "the one due first comes first, alone"
    second = await asyncio.wait_for(q.next_batch(window=0, max_batch=10), timeout=2)
    assert second == [("later", "pod-later")]
    # Deferring is not failing: a bind failure afterwards still waits the first backoff step.
    assert q.back_off("later", "pod-later", queue="default") == pytest.approx(0.05)
