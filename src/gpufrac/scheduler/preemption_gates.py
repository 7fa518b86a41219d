"""Two gates before a pod evicts anybody: its victims' min-runtime, and the preemption delay.

**Min-runtime** (KAI Scheduler's minruntime plugin: NVIDIA/KAI-Scheduler,
``pkg/scheduler/plugins/minruntime/minruntime.go`` and ``resolver.go``; the Queue fields
``spec.preemptMinRuntime`` and ``spec.reclaimMinRuntime`` of ``pkg/apis/scheduling/v2/queue_types.go``).
A pod is not preempted, or reclaimed, before it has run for its queue's minimum. "Run" counts from the
pod's ``status.startTime`` (the kubelet's, kept across scheduler restarts); a pod without one has not
started and is not protected, as KAI protects no job without a start time. Resolved as KAI resolves it:

- preemption (same queue): the victim's queue's ``preemptMinRuntime``, else its nearest ancestor's;
- reclaim (across queues), KAI's default ``lca`` method: below the lowest common ancestor of the two
  queues, the victim's ancestor one step down (or the victim's own queue), else the nearest ancestor
  above it that sets ``reclaimMinRuntime``; for queues of different top-level trees, the victim's
  top-level queue's value. So a minimum set on a subtree protects it from its siblings' reclaim, and
  what a subtree sets inside itself does not bind queues outside it.

Nothing set on the path: the scheduler's defaults (``min_runtime.preempt_s`` / ``min_runtime.reclaim_s``
of its configuration, KAI's plugin arguments ``defaultPreemptMinRuntime``/``defaultReclaimMinRuntime``),
0 unless configured (KAI's plugin default, ``0s``). Consolidation's moves are not bound by
it (KAI registers the plugin for preempt and reclaim only). ``Preemptions`` excludes the protected pods
from the search (as KAI's victim filters do); when nobody is evicted and some pods were protected, the
pod's message says so and it is tried again when the first of them reaches its minimum.

**Preemption delay** (``preemption_delay_s``, 0 by default): a pending pod evicts nobody until that long
after its creation (``metadata.creationTimestamp``: kept across restarts, and when a node autoscaler
starts seeing the pod unschedulable; a gang counts from its newest member), so the autoscaler can add a
node first. Its message says until when, and it is tried again then.

Wall-clock time (``wall``): both compare with timestamps the API server wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lightkube.resources.core_v1 import Pod

from gpufrac.placement.model import Queue
from gpufrac.placement.preemption import Kind
from gpufrac.scheduler.config import SchedulerConfig

#: A wake-up this close after one already armed is left to that one.
_SLACK_S = 0.5


def format_duration(seconds: float) -> str:
    """ "5m", "1h30m", "90s" -> "1m30s", "0.3s": a duration as Go (and a Queue's spec) writes it."""
    if seconds < 60 and seconds != int(seconds):
        return f"{seconds:g}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v) or "0s"


def stamp(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _path(name: str, queues: Mapping[str, Queue]) -> list[Queue]:
    """The known queues from the top-level one down to ``name`` (an unknown queue: itself alone)."""
    path = [queues.get(name) or Queue(name)]
    while (parent := path[-1].parent) is not None and parent in queues and queues[parent] not in path:
        path.append(queues[parent])
    return path[::-1]


@dataclass(frozen=True, slots=True)
class GateSettings:
    """The scheduler's settings for both gates: the preemption delay, and the min-runtimes of queues
    that set none on their path."""

    delay_s: float = 0.0
    preempt_min_runtime_s: float = 0.0
    reclaim_min_runtime_s: float = 0.0

    @classmethod
    def of(cls, config: SchedulerConfig) -> GateSettings:
        minimum = config.min_runtime
        return cls(config.preemption_delay_s, minimum.preempt_s, minimum.reclaim_s)

    def default(self, kind: Kind) -> tuple[float, str]:
        if kind is Kind.PREEMPT and self.preempt_min_runtime_s > 0:
            return self.preempt_min_runtime_s, "the scheduler's min_runtime.preempt_s"
        if kind is Kind.RECLAIM and self.reclaim_min_runtime_s > 0:
            return self.reclaim_min_runtime_s, "the scheduler's min_runtime.reclaim_s"
        return 0.0, ""


def min_runtime(
    kind: Kind, taker: str, victim: str, queues: Mapping[str, Queue], defaults: GateSettings = GateSettings()
) -> tuple[float, str]:
    """How long a pod of queue ``victim`` runs before a pod of queue ``taker`` may evict it by ``kind``,
    and the setting that says so ("queue batch's reclaimMinRuntime"); ``defaults`` when no queue sets
    one, (0, "") for none."""
    path = _path(victim, queues)
    if kind is Kind.PREEMPT:
        for q in reversed(path):
            if q.preempt_min_runtime_s is not None:
                return q.preempt_min_runtime_s, f"queue {q.name}'s preemptMinRuntime"
        return defaults.default(kind)
    if kind is not Kind.RECLAIM:
        return 0.0, ""
    takers = [q.name for q in _path(taker, queues)]
    if takers[0] != path[0].name:
        top = path[0]
        value = top.reclaim_min_runtime_s
        return defaults.default(kind) if value is None else (value, f"queue {top.name}'s reclaimMinRuntime")
    common = 0
    while common + 1 < min(len(takers), len(path)) and takers[common + 1] == path[common + 1].name:
        common += 1
    for q in reversed(path[: min(common + 1, len(path) - 1) + 1]):
        if q.reclaim_min_runtime_s is not None:
            return q.reclaim_min_runtime_s, f"queue {q.name}'s reclaimMinRuntime"
    return defaults.default(kind)


class Wakeups:
    """Try parked pods again (``retry``) at wall-clock times; one timer covers every later wish within
    ``_SLACK_S`` (its retry makes those pods ask again)."""

    def __init__(
        self,
        *,
        wall: Callable[[], float],
        retry: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._wall, self._retry, self._spawn = wall, retry, spawn
        self._armed: set[float] = set()

    @property
    def armed(self) -> set[float]:
        return set(self._armed)

    def at(self, when: float) -> None:
        if any(t <= when + _SLACK_S for t in self._armed):
            return
        self._armed.add(when)

        async def later() -> None:
            try:
                await asyncio.sleep(max(0.0, when - self._wall()) + 0.05)
            finally:
                self._armed.discard(when)
            self._retry()

        self._spawn(later())


@dataclass(slots=True)
class _Young:
    """What one search left aside for min-runtime: how many, and the first to come of age."""

    protected: int = 0
    candidates: int = 0
    until: float = float("inf")
    seconds: float = 0.0
    setting: str = ""


class MinRuntime:
    """The victims too young to evict, per pod (or gang key) being searched for."""

    def __init__(
        self,
        *,
        queues: Callable[[], Iterable[Queue]],
        wall: Callable[[], float],
        wake: Wakeups,
        defaults: GateSettings = GateSettings(),
    ):
        self._queues, self._wall, self._wake, self._defaults = queues, wall, wake, defaults
        self._young: dict[str, _Young] = {}

    def begin(self, key: str) -> None:
        """A search for ``key`` starts: nothing left aside yet."""
        self._young.pop(key, None)

    def protected(
        self, key: str, kind: Kind, taker: str, victims: Iterable[tuple[str, str, Pod | None]]
    ) -> set[str]:
        """Of ``victims`` (uid, queue, pod), those that have not run their minimum for ``kind`` by a pod
        of queue ``taker``."""
        queues = {q.name: q for q in self._queues()}
        configured = self._defaults.preempt_min_runtime_s or self._defaults.reclaim_min_runtime_s
        if not configured and not any(
            q.preempt_min_runtime_s or q.reclaim_min_runtime_s for q in queues.values()
        ):
            return set()
        now, out = self._wall(), set()
        young = self._young.setdefault(key, _Young())
        for uid, queue, pod in victims:
            young.candidates += 1
            started = pod.status.startTime if pod is not None and pod.status is not None else None
            if started is None:
                continue
            seconds, setting = min_runtime(kind, taker, queue, queues, self._defaults)
            until = started.timestamp() + seconds
            if seconds <= 0 or until <= now:
                continue
            out.add(uid)
            young.protected += 1
            if until < young.until:
                young.until, young.seconds, young.setting = until, seconds, setting
        return out

    def note(self, key: str) -> str:
        """Why nobody is evicted, when the search left young pods aside; arms the retry for the first to
        come of age. "" when it left none."""
        young = self._young.pop(key, None)
        if young is None or not young.protected:
            return ""
        self._wake.at(young.until)
        minimum = f"{format_duration(young.seconds)} ({young.setting})"
        head = (
            f"no victim has run its queue's minimum of {minimum} yet"
            if young.protected == young.candidates
            else f"the pods that may be evicted make no room, and {young.protected} more have not run "
            f"their queue's minimum of {minimum} yet"
        )
        return f" No pod is evicted for it: {head}; tried again at {stamp(young.until)}."


class PreemptionDelay:
    """``preemption_delay_s``: no eviction for a pod until that long after its creation."""

    def __init__(self, delay_s: float, *, wall: Callable[[], float], wake: Wakeups) -> None:
        self.delay_s, self._wall, self._wake = delay_s, wall, wake

    def note(self, pods: Iterable[Pod]) -> str:
        """Why ``pods`` (one pod, or a gang's members) evict nobody yet; "" once they may. Arms the retry
        for the end of the wait."""
        if self.delay_s <= 0:
            return ""
        created = [p.metadata.creationTimestamp for p in pods if p.metadata.creationTimestamp is not None]
        if not created:
            return ""
        until = max(created).timestamp() + self.delay_s
        if self._wall() >= until:
            return ""
        self._wake.at(until)
        return (
            f" Waiting until {stamp(until)} before evicting anybody for it (preemption_delay_s="
            f"{self.delay_s:g} after its creation), so a node autoscaler can add room first."
        )
