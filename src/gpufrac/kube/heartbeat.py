"""Is each node's agent alive? Its heartbeat, with an expiry.

The node agent renews a Lease per node (coordination.k8s.io/v1, named after the node, in the namespace
``keys.NODE_LEASE_NAMESPACE``), as the kubelet renews its own in ``kube-node-lease``: a renewal is a
small write to an object nobody else watches closely, where re-writing the Node every heartbeat made
every Node watcher in the cluster (the scheduler, the operator, kube-scheduler, kubectl) decode the whole
Node again. An agent that is SIGKILLed, OOM-killed or hung stops renewing, so the Lease's ``renewTime``
stops moving: a node is placeable only while its agent's heartbeat is younger than the expiry
(``node_heartbeat_expiry_s``, 180 s by default). A node without any heartbeat counts as expired.

Two sources, one heartbeat. As kube-controller-manager's node lifecycle controller does with the Node
status and the node Lease, the heartbeat of a node is the newer of the Lease's ``renewTime`` and the
``lastHeartbeatTime`` of the agent's condition (``latest_heartbeat``): an agent of the previous release
(which re-writes its condition and has no Lease) keeps its node placeable during a rolling upgrade, and so
do the simulated nodes of the embedded cluster, which carry only the condition.

Whose clock. The timestamp is written on the agent's clock and the expiry runs on the observer's, so
skew between the two machines would move every expiry. As the node lifecycle controller does, a
heartbeat is dated by when the observer saw it move forward (on its monotonic clock), not by the time it
carries. Only a heartbeat seen for the first time (the observer started, a node appeared) or one that
moved backwards is dated by its own timestamp against the observer's wall clock, because there is
nothing else to go by: an agent that died an hour ago must not get a fresh expiry from a scheduler that
just restarted.

The scheduler (which stops placing on an expired node) and the operator (which marks the node's
condition Unknown, for people) both observe heartbeats through ``AgentHeartbeats``. Expiry is time
passing, not an API event, so they ask ``next_expiry`` when to look again. Nothing here reads a clock:
callers pass ``now`` (monotonic seconds) and ``wall_now`` in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from lightkube.resources.coordination_v1 import Lease


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


def lease_renewed(lease: Lease) -> datetime | None:
    """When the node agent last renewed ``lease`` (None when it never did)."""
    stamp = lease.spec.renewTime if lease.spec is not None else None
    if stamp is None:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


def latest_heartbeat(*stamps: datetime | None) -> datetime | None:
    """The newest of the heartbeats a node shows (its Lease's, its condition's); None when it shows none."""
    return max((s for s in stamps if s is not None), default=None)
