"""The scheduler's clock for time-based fair share: samples what each queue holds, keeps the decayed
history (``gpufrac.placement.usage_history``) and hands its scores to the engine.

It is ticked by the Queue status pass (every ``queue_status_interval_s``, on every replica, so a new
leader's engine already has the history), and the leader writes each queue's score to
``status.historicalUsage`` (``gpuMemory``, ``gpus``: the share of the cluster's decayed capacity the
queue used, three decimals). A scheduler that starts seeds its history from those scores once the
queues are known, so a restart resumes the standing instead of forgetting it (as if the cluster had
always had today's capacity; the error fades with the half-life).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from gpufrac.placement.model import QueueResource
from gpufrac.placement.usage_history import UsageHistory, held
from gpufrac.scheduler.config import TimeFairnessConfig
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.queues import RESOURCE_FIELDS

RESOURCES = tuple(QueueResource)
STATUS_FIELD = "historicalUsage"
DIGITS = 3


class QueueUsageClock:
    """See the module docstring. Off (``enabled`` False) while the configuration's ``k`` is 0."""

    def __init__(self, config: TimeFairnessConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.k = config.k
        self.counted = config.counted
        self.history = UsageHistory(config.half_life_s)
        self._clock = clock
        self._seeded = False

    @property
    def enabled(self) -> bool:
        return self.k > 0

    def seed(self, objects: Iterable[Any], capacity: dict[QueueResource, int]) -> None:
        """Start from the scores our ``Queue`` objects' status holds (once, before the first sample)."""
        if self._seeded:
            return
        self._seeded = True
        scores = []
        for obj in objects:
            recorded = ((obj.status or {}).get(STATUS_FIELD)) or {}
            for resource in RESOURCES:
                value = recorded.get(RESOURCE_FIELDS[resource])
                if isinstance(value, int | float) and not isinstance(value, bool):
                    scores.append((obj.metadata.name, resource, float(value)))
        self.history.seed(scores, capacity)

    def tick(self, engine: PlacementEngine, capacity: dict[QueueResource, int]) -> None:
        """Sample the books now and give the engine the history's scores."""
        if not self.enabled:
            return
        self._seeded = True
        self.history.record(self._clock(), held(engine.queues, capacity, self.counted), capacity)
        engine.set_usage_history(self.history.scores(), self.k)

    def status(self, queue: str) -> dict[str, float]:
        """The ``status.historicalUsage`` of ``queue``."""
        return {
            RESOURCE_FIELDS[r]: round(self.history.normalized(r).get(queue, 0.0), DIGITS) for r in RESOURCES
        }
