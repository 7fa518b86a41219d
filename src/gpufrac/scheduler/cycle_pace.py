"""How many pods the next scheduling cycle takes, so that one cycle holds the event loop only briefly.

A cycle (read the batch's pods, place them, book them, start their binds) runs on the event loop that
also reads every answer of the scheduler's writes. With claims, a pod costs the cycle milliseconds (its
claims planned and held besides its placement), and a cycle of a few hundred pods held the loop for
100-270 ms at a time: each finalizer, status and Binding answer the API server had sent waited that
long before it was read, the next write of the pod started that much later, and the scheduler's
``gpufrac_event_loop_lag_seconds`` averaged 55-58 ms during a 2,000-claim burst (docs/benchmarks.md,
"The scheduler's own loop"). So the cycle takes as many pods as fit in ``budget_s`` at the per-pod
cost measured in the cycles before (a moving average), between ``min_batch`` and the configured
``max_batch``; the rest wait for the next cycle, one loop turn later. Cheap pods (whole GPUs, a
fraction: tens of microseconds to a millisecond each) still go in batches of tens to hundreds, which
the batch order's look-ahead (``Policy.batch_key``) sorts as before; a larger ``cycle_budget_ms`` gives it
larger batches at the price of answers read later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Most seconds a cycle should hold the event loop (the scheduler's ``cycle_budget_ms``).
CYCLE_BUDGET_S = 0.025
#: The fewest pods a cycle takes, whatever they cost (the batch order's look-ahead needs a few).
MIN_BATCH = 8


class CyclePace:
    """The next cycle's batch size (``size``), from the cost of the cycles timed with ``cycle``."""

    def __init__(
        self,
        *,
        max_batch: int,
        budget_s: float = CYCLE_BUDGET_S,
        min_batch: int = MIN_BATCH,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._max = max_batch
        self._min = min(min_batch, max_batch)
        self._budget_s = budget_s
        self._clock = clock
        self._per_pod_s: float | None = None

    @property
    def size(self) -> int:
        if not self._per_pod_s:
            return self._max
        return max(self._min, min(self._max, int(self._budget_s / self._per_pod_s)))

    @contextmanager
    def cycle(self, pods: int) -> Iterator[None]:
        """Time a cycle of ``pods`` pods; its cost per pod moves the average."""
        started = self._clock()
        yield
        if pods <= 0:
            return
        per_pod = (self._clock() - started) / pods
        previous = self._per_pod_s
        self._per_pod_s = per_pod if previous is None else 0.7 * previous + 0.3 * per_pod
