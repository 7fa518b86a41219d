"""The typed GPU request of a pod: what every parsed annotation form becomes.

Every accepted form of the contract (per-container NvFractions keys, KAI's pod-level ``gpu-fraction``
family, legacy ``gpu-memory``, a whole-GPU resource, MIG slices) normalises to one ``PodGpuRequest``.
The scheduler's placement engine, the webhook and the node agent consume only this type, never raw
annotations.

Memory is either whole MiB or a portion of the GPU the scheduler picks: a portion is resolved on the
chosen GPU by ``floor(portion x GPU MiB)`` (at least 1 MiB), which is why ``GpuMemory`` keeps both forms
instead of converting early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class ComputeMode(StrEnum):
    """How a GPU's compute is shared. Two modes never share one physical GPU."""

    TIME_SLICING = "time-slicing"
    SM_SHARING = "sm-sharing"


ROUND_UP_SLACK = 1e-6
"""MiB by which float noise alone may lift ``portion x GPU MiB`` above a whole MiB (0.07 x 100 is
7.000000000000001 in floats); a rounded-up portion ignores it, so a whole amount stays whole."""


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """An amount of memory on ONE device: exactly one of ``mib`` or ``portion`` is set.

    ``round_up`` resolves a portion to the next whole MiB instead of flooring it: what a DRA claim for
    that share of the GPU consumes, since our ResourceSlice's ``requestPolicy`` rounds a capacity request
    up to its 1 MiB step (docs/dra.md). The simulator's ``claims`` scenario uses it; annotations never do.
    """

    mib: int | None = None
    portion: float | None = None
    round_up: bool = False

    def __post_init__(self) -> None:
        if (self.mib is None) == (self.portion is None):
            raise ValueError("GpuMemory needs exactly one of mib or portion")
        if self.round_up and self.portion is None:
            raise ValueError(f"GpuMemory(mib={self.mib}): round_up applies to a portion, not to whole MiB")

    def resolve(self, gpu_mib: int) -> int:
        """Whole MiB on a GPU of ``gpu_mib``: a portion is floored (rounded up with ``round_up``), never
        below 1 MiB."""
        if self.mib is not None:
            return self.mib
        assert self.portion is not None
        exact = self.portion * gpu_mib
        return max(1, math.ceil(exact - ROUND_UP_SLACK) if self.round_up else math.floor(exact))

    def share_of(self, gpu_mib: int) -> float:
        """This amount as a share of a GPU of ``gpu_mib`` (used for compute portions)."""
        if self.portion is not None:
            return self.portion
        assert self.mib is not None
        return min(1.0, self.mib / gpu_mib)


@dataclass(frozen=True, slots=True)
class MigRequest:
    """A container's MIG slices (docs/mig.md): ``count`` GPU instances, each of the named ``profile``
    (``1g.10gb``, from ``nvidia.com/mig-1g.10gb`` or ``gpufrac.io/container.<c>.mig.profile``) or, with
    ``min_mib``, the smallest profile with at least that much memory on whichever model the scheduler picks
    (``gpufrac.mig.geometry.smallest_fitting``). Exactly one of ``profile`` and ``min_mib`` is set."""

    profile: str | None = None
    min_mib: int | None = None
    count: int = 1

    def __post_init__(self) -> None:
        if (self.profile is None) == (self.min_mib is None):
            raise ValueError("MigRequest needs exactly one of profile or min_mib")
        if self.count < 1:
            raise ValueError(f"MigRequest needs a count of at least 1, got {self.count}")


@dataclass(frozen=True, slots=True)
class ContainerGpuRequest:
    """The GPU request of one container.

    ``device_count`` GPUs of ONE node, each giving ``request`` guaranteed and up to ``limit``. An
    ``exclusive`` request takes whole GPUs (``request``/``limit`` are None then). ``devices`` and
    ``compute_portion`` are binder-owned: empty/None until the scheduler has placed the pod.
    ``compute_request`` is the user's own compute share (KAI's ``gpu-compute.request``), None when absent.

    A MIG container (``mig`` set) asks for hardware slices, not for memory on a shared GPU: ``request``
    and ``limit`` are None, it is not ``exclusive``, its mode is time-slicing (it shares nothing),
    ``device_count`` is its slice count, and the binder-owned ``devices`` are its MIG devices' UUIDs.
    Its memory is its slices', known only once a GPU's profile is chosen, so ``request_mib`` and
    ``limit_mib`` refuse it (``ValueError``) rather than read it as a whole GPU.
    """

    container: str
    request: GpuMemory | None
    limit: GpuMemory | None
    mode: ComputeMode = ComputeMode.TIME_SLICING
    device_count: int = 1
    exclusive: bool = False
    devices: tuple[str, ...] = ()
    compute_portion: float | None = None
    compute_request: float | None = None
    mig: MigRequest | None = None

    def _refuse_mig(self) -> None:
        if self.mig is not None:
            raise ValueError(
                f"container {self.container} asks for MIG slices, not memory of a shared GPU: its memory is"
                " its slices' (gpufrac.mig.profiles), read through ContainerGpuRequest.mig"
            )

    def request_mib(self, gpu_mib: int) -> int:
        """Guaranteed MiB on a GPU of ``gpu_mib`` (the whole GPU when exclusive); ``ValueError`` for a MIG
        container."""
        self._refuse_mig()
        return gpu_mib if self.exclusive or self.request is None else self.request.resolve(gpu_mib)

    def limit_mib(self, gpu_mib: int) -> int:
        """Limit MiB on a GPU of ``gpu_mib``; defaults to the request. ``ValueError`` for a MIG container."""
        self._refuse_mig()
        if self.exclusive:
            return gpu_mib
        chosen = self.limit if self.limit is not None else self.request
        return gpu_mib if chosen is None else chosen.resolve(gpu_mib)

    def compute_portion_on(self, gpu_mib: int) -> float | None:
        """The sm-sharing compute share the scheduler assigns on a GPU of ``gpu_mib``.

        The user's compute request when given, else proportional to the guaranteed memory share (so a
        GPU full by memory is full by compute); None for time-slicing, whose share is not reserved.
        """
        if self.mode is not ComputeMode.SM_SHARING or self.mig is not None:
            return None
        if self.exclusive or self.request is None:
            return 1.0
        if self.compute_request is not None:
            return self.compute_request
        return self.request.share_of(gpu_mib)


@dataclass(frozen=True, slots=True)
class PodGpuRequest:
    """The GPU request of a whole pod: one entry per container that asks for GPUs."""

    containers: tuple[ContainerGpuRequest, ...] = field(default_factory=tuple)

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers)

    def container(self, name: str) -> ContainerGpuRequest | None:
        return next((c for c in self.containers if c.container == name), None)
