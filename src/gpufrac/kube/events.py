"""core/v1 Events, recorded without slowing the caller and without flooding the API server.

``emit`` only enqueues: a scheduler that waited for an Event write per pod would halve its throughput.
A few workers write the queue out; when the queue is full the Event is dropped and counted (client-go's
broadcaster drops too: Events are for people, the pod's condition is the record machines read), except
that an Event that does not yield (a warning, a preemption) takes the place of the oldest one held back,
and one emitted with ``keep`` (a pod's eviction and whom it made room for) takes the place of the oldest
one not kept: a burst's repeated ``FailedScheduling`` warnings once filled a 10,000-Event queue and cost
preemption victims their Events (docs/benchmarks.md).

Routine Events yield to the work they describe: an Event emitted with ``yields`` (the scheduler's
``Scheduled``, one per pod) waits while ``yield_to`` answers True (the scheduler passes "a burst is being
bound"), so the API server spends its CPU on binds first (an Event costs it about as much as the Binding
it reports) and the Events follow once the burst is bound. ``max_hold_s`` bounds the wait, and at most
half the queue is held back: a burst longer than that gets its Events written as it goes, late by half
a queue, instead of dropped. Creates go out on the same lean HTTP path as the scheduler's Bindings
(``kube.stream.create_object``).

A write that fails for a reason that may pass (no answer in time, a dropped connection, 429 or a 5xx
from a busy API server) is tried again after ``retry_initial_s``, doubling, up to ``MAX_TRIES`` writes
(client-go's recorder tries an Event 12 times); a refusal (403, 422 ...) is not. What still fails is
counted in ``failed`` (the scheduler exports it) and logged, at most once a minute.

Aggregation is the light half of client-go's: a repeat of the same (object, type, reason, message)
within ``aggregate_window`` bumps ``count`` and ``lastTimestamp`` of the Event already written instead
of creating another, so a pod retried every few seconds leaves one Event that says how often.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import httpx2
from lightkube import AsyncClient
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType

from gpufrac.kube.errors import KubeError, NotFound, api_errors
from gpufrac.kube.stream import create_object

log = logging.getLogger(__name__)

#: How often a worker that yields looks again.
_YIELD_POLL_S = 0.05

#: Writes of one Event at most, the first included, when each fails for a reason that may pass.
MAX_TRIES = 5

#: A failed write is logged at most this often (the count is in ``failed``).
_FAILURE_LOG_S = 60.0

NORMAL = "Normal"
WARNING = "Warning"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about."""

    kind: str
    namespace: str
    name: str
    uid: str = ""
    api_version: str = "v1"


@dataclass(slots=True)
class _Written:
    name: str
    count: int
    first_written: float


@dataclass(frozen=True, slots=True)
class _Pending:
    regarding: ObjectRef
    type: str
    reason: str
    message: str
    at: datetime
    since: float  # monotonic, for max_hold_s
    yields: bool
    keep: bool = False  # not given up for another Event when the queue is full (``emit``)
    tries: int = 0  # writes that failed so far


