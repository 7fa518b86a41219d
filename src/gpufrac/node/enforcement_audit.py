"""Continuous audit: does enforcement actually hold on this node?

Injection happens once, at CreateContainer, and can be missed (the agent was down or restarting, a
runtime without NRI, a plugin timeout with fail-open). MPS memory limits are per process, so a container
with several processes can hold more than its limit in total. The audit checks after every usage
collection (the reporter calls it as a listener), not only on reconnect:

- missing injection: a running fractional container (recognised from its pod's annotations, so also one
  the agent never saw created) whose created-with environment lacks an enforcement variable or has a
  different value than the injection plan gives → Event, counter, and (default on) StopContainer
  through CRI so the kubelet recreates it through a healthy create. The spec of a container never
  changes, so each container is checked once.
- unknown process: a GPU process that belongs to no fraction on a managed GPU → Event and counter.

A container on MIG slices (docs/mig.md) is checked for exactly its slices and nothing else: its plan is
``NVIDIA_VISIBLE_DEVICES`` = its slices' MIG UUIDs and no other enforcement variable, so a fraction's
memory or MPS variable, or other devices in the variable, is a missing-injection finding worded for
the slices; and a slice is a device of the usage snapshot like a GPU (managed when its GPU is), so a
process of the container on a slice or GPU not its own, or anyone else's process on its slice, is an
unknown process naming the slice and its profile.
- over limit: a container whose processes together use more than its limit on a GPU, for
  ``over_limit_cycles`` consecutive collections (one sample can race an allocation and its free) →
  Event, counter, and (configurable, default on) stop.

Each finding emits its Event and counts once while it lasts; it can fire again after it has cleared.
A stop that fails is retried at the next collection; a container already gone counts as stopped.
Events go through the ``EventSink`` seam whose REAL implementation is ``gpufrac.kube.events.EventRecorder``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc

from gpufrac.contract.quantities import MIB
from gpufrac.kube.events import WARNING, ObjectRef
from gpufrac.node.cri.client import CriError, RunningContainer
from gpufrac.node.inject import NVIDIA_VISIBLE_DEVICES, injection_problems, is_mig_device
from gpufrac.node.metrics import MISSING_INJECTION, OVER_LIMIT, UNKNOWN_PROCESS, EnforcementCounters
from gpufrac.node.usage.collect import Allocation, GpuUsage, StrayProcess, UsageSnapshot

log = logging.getLogger(__name__)

REASON_MISSING_INJECTION = "GpuInjectionMissing"
REASON_UNKNOWN_PROCESS = "GpuProcessWithoutFraction"
REASON_OVER_LIMIT = "GpuMemoryOverLimit"


class EventSink(Protocol):
    """Records a core/v1 Event; must not block or raise (``EventRecorder`` is the REAL one)."""

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None: ...


class ContainerRuntime(Protocol):
    """The CRI calls the audit makes (``gpufrac.node.cri.client.CriClient`` is the REAL one)."""

    async def running_containers(self) -> list[RunningContainer]: ...
    async def environment(self, container_id: str) -> dict[str, str] | None: ...
    async def stop(self, container_id: str, *, grace_s: int = 10) -> None: ...


class InjectionPlanner(Protocol):
    """What the NRI plugin injects, computed by the same pure plan it uses at CreateContainer."""

    @property
    def managed_keys(self) -> frozenset[str]:
        """Every enforcement variable gpufrac owns; one the plan does not set must be absent."""
        ...

    def expected_env(self, *, container: RunningContainer) -> Mapping[str, str] | None:
        """The enforcement environment ``container`` must have; None when it is not fractional."""
        ...

    def amounts_may_differ(self, *, container: RunningContainer) -> bool:
        """Whether the container's amount variables may differ from its plan (it was resized live)."""
        ...


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    key: tuple[str, ...]
    regarding: ObjectRef
    reason: str
    message: str
    stop: str | None = None  # the container to stop, when the policy says so


