"""Keeps every fractional container's GPU memory limit in force through the driver, and says so.

The node agent's one owner of the per-cgroup limits (``gpufrac.node.memlimit.driver``):

- ``enforce`` at StartContainer: the container's cgroup exists (runc made it at create) and its init
  process waits for the start, so the workload has not run yet. Resolve the cgroup from the process
  (``cgroups.container_cgroup``), set soft = request and hard = limit on each of its GPUs, read them
  back. Anything but an exact read-back is a failure: the caller fails the container (fail closed).
- ``adopt`` after Synchronize: containers that already run (an agent restart) are read, and what is not
  in force is set again, since they cannot be failed any more.
- ``audit`` every cycle: re-read every booked container; a cleared or changed limit is set again and
  reported (Event ``GpuMemoryLimitReapplied``, ``reapplied`` count); ``currentUsed`` is kept per GPU
  as the fraction's usage.
- ``resize`` when the pod's binding changed under a running container (``gpufrac.node.resize``): the
  container's new amounts are set on its cgroup and read back, under the shrink rule (a hard limit is
  never lowered below the cgroup's use: ``enforce.apply_guarded``); a limit held back is set again by
  every audit until the use falls below it. ``adopt`` follows the same rule (an agent restarted in the
  middle of a resize).
- ``canary``: a throwaway cgroup gets a limit, read back, cleared, read back, removed; until that
  passes, the node is not offered (its readiness says why).

In verify mode (``set_limits=False``, the agent's ``memory_limits: verify``) nothing is ever set: what the
toolkit's hook set is read back, and a missing limit fails the start or is reported by the audit. A
container whose GPU work goes through an MPS daemon that cannot see its processes (``blind``) is never
in force, whatever the driver reads back.

Whole-GPU and non-GPU containers are never touched (no record, or ``exclusive``). A container on MIG
slices is booked at its start without a cgroup or a driver call: the hardware holds its memory (its
slices), so it is in force as soon as it exists and says so as "MIG slice <profile> (<uuid>)"; the audit
has nothing to re-read for it. Each booked container's state feeds the pod condition
(``gpufrac.node.memlimit.condition``) and the metrics (which count fractions only).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpufrac.kube.events import WARNING, ObjectRef
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.memlimit.cgroups import CgroupNotFound, container_cgroup, is_unified
from gpufrac.node.memlimit.driver import MIB, MemoryLimitDriver, MemoryLimitError, clear_limits
from gpufrac.node.memlimit.enforce import (
    GpuLimitOutcome,
    HeldBack,
    Verification,
    apply_guarded,
    apply_limits,
    check_limits,
)
from gpufrac.node.metrics import FractionLimit, LimitReport

log = logging.getLogger(__name__)

REASON_NOT_ENFORCED = "GpuMemoryLimitNotEnforced"
REASON_REAPPLIED = "GpuMemoryLimitReapplied"

#: Maps an assigned device (UUID, index or CDI name) to the GPU's UUID; None when it is not this node's.
GpuUuid = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class Booked:
    """One fractional container's limits as last set or read on this node."""

    record: AllocationRecord
    cgroup: str | None
    verification: Verification | None
    problem: str | None = None  # why it is not in force (None when it is)
    reapplied: int = 0

    @property
    def in_force(self) -> bool:
        """What the driver holds is what the node set (a hard limit held back by the shrink rule is
        in force: it is the limit the node keeps until the use falls); a MIG container's slices are."""
        if self.record.is_mig:
            return self.problem is None
        return self.problem is None and self.verification is not None and self.verification.in_force

    @property
    def held_back(self) -> tuple[HeldBack, ...]:
        """The GPUs whose new hard limit waits for the container's use to fall (a live shrink)."""
        return self.verification.held_back if self.verification is not None else ()

    def describe(self) -> str:
        if self.record.is_mig and self.in_force:
            slices = zip(self.record.mig_profiles, self.record.devices, strict=False)
            return f"{self.record.container_name}: " + "; ".join(
                f"MIG slice {profile} ({device})" for profile, device in slices
            )
        if self.in_force:
            assert self.verification is not None
            waits = "".join(
                f"; the new hard limit {h.wanted // MIB} MiB on {h.gpu} waits for the use to fall below it "
                f"(kept {h.kept // MIB} MiB)"
                for h in self.held_back
            )
            return f"{self.record.container_name}: {self.verification.describe()}{waits}"
        return f"{self.record.container_name}: {self.problem}"


