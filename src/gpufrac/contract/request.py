"""The typed GPU request of a pod: what every parsed annotation form becomes.

Every accepted form of the contract (per-container NvFractions keys, KAI's pod-level ``gpu-fraction``
family, legacy ``gpu-memory``, a whole-GPU resource) normalises to one ``PodGpuRequest``. The scheduler's
placement engine, the webhook and the node agent consume only this type, never raw annotations.

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


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """An amount of memory on ONE device: exactly one of ``mib`` or ``portion`` is set."""

    mib: int | None = None
    portion: float | None = None

    def __post_init__(self) -> None:
        if (self.mib is None) == (self.portion is None):
            raise ValueError("GpuMemory needs exactly one of mib or portion")

    def resolve(self, gpu_mib: int) -> int:
        """Whole MiB on a GPU of ``gpu_mib``: a portion is floored, never below 1 MiB."""
        if self.mib is not None:
            return self.mib
        assert self.portion is not None
        return max(1, math.floor(self.portion * gpu_mib))

    def share_of(self, gpu_mib: int) -> float:
        """This amount as a share of a GPU of ``gpu_mib`` (used for compute portions)."""
        if self.portion is not None:
            return self.portion
        assert self.mib is not None
        return min(1.0, self.mib / gpu_mib)


@dataclass(frozen=True, slots=True)
class ContainerGpuRequest:
    """The GPU request of one container.

    ``device_count`` GPUs of ONE node, each giving ``request`` guaranteed and up to ``limit``. An
    ``exclusive`` request takes whole GPUs (``request``/``limit`` are None then). ``devices`` and
    ``compute_portion`` are binder-owned: empty/None until the scheduler has placed the pod.
    ``compute_request`` is the user's own compute share (KAI's ``gpu-compute.request``), None when absent.
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

    def request_mib(self, gpu_mib: int) -> int:
        """Guaranteed MiB on a GPU of ``gpu_mib`` (the whole GPU when exclusive)."""
        return gpu_mib if self.exclusive or self.request is None else self.request.resolve(gpu_mib)

    def limit_mib(self, gpu_mib: int) -> int:
        """Limit MiB on a GPU of ``gpu_mib``; defaults to the request."""
        if self.exclusive:
            return gpu_mib
        chosen = self.limit if self.limit is not None else self.request
        return gpu_mib if chosen is None else chosen.resolve(gpu_mib)

    def compute_portion_on(self, gpu_mib: int) -> float | None:
        """The sm-sharing compute share the scheduler assigns on a GPU of ``gpu_mib``.

        The user's compute request when given, else proportional to the guaranteed memory share (so a
        GPU full by memory is full by compute); None for time-slicing, whose share is not reserved.
        """
        if self.mode is not ComputeMode.SM_SHARING:
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
