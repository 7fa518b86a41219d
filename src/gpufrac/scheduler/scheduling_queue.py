"""The scheduling queue: which pending pods the next engine call sees.

Three places, as in kube-scheduler: ``active`` (try in the next batch, in arrival order), ``backoff``
(a bind failed; try again after a delay that doubles per failure) and ``unschedulable`` (no node fits
now; try again when the cluster changes, or after ``unschedulable_resync``). Keeping unschedulable
pods out of ``active`` is what stops a big unplaceable pod from costing an engine call per batch.

A pod is in at most one place; ``add`` with a newer version of a pod replaces its entry wherever it is
and moves it to ``active`` (a user who edits a pod expects a new attempt). ``next_batch`` waits for the
first active pod, then for ``window`` more, so pods created together are placed together.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Entry(Generic[T]):
    item: T
    queue: str
    failures: int = 0
    ready_at: float = 0.0
    parked_at: float = field(default=0.0)


class SchedulingQueue(Generic[T]):
    def __init__(
        self,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        unschedulable_resync: float = 60.0,
    ) -> None:
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._resync = unschedulable_resync
        self._active: dict[str, _Entry[T]] = {}
        self._backoff: dict[str, _Entry[T]] = {}
        self._unschedulable: dict[str, _Entry[T]] = {}
        self._failures: dict[str, int] = {}
        self._wake = asyncio.Event()

    def __contains__(self, key: object) -> bool:
        return key in self._active or key in self._backoff or key in self._unschedulable

    def __len__(self) -> int:
        return len(self._active) + len(self._backoff) + len(self._unschedulable)

    def add(self, key: str, item: T, *, queue: str) -> None:
        """A new or changed pending pod: try it in the next batch (a pod in backoff keeps its delay)."""
        if key in self._backoff:
            entry = self._backoff[key]
            entry.item, entry.queue = item, queue
            return
        self._unschedulable.pop(key, None)
        entry = self._active.get(key)
        if entry is None:
            self._active[key] = _Entry(item=item, queue=queue, failures=self._failures.get(key, 0))
        else:
            entry.item, entry.queue = item, queue
        self._wake.set()

    def update(self, key: str, item: T) -> None:
        """A newer version of a queued pod that must not change where it waits."""
        for place in (self._active, self._backoff, self._unschedulable):
            if key in place:
                place[key].item = item
                return

    def remove(self, key: str) -> None:
        self._active.pop(key, None)
        self._backoff.pop(key, None)
        self._unschedulable.pop(key, None)
        self._failures.pop(key, None)

    def get(self, key: str) -> T | None:
        for place in (self._active, self._backoff, self._unschedulable):
            entry = place.get(key)
            if entry is not None:
                return entry.item
        return None

    def back_off(self, key: str, item: T, *, queue: str) -> float:
        """Try ``key`` again after a delay that doubles with each failure; returns the delay."""
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        delay = min(self._backoff_max, self._backoff_initial * 2 ** (failures - 1))
        self._active.pop(key, None)
        self._unschedulable.pop(key, None)
        self._backoff[key] = _Entry(
            item=item, queue=queue, failures=failures, ready_at=time.monotonic() + delay
        )
        self._wake.set()
        return delay

    def defer(self, key: str, item: T, *, queue: str, delay_s: float) -> None:
        """Try ``key`` again after ``delay_s``, without counting a failure (work it needs was put off)."""
        self._active.pop(key, None)
        self._unschedulable.pop(key, None)
        self._backoff[key] = _Entry(
            item=item, queue=queue, failures=self._failures.get(key, 0), ready_at=time.monotonic() + delay_s
        )
        self._wake.set()

    def park(self, key: str, item: T, *, queue: str) -> None:
        """No node fits ``key`` now: keep it aside until the cluster changes."""
        self._active.pop(key, None)
        self._backoff.pop(key, None)
        self._unschedulable[key] = _Entry(item=item, queue=queue, parked_at=time.monotonic())

    def forget_failures(self, key: str) -> None:
        self._failures.pop(key, None)

    def cluster_changed(self) -> None:
        """Something that may make a parked pod fit happened: move every parked pod to active."""
        if not self._unschedulable:
            return
        for key, entry in self._unschedulable.items():
            self._active[key] = entry
        self._unschedulable.clear()
        self._wake.set()

    def waiting(self) -> list[tuple[str, T]]:
        """(queue, item) of every pod waiting anywhere (active, backoff, unschedulable)."""
        return [
            (e.queue, e.item)
            for place in (self._active, self._backoff, self._unschedulable)
            for e in place.values()
        ]

    def pending_by_queue(self) -> dict[str, int]:
        counts = Counter(
            e.queue for place in (self._active, self._backoff, self._unschedulable) for e in place.values()
        )
        return dict(counts)

    def _promote(self, now: float) -> float | None:
        """Move due backoff and stale parked entries to active; seconds until the next one is due."""
        next_due: float | None = None
        for key in [k for k, e in self._backoff.items() if e.ready_at <= now]:
            self._active[key] = self._backoff.pop(key)
        for entry in self._backoff.values():
            wait = entry.ready_at - now
            next_due = wait if next_due is None else min(next_due, wait)
        for key in [k for k, e in self._unschedulable.items() if now - e.parked_at >= self._resync]:
            self._active[key] = self._unschedulable.pop(key)
        for entry in self._unschedulable.values():
            wait = entry.parked_at + self._resync - now
            next_due = wait if next_due is None else min(next_due, wait)
        return next_due

    async def next_batch(self, *, window: float, max_batch: int) -> list[tuple[str, T]]:
        """Wait for an active pod, then ``window`` seconds more; take up to ``max_batch`` in order."""
        while True:
            next_due = self._promote(time.monotonic())
            if self._active:
                break
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
            # arrives as the event is set, and this loop would then never stop (a hung shutdown).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_due):
                    await self._wake.wait()
        if window > 0 and len(self._active) < max_batch:
            await asyncio.sleep(window)
            self._promote(time.monotonic())
        batch: list[tuple[str, T]] = []
        for key in list(self._active)[:max_batch]:
            batch.append((key, self._active.pop(key).item))
        return batch