@dataclass(frozen=True, slots=True)
class CanaryResult:
    passed: bool
    message: str


#: Upper bounds (seconds) of the start-time histogram: the runtime's budget per plugin is 2 s.
START_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass(slots=True)
class _Totals:
    reapplied: int = 0
    refused: int = 0
    audits: int = 0
    canary_runs: int = 0
    #: What ``enforce`` took (cgroup resolution, set, read-back): per bucket of START_BUCKETS, then +Inf.
    start_buckets: list[int] = field(default_factory=lambda: [0] * (len(START_BUCKETS) + 1))
    start_sum_s: float = 0.0


def pod_ref(record: AllocationRecord) -> ObjectRef:
    return ObjectRef(kind="Pod", namespace=record.pod_namespace, name=record.pod_name, uid=record.pod_uid)


class LimitEnforcer:
    """Sets, verifies and keeps the driver's per-cgroup limits; thread-safe (the audit runs in a thread)."""

    def __init__(
        self,
        *,
        driver: MemoryLimitDriver,
        gpu_uuid: GpuUuid,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        proc_root: Path = Path("/proc"),
        events: EventSink | None = None,
        on_change: Callable[[str], None] | None = None,
        set_limits: bool = True,
        blind: Callable[[AllocationRecord], str | None] | None = None,
    ) -> None:
        """``set_limits=False`` only reads what something else (the toolkit's hook) set: a limit that is
        not there fails the start and is reported, never set. ``blind`` says why a container's limit
        cannot hold even when the driver reads it back (its GPU work goes through an MPS daemon that
        cannot see its processes); None when it can."""
        self.driver = driver
        self.set_limits = set_limits
        self._blind = blind or (lambda _record: None)
        self._gpu_uuid = gpu_uuid
        self._cgroup_root = cgroup_root
        self._proc_root = proc_root
        self._events = events
        self._on_change = on_change or (lambda _pod_uid: None)
        self._lock = threading.Lock()
        #: Held around each container's driver calls by the audit (a thread), ``resize`` and ``adopt``, so
        #: that an audit that read a record before a resize never sets the old amounts again after it.
        self._work = threading.RLock()
        self._booked: dict[str, Booked] = {}
        self.totals = _Totals()
        self.canary_result: CanaryResult | None = None

    # -- the lifecycle --------------------------------------------------------------------------------

    def enforce(self, *, record: AllocationRecord, pid: int, cgroups_path: str) -> Booked:
        """Set and read back ``record``'s limits for its container's cgroup; the result is booked.

        A result that is not ``in_force`` is also a Warning Event on the pod; the caller decides whether
        the container may start."""
        began = time.perf_counter()
        booked = self._set(record=record, pid=pid, cgroups_path=cgroups_path, check_first=False)
        took = time.perf_counter() - began
        with self._lock:
            self.totals.start_buckets[bisect.bisect_left(START_BUCKETS, took)] += 1
            self.totals.start_sum_s += took
        if not booked.in_force:
            with self._lock:
                self.totals.refused += 1
            self._emit(record, WARNING, REASON_NOT_ENFORCED, self.refusal(booked))
        return booked

    def adopt(self, *, record: AllocationRecord, pid: int, cgroups_path: str) -> Booked:
        """A container that already runs: read its limits, set them where they are not in force."""
        before = self._booked.get(record.container_id)
        with self._work:
            booked = self._set(record=record, pid=pid, cgroups_path=cgroups_path, check_first=True)
        if before is None and booked.reapplied:
            self._emit(
                record, WARNING, REASON_REAPPLIED, f"set again after an agent restart: {booked.describe()}"
            )
        elif not booked.in_force:
            self._emit(record, WARNING, REASON_NOT_ENFORCED, self.refusal(booked))
        return booked

    def resize(self, record: AllocationRecord) -> Booked | None:
        """Set a running container's new amounts (``record``) on its cgroup and read them back, under the
        shrink rule; None when the container has not started here (its start sets ``record``'s amounts).
        A read-back that differs is not in force, as at start (a Warning Event; the audit sets it again)."""
        with self._work:
            current = self.get(record.container_id)
            if current is None or current.cgroup is None:
                return None
            done = self._guarded(record, current.cgroup)
            booked = self._book(
                replace(current, record=record, verification=done, problem=self._problem(record, done))
            )
        if not booked.in_force:
            self._emit(
                record, WARNING, REASON_NOT_ENFORCED, f"the resized limit is not in force: {booked.problem}"
            )
        return booked

    def forget(self, container_id: str) -> None:
        with self._lock:
            gone = self._booked.pop(container_id, None)
        if gone is not None:
            self._on_change(gone.record.pod_uid)

    def audit(self) -> list[Booked]:
        """Re-read every booked container; set again what is not in force. Returns what changed."""
        with self._lock:
            current = list(self._booked.values())
            self.totals.audits += 1
        changed = []
        for seen in current:
            with self._work:
                found = self._audit_one(seen.record.container_id)
            if found is not None:
                changed.append(found)
        return changed

    def _audit_one(self, container_id: str) -> Booked | None:
        booked = self.get(container_id)  # as it is now: a resize may have changed it since the list
        if booked is None or booked.cgroup is None:
            return None
        if not os.path.isdir(booked.cgroup):  # the container is gone; its remove event will follow
            return None
        if booked.held_back and self.set_limits:  # a shrink waiting for the use to fall: set it again
            again = self._guarded(booked.record, booked.cgroup)
            after = self._book(
                replace(booked, verification=again, problem=self._problem(booked.record, again))
            )
            if not after.in_force and booked.in_force:
                self._emit(
                    booked.record,
                    WARNING,
                    REASON_NOT_ENFORCED,
                    f"the resized limit is not in force: {after.problem}",
                )
            return after if after.held_back != booked.held_back or not after.in_force else None
        checked = self._verify(booked.record, booked.cgroup)
        if checked.in_force or not self.set_limits:
            problem = self._problem(booked.record, checked)
            self._book(replace(booked, verification=checked, problem=problem))
            if problem is not None and booked.problem is None:  # newly lost: said once
                self._emit(
                    booked.record,
                    WARNING,
                    REASON_NOT_ENFORCED,
                    self.refusal(replace(booked, problem=problem)),
                )
                return booked
            return None
        again = self._apply(booked.record, booked.cgroup)
        after = replace(
            booked,
            verification=again,
            problem=self._problem(booked.record, again),
            reapplied=booked.reapplied + 1,
        )
        with self._lock:
            self.totals.reapplied += 1
        self._book(after)
        self._emit(
            booked.record,
            WARNING,
            REASON_REAPPLIED if again.in_force else REASON_NOT_ENFORCED,
            f"the driver's limit changed behind gpufrac ({checked.describe()}); set again: "
            + ("read back" if again.in_force else f"FAILED ({again.describe()})"),
        )
        return after

    def canary(self, *, gpus: Sequence[str]) -> CanaryResult:
        """Set, read back, clear and read back a limit on a throwaway cgroup, on every GPU."""
        hierarchy = self._cgroup_root if is_unified(self._cgroup_root) else self._cgroup_root / "memory"
        path = hierarchy / f"gpufrac-canary-{uuidlib.uuid4().hex[:12]}"
        with self._lock:
            self.totals.canary_runs += 1
        try:
            try:
                path.mkdir()
            except OSError as exc:
                return self._canary(False, f"cannot make the canary cgroup {path}: {exc.strerror or exc}")
            if not gpus:
                return self._canary(False, "no usable GPU to try the driver's memory limit on")
            for gpu in gpus:
                done = apply_limits(self.driver, cgroup=str(path), gpus=[gpu], request_mib=1, limit_mib=2)
                if not done.in_force:
                    return self._canary(
                        False, f"the driver's per-cgroup memory limit failed: {done.describe()}"
                    )
                try:
                    clear_limits(self.driver, gpu=gpu, cgroup=str(path))
                    cleared = self.driver.get_limits(gpu=gpu, cgroup=str(path))
                except MemoryLimitError as exc:
                    return self._canary(False, f"clearing the canary's limit on {gpu} failed: {exc}")
                if not cleared.unlimited:
                    return self._canary(False, f"the canary's limit on {gpu} did not clear (read {cleared})")
            return self._canary(
                True, f"set, read back and cleared on {len(gpus)} GPU(s) through {path.parent}"
            )
        finally:
            with contextlib.suppress(OSError):  # never made, or the driver still holds it: nothing to do
                path.rmdir()

    # -- what the condition and the metrics read ---------------------------------------------------------

    def booked(self) -> list[Booked]:
        with self._lock:
            return list(self._booked.values())

    def get(self, container_id: str) -> Booked | None:
        with self._lock:
            return self._booked.get(container_id)

    @staticmethod
    def refusal(booked: Booked) -> str:
        record = booked.record
        return (
            f"gpufrac: the GPU memory limit of container {record.container_name} of pod "
            f"{record.pod_namespace}/{record.pod_name} (soft {record.request_mib} MiB, hard "
            f"{max(record.limit_mib, record.request_mib)} MiB) is not in force: {booked.problem}; "
            "the container does not start without it"
        )

    # -- internals --------------------------------------------------------------------------------------

    def _set(self, *, record: AllocationRecord, pid: int, cgroups_path: str, check_first: bool) -> Booked:
        if record.is_mig:  # the hardware holds it: nothing to resolve, set or read back
            return self._book(Booked(record=record, cgroup=None, verification=None))
        try:
            cgroup = container_cgroup(
                pid=pid, cgroups_path=cgroups_path, cgroup_root=self._cgroup_root, proc_root=self._proc_root
            )
        except CgroupNotFound as exc:
            return self._book(
                Booked(record=record, cgroup=None, verification=None, problem=f"no cgroup: {exc}")
            )
        reapplied = 0
        verification = self._verify(record, cgroup) if check_first or not self.set_limits else None
        if self.set_limits and (verification is None or not verification.in_force):
            # A running container (check_first: adopt) may use more than a new hard limit that the agent
            # did not set before it restarted: the shrink rule holds there too.
            verification = self._guarded(record, cgroup) if check_first else self._apply(record, cgroup)
            reapplied = int(check_first and not verification.held_back)
        assert verification is not None
        problem = self._problem(record, verification)
        return self._book(
            Booked(
                record=record, cgroup=cgroup, verification=verification, problem=problem, reapplied=reapplied
            )
        )

    def _problem(self, record: AllocationRecord, verification: Verification) -> str | None:
        """Why ``record``'s limit is not in force after ``verification``; None when it is."""
        if not verification.in_force:
            return verification.describe()
        return self._blind(record)

    def _gpus(self, record: AllocationRecord) -> tuple[list[str], list[str]]:
        found, unknown = [], []
        for device in record.devices:
            uuid = self._gpu_uuid(device)
            (found if uuid is not None else unknown).append(uuid or device)
        return found, unknown

    def _apply(self, record: AllocationRecord, cgroup: str) -> Verification:
        gpus, unknown = self._gpus(record)
        done = apply_limits(
            self.driver, cgroup=cgroup, gpus=gpus, request_mib=record.request_mib, limit_mib=record.limit_mib
        )
        return _with_unknown(done, unknown)

    def _guarded(self, record: AllocationRecord, cgroup: str) -> Verification:
        gpus, unknown = self._gpus(record)
        done = apply_guarded(
            self.driver, cgroup=cgroup, gpus=gpus, request_mib=record.request_mib, limit_mib=record.limit_mib
        )
        return _with_unknown(done, unknown)

    def _verify(self, record: AllocationRecord, cgroup: str) -> Verification:
        gpus, unknown = self._gpus(record)
        seen = check_limits(
            self.driver, cgroup=cgroup, gpus=gpus, request_mib=record.request_mib, limit_mib=record.limit_mib
        )
        return _with_unknown(seen, unknown)

    def _book(self, booked: Booked, *, announce: bool = True) -> Booked:
        with self._lock:
            before = self._booked.get(booked.record.container_id)
            self._booked[booked.record.container_id] = booked
        if announce and (
            before is None or before.in_force != booked.in_force or before.describe() != booked.describe()
        ):
            self._on_change(booked.record.pod_uid)
        return booked

    def _emit(self, record: AllocationRecord, type: str, reason: str, message: str) -> None:
        level = logging.WARNING if type == WARNING else logging.INFO
        log.log(level, "memlimit: %s/%s %s: %s", record.pod_namespace, record.pod_name, reason, message)
        if self._events is not None:
            self._events.emit(regarding=pod_ref(record), type=type, reason=reason, message=message[:1024])

    def _canary(self, passed: bool, message: str) -> CanaryResult:
        result = CanaryResult(passed=passed, message=message)
        self.canary_result = result
        (log.info if passed else log.warning)(
            "memlimit: canary %s: %s", "passed" if passed else "FAILED", message
        )
        return result


