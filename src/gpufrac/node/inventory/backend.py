"""The seam between the inventory publisher and whatever knows the node's GPUs (NVML or a simulation).

A backend answers one question, "what GPUs does this node have right now, and what driver drives
them", with plain frozen values; the publisher decides what is usable and writes it on the Node. A GPU
is usable (published) when its NVML compute mode allows contexts at all (``prohibited`` does not) and it
is healthy: not fallen off the bus (``lost``: NVML answers GPU_IS_LOST for it) and without a fatal XID
error since its last reset (``xid``; the XIDs that are the application's fault, not the GPU's, are not
recorded: ``APPLICATION_XIDS``).

Each usable GPU serves one **mode** (docs/mig.md): ``mig`` when MIG is enabled on it (``mig``: NVML's
current MIG mode; ``mig_pending``: the mode after the next GPU reset), serving its GPU instances
(``mig_slices``) and nothing else; ``whole`` when the scheduler asked for it (``whole``: the node agent's
record, ``gpufrac.node.mig_layout``; no backend sets it), serving whole-GPU pods only; ``fractions``
otherwise. A MIG GPU was withdrawn before issue #40; it is published with its slices now.

``reserved_mib`` is the framebuffer the driver keeps for itself (NVML's memory info v2: ``reserved``;
None when the driver does not say), which no container can allocate: KAI Scheduler #2212 packed requests
up to the total and pods within their request were killed. The publisher subtracts it
(``gpufrac.node.inventory.reserve``).
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


class GpuMode(StrEnum):
    """What a GPU serves (``gpufrac.io/gpus``' ``mode``; docs/mig.md)."""

    FRACTIONS = "fractions"
    MIG = "mig"
    WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class MigSliceInfo:
    """One GPU instance of a MIG GPU with its one full compute instance: what a MIG container is given.

    ``profile`` as the device plugin names it (``3g.40gb``), ``start`` its placement (the first memory
    slice it occupies), ``uuid`` its MIG device's (``MIG-…``), ``mib`` its memory."""

    profile: str
    start: int
    uuid: str
    mib: int

    @property
    def slice_name(self) -> str:
        """``<profile>@<start>``, the layout annotation's spelling (``gpufrac.mig.geometry.Slice``)."""
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    uuid: str
    index: int
    minor: int
    model: str
    mib: int
    compute_mode: NvmlComputeMode = NvmlComputeMode.DEFAULT
    mig: bool = False
    reserved_mib: int | None = None
    lost: bool = False
    xid: int | None = None
    #: MIG mode after the next GPU reset (NVML's pending mode); equal to ``mig`` when nothing waits.
    mig_pending: bool | None = None
    mig_slices: tuple[MigSliceInfo, ...] = ()
    whole: bool = False

    @property
    def mode(self) -> GpuMode:
        """What the GPU serves now: MIG slices when MIG is on, else whole GPUs or fractions."""
        if self.mig:
            return GpuMode.MIG
        return GpuMode.WHOLE if self.whole else GpuMode.FRACTIONS

    @property
    def mig_pending_mode(self) -> bool:
        return self.mig if self.mig_pending is None else self.mig_pending

    @property
    def fault(self) -> str | None:
        """The hardware fault this GPU has (it returns once healthy); None when it has none."""
        if self.lost:
            return "it fell off the bus (NVML: GPU is lost)"
        if self.xid is not None:
            return f"XID {self.xid} (a fatal GPU error; it needs a GPU reset)"
        return None

    @property
    def withdrawn_because(self) -> str | None:
        """Why this GPU is not offered at all; None when it is usable (in whichever mode it serves)."""
        if self.fault is not None:
            return self.fault
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
    def fractionable(self) -> tuple[GpuInfo, ...]:
        """The usable GPUs that serve fractions (the DRA slice's, the memory-limit canary's)."""
        return tuple(g for g in self.usable if g.mode is GpuMode.FRACTIONS)

    @property
    def withdrawn(self) -> tuple[tuple[GpuInfo, str], ...]:
        return tuple((g, why) for g in self.gpus if (why := g.withdrawn_because) is not None)


#: XIDs caused by the application, not the GPU (the NVIDIA device plugin's health check skips the same):
#: 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive
#: cleanup, 68 video processor exception, 109 context switch timeout. Any other critical XID withdraws the
#: GPU until it is reset.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class InventoryUnavailable(Exception):
    """The backend cannot read the GPUs at all (no driver, NVML failing); the message says why."""


class GpuInventoryBackend(Protocol):
    def read(self) -> NodeInventory:
        """The GPUs as of now; raises ``InventoryUnavailable``. Cheap enough to call every few seconds."""
        ...

    def close(self) -> None: ...
