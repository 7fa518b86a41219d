"""The event-loop lag timer: a loop kept busy shows up in gpufrac_event_loop_lag_seconds."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from gpufrac.process.loop_lag import LOOP_LAG, LoopLag


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else ""): s.value
        for family in registry.collect()
        if family.name == LOOP_LAG
        for s in family.samples
    }


async def test_a_blocked_loop_is_recorded_as_lag() -> None:
    """Work that holds the loop for 0.3 s makes the timer wake at least 0.2 s late (it was set at most
    0.1 s before the work began): a sample lands above the 0.1-s bucket, and the sum carries it."""
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval_s=0.1)
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)  # the timer is set
        time.sleep(0.3)  # a synchronous stretch of work on the loop
        await asyncio.sleep(0.15)  # the late timer fires and is recorded
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    samples = _samples(registry)
    assert samples[f"{LOOP_LAG}_count"] >= 1
    assert samples[f"{LOOP_LAG}_count"] - samples[f"{LOOP_LAG}_bucket{{le=0.1}}"] >= 1
    assert samples[f"{LOOP_LAG}_sum"] >= 0.19


def test_a_zero_interval_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"interval_s=0: the lag timer's interval must be above 0"):
        LoopLag(CollectorRegistry(), interval_s=0)
