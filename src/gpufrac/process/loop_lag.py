"""``gpufrac_event_loop_lag_seconds``: how late a controller's event loop runs what is ready to run.

A controller does everything on one asyncio loop: watch events, placement, binds, lease renewals,
probes. When a burst makes the loop busy, every write's answer waits in the socket until the loop gets
back to it, and from outside that looks like a slow API server. A timer tells the two apart: a task
sleeps ``interval_s`` and records how much later than asked it woke. Near zero means the loop had time
to spare and a slow write is the API server's (or the network's); tens of milliseconds mean each answer
also waited that long for the loop. The cost is one timer per interval, nothing per pod.

Histogram rather than a gauge: a scrape every 15 s would miss a gauge's peaks, and the buckets keep
every sample (``rate(..._sum) / rate(..._count)`` is the mean lag, ``_bucket{le="0.1"}`` how often the
loop answered within 100 ms).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

LOOP_LAG = "gpufrac_event_loop_lag_seconds"
#: How often the timer is set: often enough to see a 100-ms stall, rarely enough to cost nothing.
INTERVAL_S = 0.1
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    """Samples the running loop's lag into ``gpufrac_event_loop_lag_seconds`` of ``registry``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s!r}: the lag timer's interval must be above 0")
        self._interval = interval_s
        self._clock = clock
        self.histogram = Histogram(
            LOOP_LAG,
            "How much later than asked the event loop ran a timer (its work queued behind other work).",
            buckets=BUCKETS,
            registry=registry,
        )

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            asked = self._clock() + self._interval
            await asyncio.sleep(self._interval)
            self.histogram.observe(max(0.0, self._clock() - asked))
