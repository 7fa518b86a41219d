"""Set a container's GPU memory limits through the driver and read them back: the read-back decides.

For a fractional container the plan is, on each of its GPUs, soft = request and hard = limit (bytes of
whole MiB) for the container's own cgroup. ``apply_limits`` sets them and reads them back;
``check_limits`` only reads (the audit); both answer a ``Verification`` that says, per GPU, what was
wanted, what the driver holds and what went wrong, in sentences that name the GPU, the cgroup, the
values and NVML's error. Nothing here decides policy (fail closed, re-apply): callers do.

``apply_guarded`` is ``apply_limits`` under the shrink rule of a live resize (docs/node-agent.md): a hard
limit is never lowered below what the cgroup uses now (``currentUsed``, read first). Where the new hard
limit is below that use, the new soft limit is set with the hard limit the driver holds, and the
``Verification`` says which GPU waits (``held_back``); the caller sets it again until the use falls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpufrac.node.memlimit.driver import LIMIT_MAX, MIB, MemoryLimitDriver, MemoryLimitError, MemoryLimits


@dataclass(frozen=True, slots=True)
class GpuLimitOutcome:
    """One GPU of a container: what was wanted and what the driver holds (None: it could not be read)."""

    gpu: str
    soft: int
    hard: int
    held: MemoryLimits | None = None
    error: str | None = None

    @property
    def in_force(self) -> bool:
        return (
            self.error is None
            and self.held is not None
            and (self.held.soft, self.held.hard)
            == (
                self.soft,
                self.hard,
            )
        )

    def describe(self) -> str:
        wanted = f"soft {self.soft // MIB} MiB, hard {self.hard // MIB} MiB"
        if self.error is not None:
            return f"{self.gpu}: {wanted} not set: {self.error}"
        if self.held is None:
            return f"{self.gpu}: {wanted} not read back"
        if self.in_force:
            return f"{self.gpu}: {wanted} read back"
        if self.held.unlimited:
            return f"{self.gpu}: {wanted} wanted, the driver holds no limit"
        return (
            f"{self.gpu}: {wanted} wanted, the driver holds soft {self.held.soft // MIB} MiB, "
            f"hard {self.held.hard // MIB} MiB"
        )


@dataclass(frozen=True, slots=True)
class HeldBack:
    """A new hard limit not set yet on one GPU: the cgroup uses more than it (the shrink rule)."""

    gpu: str
    used: int  # bytes in use (currentUsed) when last read
    kept: int  # the hard limit kept meanwhile (bytes)
    wanted: int  # the new hard limit (bytes)

    def describe(self) -> str:
        return (
            f"{self.gpu}: {self.used // MIB} MiB in use, above the new limit {self.wanted // MIB} MiB; "
            f"the hard limit stays {self.kept // MIB} MiB until the use falls below it"
        )


@dataclass(frozen=True, slots=True)
class Verification:
    """A container's limits as last set or read, on every GPU it was given. ``held_back``: GPUs whose
    new hard limit waits for the use to fall (their outcome's ``hard`` is the limit kept)."""

    cgroup: str
    outcomes: tuple[GpuLimitOutcome, ...]
    held_back: tuple[HeldBack, ...] = ()

    @property
    def in_force(self) -> bool:
        return bool(self.outcomes) and all(o.in_force for o in self.outcomes)

    @property
    def used_bytes(self) -> dict[str, int]:
        """``currentUsed`` per GPU where it was read."""
        return {o.gpu: o.held.current_used for o in self.outcomes if o.held is not None}

    def describe(self) -> str:
        if self.in_force and len({(o.soft, o.hard) for o in self.outcomes}) == 1:
            first = self.outcomes[0]
            gpus = ", ".join(o.gpu for o in self.outcomes)
            return (
                f"soft {first.soft // MIB} MiB, hard {first.hard // MIB} MiB read back on "
                f"{len(self.outcomes)} GPU(s) ({gpus}) for cgroup {self.cgroup}"
            )
        return f"cgroup {self.cgroup}: " + "; ".join(o.describe() for o in self.outcomes)


def wanted_bytes(*, request_mib: int, limit_mib: int) -> tuple[int, int]:
    """soft = request, hard = limit (the limit defaults to the request upstream)."""
    return request_mib * MIB, max(limit_mib, request_mib) * MIB


def apply_limits(
    driver: MemoryLimitDriver, *, cgroup: str, gpus: Sequence[str], request_mib: int, limit_mib: int
) -> Verification:
    """Set soft/hard on every GPU for ``cgroup``, then read each back."""
    soft, hard = wanted_bytes(request_mib=request_mib, limit_mib=limit_mib)
    outcomes = []
    for gpu in gpus:
        try:
            driver.set_limits(gpu=gpu, cgroup=cgroup, soft=soft, hard=hard)
        except MemoryLimitError as exc:
            outcomes.append(GpuLimitOutcome(gpu=gpu, soft=soft, hard=hard, error=str(exc)))
            continue
        outcomes.append(_read(driver, gpu=gpu, cgroup=cgroup, soft=soft, hard=hard))
    return Verification(cgroup=cgroup, outcomes=tuple(outcomes))


def hard_to_keep(held: MemoryLimits, *, hard: int) -> int | None:
    """The hard limit to keep instead of ``hard`` (bytes) because the cgroup uses more than ``hard`` now;
    None when ``hard`` may be set. What the driver holds is kept when it is larger; a cgroup the driver
    holds no limit for keeps its use, rounded up to whole MiB (never no limit, never below the use)."""
    used = held.current_used
    if used <= hard:
        return None
    if held.hard == LIMIT_MAX:
        return -(-used // MIB) * MIB
    return held.hard if held.hard > hard else None


def apply_guarded(
    driver: MemoryLimitDriver, *, cgroup: str, gpus: Sequence[str], request_mib: int, limit_mib: int
) -> Verification:
    """``apply_limits`` that never lowers a hard limit below the cgroup's use (``hard_to_keep``): the
    use is read first, the soft limit is always the new one."""
    soft, hard = wanted_bytes(request_mib=request_mib, limit_mib=limit_mib)
    outcomes: list[GpuLimitOutcome] = []
    held_back: list[HeldBack] = []
    for gpu in gpus:
        try:
            held = driver.get_limits(gpu=gpu, cgroup=cgroup)
        except MemoryLimitError as exc:
            outcomes.append(GpuLimitOutcome(gpu=gpu, soft=soft, hard=hard, error=f"read failed: {exc}"))
            continue
        keep = hard_to_keep(held, hard=hard)
        setting = hard if keep is None else keep
        if keep is not None:
            held_back.append(HeldBack(gpu=gpu, used=held.current_used, kept=keep, wanted=hard))
        if (held.soft, held.hard) != (soft, setting):
            try:
                driver.set_limits(gpu=gpu, cgroup=cgroup, soft=soft, hard=setting)
            except MemoryLimitError as exc:
                outcomes.append(GpuLimitOutcome(gpu=gpu, soft=soft, hard=setting, error=str(exc)))
                continue
        outcomes.append(_read(driver, gpu=gpu, cgroup=cgroup, soft=soft, hard=setting))
    return Verification(cgroup=cgroup, outcomes=tuple(outcomes), held_back=tuple(held_back))


def check_limits(
    driver: MemoryLimitDriver, *, cgroup: str, gpus: Sequence[str], request_mib: int, limit_mib: int
) -> Verification:
    """Read what the driver holds for ``cgroup`` on every GPU, against the plan; changes nothing."""
    soft, hard = wanted_bytes(request_mib=request_mib, limit_mib=limit_mib)
    return Verification(
        cgroup=cgroup, outcomes=tuple(_read(driver, gpu=g, cgroup=cgroup, soft=soft, hard=hard) for g in gpus)
    )


def _read(driver: MemoryLimitDriver, *, gpu: str, cgroup: str, soft: int, hard: int) -> GpuLimitOutcome:
    try:
        held = driver.get_limits(gpu=gpu, cgroup=cgroup)
    except MemoryLimitError as exc:
        return GpuLimitOutcome(gpu=gpu, soft=soft, hard=hard, error=f"read back failed: {exc}")
    return GpuLimitOutcome(gpu=gpu, soft=soft, hard=hard, held=held)
