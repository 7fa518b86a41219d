"""Exponential restart backoff whose budget resets after a stable period (REAL).

A daemon that crashes right after start is restarted after ``initial``, then ``initial x factor``, up to
``max``. A daemon that stayed up for ``stable_s`` has earned a fresh start: its next crash is a new
incident, not the tenth of a crash loop, so the delay starts again from ``initial``. Pure: the caller
passes the clock readings, which keeps it testable without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufrac.node.mps.config import BackoffSettings


@dataclass(slots=True)
class Backoff:
    settings: BackoffSettings
    failures: int = field(default=0)
    consecutive: int = field(default=0)
    _ready_since: float | None = field(default=None)

    def ready(self, *, now: float) -> None:
        """The daemon became ready at ``now``."""
        self._ready_since = now
        self.consecutive = 0

    def failed(self, *, now: float) -> float:
        """The daemon died or failed to start at ``now``; returns the delay before the next start."""
        if self._ready_since is not None and now - self._ready_since >= self.settings.stable_s:
            self.failures = 0
        self._ready_since = None
        delay = min(self.settings.initial_s * self.settings.factor**self.failures, self.settings.max_s)
        self.failures += 1
        self.consecutive += 1
        return delay

    @property
    def degraded(self) -> bool:
        """Too many failures without reaching READY to keep advertising what the daemon enforces."""
        return self.consecutive >= self.settings.degraded_after