class EventRecorder:
    """Writes Events for ``component`` (and ``instance``, the replica) from a bounded queue."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        component: str,
        instance: str,
        queue_size: int = 2000,
        workers: int = 4,
        aggregate_window: float = 600.0,
        remembered: int = 4096,
        yield_to: Callable[[], bool] | None = None,
        max_hold_s: float = 60.0,
        retry_initial_s: float = 1.0,
    ) -> None:
        self._client = client
        self._component = component
        self._instance = instance
        self._queue_size = queue_size
        # Two lines: Events that yield wait in their own, so a held Scheduled never delays a warning.
        self._urgent: deque[_Pending] = deque()
        self._deferred: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._workers = workers
        self._window = aggregate_window
        self._remembered = remembered
        self._written: OrderedDict[tuple[str, str, str, str], _Written] = OrderedDict()
        self._yield_to = yield_to
        self._max_hold_s = max_hold_s
        self._writing = 0
        self._retry_initial_s = retry_initial_s
        self._retrying: set[asyncio.TimerHandle] = set()
        self._failure_logged = -math.inf
        self._closing = False
        self.dropped = 0
        self.failed = 0

    def emit(
        self,
        *,
        regarding: ObjectRef,
        type: str,
        reason: str,
        message: str,
        yields: bool = False,
        keep: bool = False,
    ) -> None:
        """Queue an Event; with ``yields`` it waits while ``yield_to`` answers True (module docstring).
        With ``keep`` (a pod's eviction, and whom it made room for) a full queue gives up another Event
        for it, a routine one held back first, else the oldest that is not kept."""
        if len(self._urgent) + len(self._deferred) >= self._queue_size:
            self.dropped += 1
            if yields or not self._make_room(keep=keep):
                return
        pending = _Pending(
            regarding=regarding,
            type=type,
            reason=reason,
            message=message,
            at=datetime.now(UTC),
            since=time.monotonic(),
            yields=yields,
            keep=keep,
        )
        (self._deferred if yields and self._yield_to is not None else self._urgent).append(pending)
        self._arrived.set()

    def _make_room(self, *, keep: bool) -> bool:
        """Give up one queued Event for a new urgent one: the oldest routine one held back (a warning or
        a preemption Event does not lose to it), else, for a kept one, the oldest urgent one not kept (a
        burst's repeated FailedScheduling warnings fill the queue: a victim's Event is not to lose to
        them). False when there is none to give up."""
        if self._deferred:
            self._deferred.popleft()
            return True
        if keep:
            for i, queued in enumerate(self._urgent):
                if not queued.keep:
                    del self._urgent[i]
                    return True
        return False

    async def run(self) -> None:
        """Write Events until cancelled; on cancellation, flush what is queued for at most a second."""
        workers = [asyncio.create_task(self._work(), name=f"events-{i}") for i in range(self._workers)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._closing = True
            for handle in self._retrying:  # waiting for another try that will not come: not written
                handle.cancel()
            self.failed += len(self._retrying)
            self._retrying.clear()
            await self._flush(deadline=time.monotonic() + 1.0)

    @property
    def pending(self) -> int:
        """Events emitted and not yet written (queued, held back, being written or waiting to be tried
        again)."""
        return len(self._urgent) + len(self._deferred) + self._writing + len(self._retrying)

    def _next(self) -> _Pending | None:
        """The next Event to write now: any urgent one, else a held one once nothing holds it back (or
        it has waited ``max_hold_s``)."""
        if self._urgent:
            return self._urgent.popleft()
        if self._deferred:
            assert self._yield_to is not None
            if (
                len(self._deferred) >= self._queue_size // 2  # a long burst: half the queue stays free
                or time.monotonic() - self._deferred[0].since >= self._max_hold_s
                or not self._yield_to()
            ):
                return self._deferred.popleft()
        return None

    async def _work(self) -> None:
        while True:
            pending = self._next()
            if pending is None:
                self._arrived.clear()
                if self._deferred:  # held back: look again shortly
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_YIELD_POLL_S):
                            await self._arrived.wait()
                else:
                    await self._arrived.wait()
                continue
            self._writing += 1
            try:
                await self._write(pending)
            finally:
                self._writing -= 1

    async def _flush(self, *, deadline: float) -> None:
        while (self._urgent or self._deferred) and time.monotonic() < deadline:
            pending = (self._urgent or self._deferred).popleft()
            try:
                await asyncio.wait_for(self._write(pending), timeout=max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                return

    async def _write(self, pending: _Pending) -> None:
        ref = pending.regarding
        key = (ref.uid or f"{ref.namespace}/{ref.name}", pending.type, pending.reason, pending.message)
        seen = self._written.get(key)
        try:
            if seen is not None and time.monotonic() - seen.first_written < self._window:
                try:
                    await self._bump(ref=ref, seen=seen, at=pending.at)
                    self._written.move_to_end(key)
                    return
                except NotFound:
                    pass
            name = await self._create(pending)
        except (KubeError, httpx2.HTTPError, OSError) as error:
            tries = pending.tries + 1
            if tries < MAX_TRIES and _may_pass(error) and not self._closing:
                self._try_again(replace(pending, tries=tries))
                return
            self.failed += 1
            now = time.monotonic()
            if now - self._failure_logged >= _FAILURE_LOG_S:
                self._failure_logged = now
                log.warning(
                    "event %s for %s/%s not written after %d tries: %s (%d Events not written so far)",
                    pending.reason,
                    ref.namespace,
                    ref.name,
                    tries,
                    error,
                    self.failed,
                )
            return
        self._written[key] = _Written(name=name, count=1, first_written=time.monotonic())
        while len(self._written) > self._remembered:
            self._written.popitem(last=False)

    def _try_again(self, pending: _Pending) -> None:
        """Queue ``pending`` again after its backoff, in its own line, unless the queue is full by then."""
        delay = self._retry_initial_s * 2 ** (pending.tries - 1)

        def requeue() -> None:
            self._retrying.discard(handle)
            if len(self._urgent) + len(self._deferred) >= self._queue_size:
                self.dropped += 1
                return
            (self._deferred if pending.yields and self._yield_to is not None else self._urgent).append(
                pending
            )
            self._arrived.set()

        handle = asyncio.get_running_loop().call_later(delay, requeue)
        self._retrying.add(handle)

    async def _bump(self, *, ref: ObjectRef, seen: _Written, at: datetime) -> None:
        patch = {"count": seen.count + 1, "lastTimestamp": at.strftime("%Y-%m-%dT%H:%M:%SZ")}
        with api_errors():
            await self._client.patch(
                Event, seen.name, patch, namespace=ref.namespace, patch_type=PatchType.MERGE
            )
        seen.count += 1  # after the write: a failed one is tried again with the same count

    async def _create(self, pending: _Pending) -> str:
        ref = pending.regarding
        name = f"{ref.name}.{time.time_ns():x}"
        event = Event(
            metadata=ObjectMeta(name=name, namespace=ref.namespace),
            involvedObject=ObjectReference(
                apiVersion=ref.api_version,
                kind=ref.kind,
                namespace=ref.namespace,
                name=ref.name,
                uid=ref.uid or None,
            ),
            type=pending.type,
            reason=pending.reason,
            message=pending.message[:1024],
            count=1,
            firstTimestamp=pending.at,
            lastTimestamp=pending.at,
            source=EventSource(component=self._component, host=self._instance),
            reportingComponent=self._component,
            reportingInstance=self._instance,
        )
        with api_errors():
            await create_object(self._client, event, namespace=ref.namespace)
        return name


def _may_pass(error: Exception) -> bool:
    """A failure worth another try: no answer (a timeout, a dropped connection), or an API server too
    busy to take the write (429, 5xx). A refusal of the Event itself (403, 404, 422 ...) will not pass."""
    if isinstance(error, KubeError):
        return error.code == 429 or error.code >= 500 or error.code == 0
    return True