class Auditor:
    """Call with each ``UsageSnapshot``; returns the findings raised by that cycle (new ones only)."""

    def __init__(
        self,
        *,
        runtime: ContainerRuntime,
        planner: InjectionPlanner,
        events: EventSink,
        counters: EnforcementCounters,
        node_name: str,
        stop_missing_injection: bool = True,
        stop_over_limit: bool = True,
        over_limit_cycles: int = 2,
        stop_grace_s: int = 10,
    ) -> None:
        self._runtime = runtime
        self._planner = planner
        self._events = events
        self._counters = counters
        self._node = ObjectRef(kind="Node", namespace="default", name=node_name)
        self._stop_missing = stop_missing_injection
        self._stop_over = stop_over_limit
        self._over_cycles = over_limit_cycles
        self._grace = stop_grace_s
        self._checked: dict[str, Finding | None] = {}  # container id → its injection verdict
        self._over_streak: dict[tuple[str, str], int] = {}
        self._active: set[tuple[str, ...]] = set()
        self._pending_stops: set[str] = set()

    async def __call__(self, snapshot: UsageSnapshot) -> list[Finding]:
        try:
            running = {c.id: c for c in await self._runtime.running_containers()}
        except CriError as error:
            # Without the runtime's list no finding can name its pod or be acted on: skip this cycle.
            log.warning("audit: skipped, the runtime did not list containers: %s", error)
            return []
        findings = [
            *await self._injection(running),
            *self._strays(snapshot, running),
            *self._over_limit(snapshot),
        ]
        raised = [f for f in findings if f.key not in self._active]
        self._active = {f.key for f in findings}
        for finding in raised:
            self._counters.violation(kind=finding.kind)
            self._events.emit(
                regarding=finding.regarding, type=WARNING, reason=finding.reason, message=finding.message
            )
            log.warning("audit: %s", finding.message)
            if finding.stop is not None:
                self._pending_stops.add(finding.stop)
        await self._stop_pending(running)
        return raised

    async def _injection(self, running: Mapping[str, RunningContainer]) -> list[Finding]:
        for gone in self._checked.keys() - running.keys():
            del self._checked[gone]
        for container in running.values():
            if container.id not in self._checked:
                try:
                    self._checked[container.id] = await self._check_injection(container)
                except CriError as error:  # not checked: try again at the next collection
                    log.warning("audit: no spec for %s yet: %s", container.id, error)
        return [f for f in self._checked.values() if f is not None]

    async def _check_injection(self, container: RunningContainer) -> Finding | None:
        expected = self._planner.expected_env(container=container)
        if expected is None:
            return None
        actual = await self._runtime.environment(container.id)
        if actual is None:
            log.warning("audit: runtime does not report the spec of %s; injection not checked", container.id)
            return None
        problems = injection_problems(
            expected=expected,
            actual=actual,
            managed_keys=self._planner.managed_keys,
            amounts_may_differ=self._planner.amounts_may_differ(container=container),
        )
        if not problems:
            return None
        where = f"{container.pod_namespace}/{container.pod_name} container {container.name}"
        action = "; stopping it so the kubelet recreates it" if self._stop_missing else ""
        slices = [d for d in expected.get(NVIDIA_VISIBLE_DEVICES, "").split(",") if is_mig_device(d)]
        wrong = (
            f"does not run on exactly its MIG slices {', '.join(slices)}"
            if slices
            else "runs without the GPU enforcement it needs"
        )
        return Finding(
            kind=MISSING_INJECTION,
            key=(MISSING_INJECTION, container.id),
            regarding=_pod(container),
            reason=REASON_MISSING_INJECTION,
            message=f"{where} {wrong} ({'; '.join(problems)}){action}",
            stop=container.id if self._stop_missing else None,
        )

    def _strays(self, snapshot: UsageSnapshot, running: Mapping[str, RunningContainer]) -> list[Finding]:
        findings = []
        slices = {g.uuid: g for g in snapshot.gpus if g.parent_uuid is not None}
        placed = {f.allocation.container_id: f.allocation for f in snapshot.fractions}
        for stray in snapshot.strays:
            container = running.get(stray.container_id or "")
            owner = (
                f"container {container.name} of pod {container.pod_namespace}/{container.pod_name}"
                if container is not None
                else (f"container {stray.container_id[:13]}" if stray.container_id else "a host process")
            )
            findings.append(
                Finding(
                    kind=UNKNOWN_PROCESS,
                    key=(UNKNOWN_PROCESS, stray.gpu_uuid, str(stray.pid)),
                    regarding=_pod(container) if container is not None else self._node,
                    reason=REASON_UNKNOWN_PROCESS,
                    message=_stray_message(
                        stray, owner=owner, on_slice=slices.get(stray.gpu_uuid), placed=placed
                    ),
                )
            )
        return findings

    def _over_limit(self, snapshot: UsageSnapshot) -> list[Finding]:
        findings = []
        streak: dict[tuple[str, str], int] = {}
        for f in snapshot.fractions:
            if f.used_bytes <= f.limit_bytes:
                continue
            a = f.allocation
            key = (a.container_id, f.gpu_uuid)
            streak[key] = self._over_streak.get(key, 0) + 1
            if streak[key] < self._over_cycles:
                continue
            action = "; stopping it" if self._stop_over else ""
            findings.append(
                Finding(
                    kind=OVER_LIMIT,
                    key=(OVER_LIMIT, *key),
                    regarding=ObjectRef(
                        kind="Pod", namespace=a.pod_namespace, name=a.pod_name, uid=a.pod_uid
                    ),
                    reason=REASON_OVER_LIMIT,
                    message=(
                        f"{a.pod_namespace}/{a.pod_name} container {a.container_name} uses "
                        f"{f.used_bytes // MIB} MiB on GPU {f.gpu_index} ({f.gpu_uuid}) in {len(f.pids)} "
                        f"process(es), over its limit of {f.limit_bytes // MIB} MiB{action}"
                    ),
                    stop=a.container_id if self._stop_over else None,
                )
            )
        self._over_streak = streak
        return findings

    async def _stop_pending(self, running: Mapping[str, RunningContainer]) -> None:
        for container_id in sorted(self._pending_stops):
            if container_id not in running:
                self._pending_stops.discard(container_id)
                continue
            try:
                await self._runtime.stop(container_id, grace_s=self._grace)
            except CriError as error:
                if error.code != grpc.StatusCode.NOT_FOUND:
                    log.warning("audit: stopping %s failed, retrying next cycle: %s", container_id, error)
                    continue
            self._pending_stops.discard(container_id)


def _stray_message(
    stray: StrayProcess, *, owner: str, on_slice: GpuUsage | None, placed: Mapping[str, Allocation]
) -> str:
    """A stray in words: on a GPU, or on a MIG slice (its profile); the owner's own slices when it has."""
    used = f"process {stray.pid} ({owner}) uses {stray.used_bytes // MIB} MiB"
    if on_slice is None:
        return f"{used} on GPU {stray.gpu_index} ({stray.gpu_uuid}) but belongs to no fraction on that GPU"
    own = placed.get(stray.container_id or "")
    mine = (
        f"; its container is placed on {', '.join(own.devices)}"
        if own is not None and any(is_mig_device(d) for d in own.devices)
        else ""
    )
    return (
        f"{used} on MIG slice {on_slice.mig_profile} ({stray.gpu_uuid}) of GPU {stray.gpu_index} but is "
        f"not the container placed on that slice{mine}"
    )


def _pod(container: RunningContainer) -> ObjectRef:
    return ObjectRef(
        kind="Pod", namespace=container.pod_namespace, name=container.pod_name, uid=container.pod_uid
    )
