"""Is each node's agent alive? Its heartbeat, with an expiry.

The node agent re-writes its condition ``gpu-fractioning.nvidia.com/Ready`` every ``heartbeat_s`` (60 s
by default) with a fresh ``lastHeartbeatTime``. An agent that is SIGKILLed leaves that condition True
for ever, so True alone proves nothing: a node is placeable only while its agent's heartbeat is younger
than the expiry (``node_heartbeat_expiry_s``, 180 s by default: three heartbeats, so one lost write or a
slow API server does not take a node away). A node without a heartbeat time counts as expired.

Whose clock. The timestamp is written on the agent's clock and the expiry runs on the scheduler's, so
skew between the two machines would move every expiry. As kube-controller-manager's node lifecycle
controller does, a heartbeat is dated by when the scheduler saw it move forward (on its monotonic
clock), not by the time it carries. Only a heartbeat seen for the first time (the scheduler started, a
node appeared) or one that moved backwards is dated by its own timestamp against the scheduler's wall
clock, because there is nothing else to go by: an agent that died an hour ago must not get a fresh
expiry from a scheduler that just restarted.

Expiry is time passing, not an API event, so the service asks ``next_expiry`` when to look again.
Nothing here reads a clock: callers pass ``now`` (monotonic seconds) and ``wall_now`` in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime


@dataclass(slots=True)
class _Beat:
    stamp: datetime | None
    fresh_until: float


class AgentHeartbeats:
    """The last heartbeat seen per node and until when it keeps the node placeable.

    ``expiry_s`` None turns the check off (every node counts as alive), for node agents that do not
    heartbeat.
    """

    def __init__(self, *, expiry_s: float | None) -> None:
        self.expiry_s = expiry_s
        self._beats: dict[str, _Beat] = {}

    def observe(self, node: str, stamp: datetime | None, *, now: float, wall_now: datetime) -> float:
        """Record the heartbeat time ``node`` shows now; returns when (on ``now``'s clock) it expires."""
        if self.expiry_s is None:
            return math.inf
        beat = self._beats.get(node)
        if beat is not None and beat.stamp == stamp:
            return beat.fresh_until
        if stamp is None:
            fresh_until = -math.inf
        elif beat is not None and beat.stamp is not None and stamp > beat.stamp:
            fresh_until = now + self.expiry_s
        else:
            age = max(0.0, (wall_now - stamp).total_seconds())
            fresh_until = now + self.expiry_s - age
        self._beats[node] = _Beat(stamp=stamp, fresh_until=fresh_until)
        return fresh_until

    def expired(self, node: str, *, now: float) -> bool:
        """True when ``node``'s agent has not shown a heartbeat within the expiry (or never did)."""
        if self.expiry_s is None:
            return False
        beat = self._beats.get(node)
        return beat is None or now >= beat.fresh_until

    def next_expiry(self, *, now: float) -> float | None:
        """The earliest moment after ``now`` at which a node still alive expires; None if none will."""
        return min((b.fresh_until for b in self._beats.values() if b.fresh_until > now), default=None)

    def last_seen(self, node: str) -> datetime | None:
        beat = self._beats.get(node)
        return None if beat is None else beat.stamp

    def forget(self, node: str) -> None:
        self._beats.pop(node, None)
