"""Resizing a running fraction: the scheduler's half (docs/user-guide.md, "Resizing a running fraction").

A user writes a resize request (``gpufrac.io/container.<c>.resize.*``, ``gpufrac.contract.resize``) on a
bound pod; the webhook has checked who wrote it and its values. ``Resizes`` decides it on the pod's own
GPUs (``gpufrac.placement.resize``: never a move) and carries the decision out:

- **Fits.** The books and the pod change, in the order that never promises the node room the books do not
  hold: a resize that grows any amount changes the books first (``BookingCache.rebook``), then the pod;
  one that only shrinks changes the pod first, then the books (so that no other pod is placed into room
  the node still enforces for this one). The pod's write is ONE merge patch at the resourceVersion the
  decision read: the new ``nvidia.com/container.<c>.gpu-memory.request``/``.limit`` (the node's only
  source), an sm-sharing container's new ``.gpu-compute.portion`` when it asked for one, and the removal
  of the resize keys. A patch the API server refuses puts the books back.
  A restart in between ends in the old or the new state, never half: the books are rebuilt from bound
  pods' annotations at start, and a request still on the pod is simply decided again. A write that got
  no answer (the patch may have landed) leaves the books as they are, the safe side of both orders, and
  they follow the pod's binding as soon as it shows no request. A Normal ``Resized`` Event says old ->
  new amounts, and the pending condition goes.
- **Deferred** (no room on a GPU now): condition ``gpufrac.io/GpuResizePending`` True, reason
  ``Deferred``, with the GPU, the amounts and who holds the room. Retried whenever a pod leaves (room
  may have freed) and every ``retry_s``. Preemption does not make room for a resize.
- **Infeasible** (larger than the GPU, against the queue's limit, or a request the contract refuses):
  the same condition with reason ``Infeasible`` and a Warning Event. Decided again when the pod or the
  cluster changes (a queue's limit may be raised).

A request the user removes withdraws the resize: the condition goes. Only the leader writes; every
replica keeps the list of pods with a request, so a new leader picks them up. ``Resizes`` receives its
collaborators as callables and the booking cache; its writes are injectable (tests fail them on purpose).
Each answer is told to ``answered`` (the service's ``gpufrac_scheduler_resizes_total`` and decision-time
histogram, docs/metrics.md "Scheduler metrics").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError, InvalidPodRequest
from gpufrac.contract.quantities import format_mib
from gpufrac.contract.render import format_portion
from gpufrac.contract.resize import cleared, parse_resizes, resize_keys
from gpufrac.kube.errors import Conflict, KubeError, NotFound
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder
from gpufrac.kube.patch import remove_pod_condition, set_annotations, set_pod_condition
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.resize import ResizeDecision, ResizeOutcome, decide_resize
from gpufrac.scheduler.booking_cache import BookingCache, BookingState
from gpufrac.scheduler.objects import bound_placement
from gpufrac.scheduler.status_report import pod_ref

log = logging.getLogger(__name__)

#: What every resize key has in it (``gpufrac.io/container.<c>.resize.*``): a pod whose keys lack it asks
#: no resize, told without parsing each key.
_RESIZE_MARK = ".resize."
assert all(suffix.startswith(_RESIZE_MARK[1:]) for suffix in keys.RESIZE_SUFFIXES)

#: How many pods' resize writes may be in flight at once.
WRITES_AT_ONCE = 16

#: Writes the decided annotations on the pod at its resourceVersion (None values remove a key).
WritePod = Callable[[Pod, dict[str, str | None]], Awaitable[Pod]]
#: Told of each answer written: the outcome (``RESIZED``, ``DEFERRED``, ``INFEASIBLE``) and the seconds
#: since the request was first seen, None when it is not the request's first answer.
Answered = Callable[[str, float | None], None]
RESIZED, DEFERRED, INFEASIBLE = "resized", "deferred", "infeasible"


def _condition(pod: Pod) -> tuple[str | None, str | None, str | None]:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == keys.POD_RESIZE_PENDING_CONDITION:
            return c.status, c.reason, c.message
    return None, None, None


def decided_annotations(decision: ResizeDecision, asks: Mapping[str, str]) -> dict[str, str | None]:
    """The one patch that carries a decision out: the new resolved amounts (and a new sm-sharing compute
    portion, binder-owned) and the request removed."""
    out: dict[str, str | None] = dict(cleared(asks))
    for change in decision.changes:
        out[keys.memory_request_key(change.container)] = format_mib(change.new_request)
        out[keys.memory_limit_key(change.container)] = format_mib(change.new_limit)
        if change.new_portion is not None and change.new_portion != change.old_portion:
            out[keys.compute_portion_key(change.container)] = format_portion(change.new_portion)
    return out


@dataclass(slots=True)
class _Request:
    """A resize request on a pod: its keys, when the scheduler first saw them, its last answer."""

    asks: dict[str, str]
    seen: float
    answer: str | None = None


def _grows(decision: ResizeDecision) -> bool:
    return any(c.grows for c in decision.changes)


class Resizes:
    """See the module docstring."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        cache: BookingCache,
        events: EventRecorder,
        fence: Callable[[], bool],
        changed: Callable[[], None],
        retry_s: float = 10.0,
        write: WritePod | None = None,
    ) -> None:
        self._client = client
        self._cache = cache
        self._events = events
        self._is_leader = fence
        self._changed = changed
        self._retry_s = retry_s
        #: Writes the decided annotations (tests replace it to fail or stall a write on purpose).
        self.write: WritePod = write or self._patch
        #: Pods whose last resize write got no answer: their books follow the pod once it shows none.
        self._uncertain: set[str] = set()
        #: Pods whose write is in flight, with the newest copy the watch brought meanwhile.
        self._writing: dict[str, Pod | None] = {}
        #: Bound pods with a resize request, or with the pending condition to take away: uid -> pod.
        self._wanted: dict[str, Pod] = {}
        #: The requests on pods, for ``answered``: uid -> the request.
        self._asked: dict[str, _Request] = {}
        #: Told of every answer (the service's metrics); ``clock`` is monotonic seconds.
        self.answered: Answered = lambda outcome, seconds: None
        self.clock: Callable[[], float] = time.monotonic
        self._wake = asyncio.Event()
        self._writes = asyncio.Semaphore(WRITES_AT_ONCE)
        self.done = 0
        self.failed = 0

    # -- what the informers show (synchronous) -----------------------------------------------------------

    def observe(self, pod: Pod, *, gone: bool = False) -> None:
        """A bound pod of ours changed: note it when it carries a request (or a stale condition). A pod
        ``gone``: its request goes, and room may have freed for the deferred ones."""
        uid = pod.metadata.uid
        if uid in self._writing:
            self._writing[uid] = pod
        if gone:
            self._wanted.pop(uid, None)
            self._asked.pop(uid, None)
            self._uncertain.discard(uid)
            if self._wanted:
                self._wake.set()
            return
        annotations = pod.metadata.annotations or {}
        # Every resize key has ".resize." in it: most pods have none, and are told so without parsing keys.
        asks = resize_keys(annotations) if any(_RESIZE_MARK in key for key in annotations) else {}
        asking = bool(asks)
        if not asking:
            self._asked.pop(uid, None)
        elif uid not in self._asked or self._asked[uid].asks != asks:
            self._asked[uid] = _Request(asks, self.clock())  # new, or one that replaced the last
        if uid in self._uncertain and not asking:
            self._uncertain.discard(uid)
            self._follow(pod)
        if asking or _condition(pod)[0] is not None:
            self._wanted[uid] = pod  # always the newest copy: an older one is never decided again
            self._wake.set()
        else:
            self._wanted.pop(uid, None)

    def _follow(self, pod: Pod) -> None:
        """Book what the pod's binding says (after a write whose outcome was unknown)."""
        booking = self._cache.booking(pod.metadata.uid)
        spec = self._cache.nodes.get(booking.node) if booking is not None else None
        if booking is None or spec is None or booking.state is not BookingState.CONFIRMED:
            return
        try:
            placement = bound_placement(pod, gpus_by_uuid={g.uuid: g for g in spec.gpus})
        except ContractError:
            return
        if placement != booking.placement:
            self._cache.rebook(pod.metadata.uid, booking.pending, placement)
            self._changed()

    @property
    def waiting(self) -> int:
        return len(self._wanted)

    # -- the loop -------------------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._retry_s)
            self._wake.clear()
            if self._is_leader():
                await self.decide_all()

    async def decide_all(self) -> None:
        """Decide every pod with a request. Each decision and its change of the books run without a
        pause (nothing else touches the books meanwhile); the pods' writes then run side by side, at
        most ``WRITES_AT_ONCE`` of them."""
        await asyncio.gather(*(self._decide_one(uid, pod) for uid, pod in list(self._wanted.items())))

    async def _decide_one(self, uid: str, pod: Pod) -> None:
        async with self._writes:
            if self._wanted.get(uid) is not pod:
                return  # a newer copy arrived meanwhile; the next round has it
            try:
                await self._decide(pod)
            except Exception:  # one pod's failure never stops the others
                log.exception("resizing pod %s/%s failed", pod.metadata.namespace, pod.metadata.name)

    async def _decide(self, pod: Pod) -> None:
        meta = pod.metadata
        asks = resize_keys(meta.annotations or {})
        if not asks:
            self._wanted.pop(meta.uid, None)
            await self._clear_condition(pod)  # withdrawn (or done by an earlier leader)
            return
        booking = self._cache.booking(meta.uid)
        engine = self._cache.engine
        if booking is None or booking.state is not BookingState.CONFIRMED or not isinstance(engine, Engine):
            return  # not in the books as bound yet: its confirmation wakes it
        try:
            decision = decide_resize(engine, meta.uid, parse_resizes(meta.annotations or {}))
        except InvalidPodRequest as error:
            await self._pending(pod, keys.POD_REASON_RESIZE_INFEASIBLE, str(error))
            return
        if decision.outcome is ResizeOutcome.FITS:
            await self._carry_out(pod, decision, asks, booking.placement)
        elif decision.outcome is ResizeOutcome.DEFERRED:
            await self._pending(pod, keys.POD_REASON_RESIZE_DEFERRED, decision.message)
        else:
            await self._pending(pod, keys.POD_REASON_RESIZE_INFEASIBLE, decision.message)

    async def _carry_out(
        self, pod: Pod, decision: ResizeDecision, asks: Mapping[str, str], old: Placement
    ) -> None:
        meta = pod.metadata
        booking = self._cache.booking(meta.uid)
        assert booking is not None
        books_first = _grows(decision)
        asked = self._asked.get(meta.uid)  # the watch may bring the written pod before the write returns
        if books_first:
            self._cache.rebook(meta.uid, booking.pending, decision.placement)
        self._writing[meta.uid] = None
        try:
            written = await self.write(pod, decided_annotations(decision, asks))
        except Exception as error:
            self.failed += 1
            seen = self._writing.pop(meta.uid, None)
            if not (isinstance(error, KubeError) and error.code < 500):
                # No answer (a timeout, a dropped connection, a server error): the patch may have landed.
                # The books stay as they are, the safe side of both orders, and follow the pod as soon as
                # it shows no request (``observe``; a copy the watch brought during the write counts); a
                # request still there is decided again.
                log.warning(
                    "resize of %s/%s: the write's outcome is unknown: %s", meta.namespace, meta.name, error
                )
                self._uncertain.add(meta.uid)
                if seen is not None:
                    self.observe(seen)
                return
            if books_first:  # the API server refused it: nothing was written
                self._roll_back(meta.uid, decision.placement, old)
            if isinstance(error, (Conflict, NotFound)):
                log.info("resize of %s/%s not written (%s); deciding again", meta.namespace, meta.name, error)
                return  # the pod changed (or went) since: its newer self is decided again
            raise
        self._writing.pop(meta.uid, None)
        self._uncertain.discard(meta.uid)
        if not books_first and not decision.unchanged:
            current = self._cache.booking(meta.uid)
            if current is not None and current.placement == old:
                self._cache.rebook(meta.uid, current.pending, decision.placement)
                self._changed()  # room freed: pending pods may fit now
        if self._wanted.get(meta.uid) is pod:
            del self._wanted[meta.uid]
        self.done += 1
        self._answer(RESIZED, asked)
        if not decision.unchanged:
            message = "; ".join(c.describe() for c in decision.changes)
            self._events.emit(
                regarding=pod_ref(pod),
                type=NORMAL,
                reason=keys.EVENT_REASON_RESIZED,
                message=f"resized on node {old.node}: {message}",
            )
        await self._clear_condition(written)

    def _roll_back(self, uid: str, resized: Placement, old: Placement) -> None:
        """Put the books back after a failed write, unless something else changed them since."""
        booking = self._cache.booking(uid)
        if booking is not None and booking.placement == resized:
            self._cache.rebook(uid, booking.pending, old)

    async def _pending(self, pod: Pod, reason: str, message: str) -> None:
        if _condition(pod) == ("True", reason, message) or not self._is_leader():
            return
        meta = pod.metadata
        infeasible = reason == keys.POD_REASON_RESIZE_INFEASIBLE
        self._answer(INFEASIBLE if infeasible else DEFERRED, self._asked.get(meta.uid))
        if infeasible:
            self._events.emit(
                regarding=pod_ref(pod),
                type=WARNING,
                reason=keys.EVENT_REASON_RESIZE_INFEASIBLE,
                message=message,
            )
        with contextlib.suppress(Conflict, NotFound):
            await set_pod_condition(
                self._client,
                name=meta.name,
                namespace=meta.namespace,
                type=keys.POD_RESIZE_PENDING_CONDITION,
                status="True",
                reason=reason,
                message=message,
            )

    def _answer(self, outcome: str, asked: _Request | None) -> None:
        """Tell ``answered`` of each change of a request's answer (a Deferred one whose message changes
        is not counted again; carried out later, it counts as resized). Its time counts once, from the
        request's sighting to its first answer."""
        if asked is not None and asked.answer == outcome:
            return
        seconds = None
        if asked is not None:
            if asked.answer is None:
                seconds = max(0.0, self.clock() - asked.seen)
            asked.answer = outcome
        self.answered(outcome, seconds)

    async def _clear_condition(self, pod: Pod) -> None:
        if _condition(pod)[0] is None or not self._is_leader():
            return
        with contextlib.suppress(NotFound):
            await remove_pod_condition(
                self._client,
                name=pod.metadata.name,
                namespace=pod.metadata.namespace,
                type=keys.POD_RESIZE_PENDING_CONDITION,
            )

    async def _patch(self, pod: Pod, annotations: dict[str, str | None]) -> Pod:
        if not self._is_leader():
            raise Conflict("not the leader: another replica decides resizes")
        meta = pod.metadata
        return await set_annotations(
            self._client,
            Pod,
            name=meta.name,
            namespace=meta.namespace,
            annotations=annotations,
            resource_version=meta.resourceVersion,
        )
