"""The seam between the inventory publisher and whatever knows the node's GPUs (NVML or a simulation).

A backend answers one question, "what GPUs does this node have right now, and what driver drives
them", with plain frozen values; the publisher decides what is usable and writes it on the Node. A GPU
is usable for fractioning when MIG is off (a MIG-enabled GPU is split by its own partitions, which
gpufrac does not schedule) and its NVML compute mode allows contexts at all (``prohibited`` does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class NvmlComputeMode(StrEnum):
    """NVML's per-GPU compute mode (``nvmlComputeMode_t``)."""

    DEFAULT = "default"
    EXCLUSIVE_THREAD = "exclusive-thread"
    PROHIBITED = "prohibited"
    EXCLUSIVE_PROCESS = "exclusive-process"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    uuid: str
    index: int
    minor: int
    model: str
    mib: int
    compute_mode: NvmlComputeMode = NvmlComputeMode.DEFAULT
    mig: bool = False

    @property
    def withdrawn_because(self) -> str | None:
        """Why this GPU is not offered for fractioning; None when it is usable."""
        if self.mig:
            return "MIG is enabled"
        if self.compute_mode is NvmlComputeMode.PROHIBITED:
            return "its compute mode is prohibited"
        return None


@dataclass(frozen=True, slots=True)
class NodeInventory:
    driver_version: str
    cuda_driver_version: str
    gpus: tuple[GpuInfo, ...]

    @property
    def usable(self) -> tuple[GpuInfo, ...]:
        return tuple(g for g in self.gpus if g.withdrawn_because is None)

    @property
    def withdrawn(self) -> tuple[tuple[GpuInfo, str], ...]:
        return tuple((g, why) for g in self.gpus if (why := g.withdrawn_because) is not None)


class InventoryUnavailable(Exception):
    """The backend cannot read the GPUs at all (no driver, NVML failing); the message says why."""


class GpuInventoryBackend(Protocol):
    def read(self) -> NodeInventory:
        """The GPUs as of now; raises ``InventoryUnavailable``. Cheap enough to call every few seconds."""
        ...

    def close(self) -> None: ...
