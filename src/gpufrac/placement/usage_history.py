"""What each queue has used over time, decayed: the input of time-based fair share.

KAI Scheduler's time-aware fairness (NVIDIA/KAI-Scheduler, ``docs/timeaware/README.md`` and the design
``docs/developer/designs/time-aware-fairness/time-aware-fairness.md``): a queue's historical usage is
the integral of what it held, each moment weighted by ``0.5 ** (age / half_life)``, normalized to the
cluster's capacity integrated the same way. A queue that held half the cluster for the whole (decayed)
past scores 0.5, whether the cluster grew or not; a queue that used a quiet cluster alone scores its
share of the capacity, not 1, so using uncontended GPUs is not punished as if it were contended.

KAI keeps the samples in Prometheus; here they are two running sums per queue and resource, updated in
O(queues) per sample: over an interval of ``dt`` seconds during which a queue held ``a`` units, the
decayed integral grows by ``a * h / ln 2 * (1 - 0.5 ** (dt / h))`` while everything before it decays by
``0.5 ** (dt / h)`` (exact for an amount held constant over the interval; the scheduler samples what
the books hold at each Queue status pass). The scheduler persists the normalized score in
``Queue.status.historicalUsage`` and seeds a fresh history from it (``seed``), so a restart or a new
leader resumes the queues' standing instead of forgetting it.

How the score changes the fair share is ``gpufrac.placement.fair_share`` (``usage`` and ``k``): only the
over-quota part, never the deserved quota.

What counts as use (``held``): by default only what a queue held *above its deserved quota*
(``OVER_QUOTA``), so a queue is not charged in the over-quota division for the guarantee it was given;
KAI counts everything (``ALL``), which its own design leaves open ("Story 4: no over-usage"). On the
openb churn replay counting all use gave a pending p99 of 74,920 s against 56,928 s for counting the
borrowed part (docs/benchmarks.md, "Time-based fair share in the churn replay").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from .fair_share import QueueBook
from .model import QueueResource

RESOURCES = tuple(QueueResource)
OVER_QUOTA = "over-quota"
ALL = "all"
COUNTED = (OVER_QUOTA, ALL)


def held(
    book: QueueBook, capacity: Mapping[QueueResource, int], counted: str = OVER_QUOTA
) -> dict[QueueResource, dict[str, int]]:
    """What each queue's subtree holds now, per resource, as the history counts it: all of it (``ALL``)
    or the part above its deserved quota (``OVER_QUOTA``)."""
    if counted not in COUNTED:
        raise ValueError(f"counted={counted!r}: one of {', '.join(COUNTED)}")
    totals = {QueueResource.GPU_MEMORY: book.usage, QueueResource.GPUS: book.whole_gpus}
    out: dict[QueueResource, dict[str, int]] = {}
    for r in RESOURCES:
        if counted == ALL:
            out[r] = dict(totals[r])
        else:
            cap = capacity.get(r, 0)
            out[r] = {q: max(0, a - book.get(q).deserved(r, cap)) for q, a in totals[r].items()}
    return out


class UsageHistory:
    """Decayed usage per queue and resource (see the module docstring); ``half_life_s`` > 0."""

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = float(half_life_s)
        self._used: dict[QueueResource, dict[str, float]] = {r: {} for r in RESOURCES}
        self._capacity: dict[QueueResource, float] = dict.fromkeys(RESOURCES, 0.0)
        self._last: float | None = None
        self._held: dict[QueueResource, dict[str, int]] = {r: {} for r in RESOURCES}
        self._cap_now: dict[QueueResource, int] = dict.fromkeys(RESOURCES, 0)

    @property
    def _mean_life(self) -> float:
        """The integral of ``0.5 ** (t / h)`` over all t >= 0: what a constant 1 sums to forever."""
        return self.half_life_s / math.log(2)

    def record(
        self,
        now: float,
        held: Mapping[QueueResource, Mapping[str, int]],
        capacity: Mapping[QueueResource, int],
    ) -> None:
        """The books at ``now`` (monotonic seconds): what each queue holds (its subtree's, per resource)
        and the cluster's capacity. What was recorded last counts as held until ``now``; a clock that
        went back adds nothing."""
        if self._last is not None and now > self._last:
            decay = 0.5 ** ((now - self._last) / self.half_life_s)
            grow = self._mean_life * (1.0 - decay)
            for r in RESOURCES:
                used = self._used[r]
                for name in list(used):
                    used[name] *= decay
                for name, amount in self._held[r].items():
                    if amount > 0:
                        used[name] = used.get(name, 0.0) + amount * grow
                self._capacity[r] = self._capacity[r] * decay + self._cap_now[r] * grow
        if self._last is None or now > self._last:
            self._last = now
        self._held = {r: {n: int(a) for n, a in held.get(r, {}).items()} for r in RESOURCES}
        self._cap_now = {r: int(capacity.get(r, 0)) for r in RESOURCES}

    def seed(
        self, scores: Iterable[tuple[str, QueueResource, float]], capacity: Mapping[QueueResource, int]
    ) -> None:
        """Start from persisted scores (a queue's normalized usage per resource), as if the cluster had
        always had ``capacity`` and each queue had always held its score of it. Only a history with
        nothing recorded yet is seeded; a score outside [0, 1] is clipped."""
        if self._last is not None or any(self._used[r] for r in RESOURCES):
            return
        for r in RESOURCES:
            self._capacity[r] = capacity.get(r, 0) * self._mean_life
        for name, resource, score in scores:
            total = self._capacity[resource]
            if total > 0 and math.isfinite(score):
                self._used[resource][name] = min(1.0, max(0.0, score)) * total

    def normalized(self, resource: QueueResource) -> dict[str, float]:
        """Each queue's decayed usage over the cluster's decayed capacity (0 when there was none)."""
        total = self._capacity[resource]
        if total <= 0:
            return {}
        return {name: used / total for name, used in self._used[resource].items() if used > 0}

    def scores(self) -> dict[QueueResource, dict[str, float]]:
        return {r: self.normalized(r) for r in RESOURCES}


__all__ = ["ALL", "COUNTED", "OVER_QUOTA", "UsageHistory", "held"]
