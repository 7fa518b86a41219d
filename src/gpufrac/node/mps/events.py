"""Where the supervisor reports restarts: the ``EventSink`` seam (REAL implementation on the Node).

Every restart of the MPS daemon is an Event on the Node, because a restart interrupts every sm-sharing
container on it and the people running those containers look at ``kubectl describe node``/events, not at
the agent's log. The supervisor only needs ``emit``; ``NodeEventSink`` writes core/v1 Events through the
shared ``gpufrac.kube.events.EventRecorder`` (queued, aggregated, never blocking the supervisor).
"""

from __future__ import annotations

from typing import Protocol

from gpufrac.kube.events import EventRecorder, ObjectRef

REASON_RESTARTED = "MpsDaemonRestarted"
REASON_START_FAILED = "MpsDaemonStartFailed"
REASON_WEDGED = "MpsServerWedged"
#: A restart asked for (type Normal): MPS recycled because no client was left after a drain.
REASON_RECYCLED = "MpsDaemonRecycled"
#: The daemon could not leave the agent's container cgroup (``MpsSettings.own_cgroup``): replacing the
#: agent's pod (a rolling update of the DaemonSet) will kill it and cut off the sm-sharing clients.
REASON_IN_AGENT_CGROUP = "MpsDaemonInAgentCgroup"


class EventSink(Protocol):
    def emit(self, *, type: str, reason: str, message: str) -> None:
        """Records an Event about this node; must not block or raise."""


class NodeEventSink:
    """Events regarding the Node object (cluster-scoped, so they live in ``default`` like the kubelet's)."""

    def __init__(self, *, recorder: EventRecorder, node_name: str, node_uid: str = "") -> None:
        self._recorder = recorder
        self._node = ObjectRef(kind="Node", namespace="default", name=node_name, uid=node_uid)

    def emit(self, *, type: str, reason: str, message: str) -> None:
        self._recorder.emit(regarding=self._node, type=type, reason=reason, message=message)
