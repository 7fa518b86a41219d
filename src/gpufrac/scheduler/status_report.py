"""What the scheduler tells users about their pods: the PodScheduled condition and Events.

An unschedulable pod gets PodScheduled=False with the engine's counted reasons (or the contract's
sentence for an invalid request, or the queue's name when the pod names a queue that is not configured)
and a FailedScheduling Event, written only when the message changes: a pod retried every time the
cluster changes does not write the same sentence again. An unexpected error on one pod is reported the
same way with reason SchedulerError (the error's type and the start of its text), so one pod never stops
the others. A bound pod gets a Scheduled Event naming its node and GPUs (it yields to binds in flight,
see ``EventRecorder``); a bind that failed a FailedBinding Event; the members of a gang short of its
minMember a GangTimeout Event, once.

The condition is written by the leader only, at the pod's resourceVersion as the report saw it: a bind
(or any change) since wins, and the pod is judged again from its newer self if it is still pending.
Reports are best effort; the pod stays parked either way.

``StatusReporter`` receives its collaborators as callables: ``park`` (the scheduling queue keeps the pod
until the cluster changes), ``spawn`` (a background write), ``attempts`` (counts an attempt's result in
the metrics) and the leader fence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.errors import Conflict
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder, ObjectRef
from gpufrac.kube.patch import set_pod_condition
from gpufrac.placement.decision import Placement

log = logging.getLogger(__name__)

#: PodScheduled reasons: no node fits (or the pod's request cannot be placed as written), and the
#: scheduler itself failed on the pod (kube-scheduler's two reasons).
UNSCHEDULABLE = "Unschedulable"
SCHEDULER_ERROR = "SchedulerError"

#: How much of an unexpected error's text goes into a pod's condition.
ERROR_TEXT_MAX = 300


def pod_ref(pod: Pod) -> ObjectRef:
    meta = pod.metadata
    return ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid or "")


def _condition(pod: Pod, kind: str) -> tuple[str | None, str | None]:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == kind:
            return c.status, c.message
    return None, None


class StatusReporter:
    """See the module docstring."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        events: EventRecorder,
        park: Callable[[Pod], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        attempts: Callable[[str], None],
        is_leader: Callable[[], bool],
    ) -> None:
        self._client = client
        self._events = events
        self._park = park
        self._spawn = spawn
        self._attempts = attempts
        self._is_leader = is_leader
        self._reported: dict[str, str] = {}

    def unschedulable(self, pod: Pod, message: str, *, reason: str = UNSCHEDULABLE) -> None:
        """Park the pod and say why it waits (once per message)."""
        uid, meta = pod.metadata.uid, pod.metadata
        self._attempts("unschedulable" if reason == UNSCHEDULABLE else "error")
        self._park(pod)
        status, current = _condition(pod, "PodScheduled")
        if self._reported.get(uid) == message and status == "False" and current == message:
            return
        self._reported[uid] = message
        log.info(
            "pod %s/%s is unschedulable: %s",
            meta.namespace,
            meta.name,
            message,
            extra={"pod": f"{meta.namespace}/{meta.name}"},
        )
        self._events.emit(regarding=pod_ref(pod), type=WARNING, reason="FailedScheduling", message=message)
        self._spawn(self._write_condition(pod, message, reason=reason))

    def failed(self, pod: Pod, error: BaseException, *, doing: str) -> None:
        """An unexpected error on one pod: logged with its traceback and reported on the pod."""
        meta = pod.metadata
        log.error(
            "%s pod %s/%s failed unexpectedly",
            doing,
            meta.namespace,
            meta.name,
            exc_info=error,
            extra={"pod": f"{meta.namespace}/{meta.name}"},
        )
        text = f"{type(error).__name__}: {error}"
        if len(text) > ERROR_TEXT_MAX:
            text = text[: ERROR_TEXT_MAX - 3] + "..."
        self.unschedulable(
            pod,
            f"the scheduler failed {doing} this pod ({text}); it is tried again when the cluster changes",
            reason=SCHEDULER_ERROR,
        )

    def scheduled(self, pod: Pod, placement: Placement) -> None:
        meta = pod.metadata
        self._reported.pop(meta.uid, None)
        gpus = ", ".join(u for c in placement.containers for u in c.uuids)
        self._events.emit(
            regarding=pod_ref(pod),
            type=NORMAL,
            reason="Scheduled",
            message=f"Successfully assigned {meta.namespace}/{meta.name} to {placement.node}"
            + (f" with GPUs {gpus}" if gpus else ""),
            yields=True,
        )

    def failed_binding(self, pod: Pod, detail: str) -> None:
        self._events.emit(regarding=pod_ref(pod), type=WARNING, reason="FailedBinding", message=detail)

    def gang_timeout(self, pod: Pod, message: str) -> None:
        self._events.emit(regarding=pod_ref(pod), type=WARNING, reason="GangTimeout", message=message)

    def forget(self, uid: str) -> None:
        """The pod is gone: its last report with it."""
        self._reported.pop(uid, None)

    async def _write_condition(self, pod: Pod, message: str, *, reason: str) -> None:
        if not self._is_leader():
            return
        try:
            await set_pod_condition(
                self._client,
                name=pod.metadata.name,
                namespace=pod.metadata.namespace,
                type="PodScheduled",
                status="False",
                reason=reason,
                message=message,
                # The pod as this report saw it: a bind (or any change) since wins.
                resource_version=pod.metadata.resourceVersion,
            )
        except Conflict:
            log.debug(
                "pod %s/%s changed since; its report is dropped", pod.metadata.namespace, pod.metadata.name
            )
        except Exception as error:  # a report is best effort; the pod stays parked either way
            log.warning(
                "could not set PodScheduled on %s/%s: %s", pod.metadata.namespace, pod.metadata.name, error
            )


__all__ = ["SCHEDULER_ERROR", "UNSCHEDULABLE", "StatusReporter", "pod_ref"]
