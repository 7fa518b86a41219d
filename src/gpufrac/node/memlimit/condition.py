"""The ``GpuMemoryEnforced`` pod condition: what the driver holds, said on the pod.

``pod_condition`` is pure: from the pod's fractional containers on this node (their mapping records)
and what the enforcer booked for each, it says True only when every one was read back equal to its plan
(the values in the message), and False with a reason otherwise: ``LimitsNotInForce`` (a set failed,
or a read-back differed) or ``LimitsNotVerified`` (a container has not started yet, or its cgroup was
never found). A container on MIG slices counts too, booked at its start as held by the hardware: its
part of the message is "MIG slice <profile> (<uuid>)" instead of a memory limit, and a pod with only
such containers says True with reason ``HardwareIsolated``. ``PodConditionWriter`` writes it when it
changes (the pods/status subresource, merged by type, so the kubelet's own conditions stay) and records
an Event for each change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightkube import AsyncClient

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.events import NORMAL, WARNING
from gpufrac.kube.patch import set_pod_condition
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.memlimit.enforcer import Booked, pod_ref

log = logging.getLogger(__name__)

REASON_CONDITION_CHANGED = "GpuMemoryEnforcedChanged"
#: The condition's reason when every GPU container of the pod runs on MIG slices.
REASON_HARDWARE_ISOLATED = "HardwareIsolated"


@dataclass(frozen=True, slots=True)
class PodCondition:
    status: str  # "True" / "False"
    reason: str
    message: str


def pod_condition(records: Sequence[AllocationRecord], booked: Mapping[str, Booked]) -> PodCondition | None:
    """The condition for one pod's fractional containers (None when it has none on this node). A DRA
    claim's container is left out: the agent does not set or read back its limit (its CDI spec does)."""
    fractional = sorted(
        (r for r in records if (r.is_mig or not r.exclusive) and not r.claims), key=lambda r: r.container_name
    )
    if not fractional:
        return None
    failed = [
        booked[r.container_id]
        for r in fractional
        if r.container_id in booked and not booked[r.container_id].in_force
    ]
    pending = [r for r in fractional if r.container_id not in booked]
    if failed:
        return PodCondition(
            "False", keys.POD_REASON_LIMITS_NOT_IN_FORCE, "; ".join(b.describe() for b in failed)
        )
    if pending:
        return PodCondition(
            "False",
            keys.POD_REASON_LIMITS_NOT_VERIFIED,
            "; ".join(
                f"{r.container_name}: not verified yet (the container has not started)" for r in pending
            ),
        )
    return PodCondition(
        "True",
        REASON_HARDWARE_ISOLATED if all(r.is_mig for r in fractional) else keys.POD_REASON_LIMITS_READ_BACK,
        "; ".join(booked[r.container_id].describe() for r in fractional),
    )


class PodConditionWriter:
    """Writes each pod's condition when it changes; ``poke(pod_uid)`` after anything that may change it."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        records: Callable[[], Sequence[AllocationRecord]],
        booked: Callable[[], Sequence[Booked]],
        events: EventSink | None = None,
        retry_s: float = 2.0,
    ) -> None:
        self._client = client
        self._records = records
        self._booked = booked
        self._events = events
        self._retry_s = retry_s
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._written: dict[str, PodCondition] = {}
        self.writes = 0

    def poke(self, pod_uid: str) -> None:
        """Thread-safe: the audit calls it from its thread."""
        loop = self._loop
        if loop is None:
            self._dirty.add(pod_uid)
            return
        loop.call_soon_threadsafe(self._mark, pod_uid)

    def _mark(self, pod_uid: str) -> None:
        self._dirty.add(pod_uid)
        self._wake.set()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._dirty:
            self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            failed = await self.write(dirty)
            if failed:
                self._dirty |= failed
                await asyncio.sleep(self._retry_s)
                self._wake.set()

    async def write(self, pod_uids: set[str]) -> set[str]:
        """Write the condition of each pod whose condition changed; returns the pods to try again."""
        records = self._records()
        booked = {b.record.container_id: b for b in self._booked()}
        by_pod: dict[str, list[AllocationRecord]] = {}
        for record in records:
            by_pod.setdefault(record.pod_uid, []).append(record)
        again: set[str] = set()
        for uid in pod_uids:
            mine = by_pod.get(uid, [])
            condition = pod_condition(mine, booked)
            if condition is None:
                self._written.pop(uid, None)
                continue
            if self._written.get(uid) == condition:
                continue
            record = mine[0]
            try:
                await set_pod_condition(
                    self._client,
                    name=record.pod_name,
                    namespace=record.pod_namespace,
                    type=keys.POD_MEMORY_ENFORCED_CONDITION,
                    status=condition.status,
                    reason=condition.reason,
                    message=condition.message,
                )
            except NotFound:
                continue
            except KubeError as exc:
                log.warning(
                    "memlimit: cannot write %s on %s/%s: %s",
                    keys.POD_MEMORY_ENFORCED_CONDITION,
                    record.pod_namespace,
                    record.pod_name,
                    exc,
                )
                again.add(uid)
                continue
            self._written[uid] = condition
            self.writes += 1
            if self._events is not None:
                self._events.emit(
                    regarding=pod_ref(record),
                    type=NORMAL if condition.status == "True" else WARNING,
                    reason=REASON_CONDITION_CHANGED,
                    message=f"{keys.POD_MEMORY_ENFORCED_CONDITION}={condition.status} ({condition.reason}): "
                    f"{condition.message}"[:1024],
                )
        return again
