"""The binding cycle: what happens to a pod after the scheduling cycle placed it (and the cache assumed it).

Binds run in the background, at most ``bind_concurrency`` at once, so the next scheduling cycle does not
wait for the API server. A claim pod's claims are written first (``ClaimFront.write``: its PreBind),
then the binder writes exactly what the engine placed (``gpufrac.scheduler.binder``). The outcome
decides the pod's next step:

- bound: the booking waits for the watch to confirm it; a Scheduled Event, the end-to-end latency;
- any other outcome: the assumed booking is forgotten (its room is free again) and then
  - unwritable (the API server refuses what the contract would write): reported unschedulable;
  - gone, or bound elsewhere by someone else: nothing to do;
  - a conflict or a failure: retried with backoff, a FailedBinding Event for a failure.

A pod that still carries binder-owned keys from a bind that never finished is cleaned first
(``Binder.clean_stale``) and queued again. While a pod's bind (or clean) is in flight its uid is in
``in_flight``: the scheduling cycle and the pod informer leave it alone.

At shutdown ``drain`` lets binds in flight finish, bounded by a grace period, before the lease is
released; ``busy`` tells the Event recorder a burst is being bound (Events wait, binds go first).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lightkube.resources.core_v1 import Pod

from gpufrac.contract.request import PodGpuRequest
from gpufrac.placement.decision import Placement
from gpufrac.process.controller import cancel
from gpufrac.scheduler.binder import Binder, BindResult, Outcome
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claim_front import ClaimBind
from gpufrac.scheduler.metrics import SchedulerMetrics
from gpufrac.scheduler.scheduling_queue import SchedulingQueue
from gpufrac.scheduler.status_report import StatusReporter

log = logging.getLogger(__name__)

#: Events wait while a burst is being bound: binds in flight, or one finished this recently.
EVENTS_SETTLE_S = 1.0


class BackgroundTasks:
    """A group of fire-and-forget tasks: kept referenced until done, a failure logged."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())


class BindCycle:
    """See the module docstring. ``latest`` reads a pod's newest copy from the informer (None: gone);
    ``arrived`` pops the moment a pod was first seen (for the end-to-end latency); ``queue_of`` names
    the queue a pod waits in."""

    def __init__(
        self,
        *,
        binder: Binder,
        write_claims: Callable[[Pod, ClaimBind], Awaitable[str | None]] | None,
        cache: BookingCache,
        queue: SchedulingQueue[Pod],
        queue_of: Callable[[Pod], str],
        report: StatusReporter,
        metrics: SchedulerMetrics,
        latest: Callable[[Pod], Pod | None],
        arrived: Callable[[str], float | None],
        chores: BackgroundTasks,
        concurrency: int,
    ) -> None:
        self._binder = binder
        self._write_claims = write_claims
        self._cache = cache
        self._queue = queue
        self._queue_of = queue_of
        self._report = report
        self._metrics = metrics
        self._scheduled = metrics.attempts.labels("scheduled")  # once, not per bound pod
        self._latest = latest
        self._arrived = arrived
        self._chores = chores
        self._gate = asyncio.Semaphore(concurrency)
        self._binds = BackgroundTasks()
        self._last_bound = -math.inf
        self.in_flight: set[str] = set()
        self.bound_total = 0

    def busy(self) -> bool:
        """Binds in flight, or one finished within ``EVENTS_SETTLE_S``: the Events wait (EventRecorder)."""
        return bool(self._binds.tasks) or time.monotonic() - self._last_bound < EVENTS_SETTLE_S

    def start(self, pod: Pod, gpu: PodGpuRequest, placement: Placement, claims: ClaimBind | None) -> None:
        self.in_flight.add(pod.metadata.uid)
        self._binds.spawn(self._bind(pod, gpu, placement, claims))

    def clean(self, pod: Pod) -> None:
        """Remove a stale bind's keys from the pod, then queue it again."""
        self.in_flight.add(pod.metadata.uid)
        self._chores.spawn(self._clean(pod.metadata.uid, pod))

    async def drain(self, grace: float) -> None:
        """Let binds in flight finish, for at most ``grace`` seconds; cancel the rest."""
        if not self._binds.tasks:
            return
        _, pending = await asyncio.wait(set(self._binds.tasks), timeout=grace)
        if pending:
            log.warning("%d binds did not finish before shutdown; the next leader cleans them", len(pending))
        await cancel(*pending)

    async def _bind(
        self, pod: Pod, gpu: PodGpuRequest, placement: Placement, claims: ClaimBind | None
    ) -> None:
        uid = pod.metadata.uid
        try:
            async with self._gate:
                result = None
                if claims is not None:
                    assert self._write_claims is not None  # claims come only with a claim front
                    error = await self._write_claims(pod, claims)
                    if error is not None:
                        result = BindResult(Outcome.FAILED, error, "claim")
                if result is None:
                    result = await self._binder.bind(pod, request=gpu, placement=placement)
        finally:
            self.in_flight.discard(uid)
        self._after_bind(pod, placement, result)

    def _after_bind(self, pod: Pod, placement: Placement, result: BindResult) -> None:
        uid, meta = pod.metadata.uid, pod.metadata
        if result.outcome is Outcome.BOUND:
            self._cache.finish_binding(uid)
            self.bound_total += 1
            self._last_bound = time.monotonic()
            self._scheduled.inc()
            seen = self._arrived(uid)
            if seen is not None:
                self._metrics.e2e_latency.observe(time.monotonic() - seen)
            self._queue.forget_failures(uid)
            self._report.scheduled(pod, placement)
            return
        if self._cache.forget(uid):
            self._queue.cluster_changed()
        if result.outcome is Outcome.UNWRITABLE:
            self._report.unschedulable(pod, result.detail)
            return
        if result.outcome in (Outcome.GONE, Outcome.BOUND_ELSEWHERE):
            if result.outcome is Outcome.GONE:
                self._queue.remove(uid)
            return
        if result.error_reason:
            self._metrics.bind_errors.labels(result.error_reason).inc()
        self._metrics.attempts.labels("error").inc()
        latest = self._latest(pod)
        if latest is None or (latest.spec and latest.spec.nodeName):
            return
        delay = self._queue.back_off(uid, latest, queue=self._queue_of(latest))
        log.info(
            "binding %s/%s to %s failed (%s: %s); retrying in %.1fs",
            meta.namespace,
            meta.name,
            placement.node,
            result.outcome.value,
            result.detail,
            delay,
            extra={"pod": f"{meta.namespace}/{meta.name}", "node": placement.node},
        )
        if result.outcome is Outcome.FAILED:
            self._report.failed_binding(pod, result.detail or "bind failed")

    async def _clean(self, uid: str, pod: Pod) -> None:
        try:
            result = await self._binder.clean_stale(pod)
        finally:
            self.in_flight.discard(uid)
        latest = self._latest(pod)
        if result.outcome is Outcome.GONE or latest is None:
            return
        if result.outcome is Outcome.CLEANED:
            self._queue.add(uid, latest, queue=self._queue_of(latest))
        else:
            self._queue.back_off(uid, latest, queue=self._queue_of(latest))


__all__ = ["EVENTS_SETTLE_S", "BackgroundTasks", "BindCycle"]