def _with_unknown(verification: Verification, unknown: Iterable[str]) -> Verification:
    extra = tuple(
        GpuLimitOutcome(gpu=d, soft=0, hard=0, error=f"{d} is not one of this node's GPUs") for d in unknown
    )
    return replace(verification, outcomes=verification.outcomes + extra) if extra else verification


def limit_report(enforcer: LimitEnforcer, records: Iterable[AllocationRecord]) -> LimitReport:
    """What the exporter renders: per fraction and GPU, verified or not, and the node's counts."""
    booked = {b.record.container_id: b for b in enforcer.booked()}
    fractions: list[FractionLimit] = []
    running = verified = 0
    for record in records:
        if record.exclusive or record.claims:  # whole GPUs and DRA claims: never set by the enforcer
            continue
        running += 1
        entry = booked.get(record.container_id)
        verified += int(entry is not None and entry.in_force)
        outcomes = entry.verification.outcomes if entry is not None and entry.verification is not None else ()
        for outcome in outcomes:
            fractions.append(
                FractionLimit(
                    namespace=record.pod_namespace,
                    pod=record.pod_name,
                    container=record.container_name,
                    gpu_uuid=outcome.gpu,
                    verified=outcome.in_force,
                    used_bytes=outcome.held.current_used if outcome.held is not None else None,
                )
            )
    canary = enforcer.canary_result
    return LimitReport(
        fractions=tuple(fractions),
        running=running,
        verified=verified,
        reapplied=enforcer.totals.reapplied,
        refused=enforcer.totals.refused,
        canary_passed=None if canary is None else canary.passed,
        start_buckets=tuple(zip(START_BUCKETS, _cumulative(enforcer.totals.start_buckets), strict=False)),
        start_count=sum(enforcer.totals.start_buckets),
        start_sum_s=enforcer.totals.start_sum_s,
    )


def _cumulative(counts: list[int]) -> list[int]:
    out, running = [], 0
    for count in counts:
        running += count
        out.append(running)
    return out
