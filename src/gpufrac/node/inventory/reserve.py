"""Usable GPU memory: what the node publishes and the scheduler packs requests into (KAI Scheduler #2212).

A GPU's framebuffer is not all the containers' to share. The driver keeps some for itself (ECC, page
tables, its own structures: about 450 MiB on a T4, 3-4 %), and on a GPU that serves MPS the MPS server's
own context takes more. A scheduler that packs requests up to the total therefore places pods that are
then killed while they stay within their requests. So the node publishes, per GPU, ``mib`` = usable
memory and the scheduler (which reads ``mib`` only) packs and resolves ``gpu-fraction`` portions against
it (floor(portion x usable MiB)); ``total_mib`` and ``reserved_mib`` are published beside it for people.

usable = total - driver reserve - MPS server reserve, where

- the driver reserve is what the driver says (NVML memory info v2, ``reserved``; the simulated backend
  simulates it from its file's ``reserved_mib``), or, when the driver does not say (NVML before the v2
  call), ``unreported_percent`` of the total with at least ``unreported_min_mib`` — the reserve KAI's issue
  proposes (3 %, 256 MiB);
- the MPS server reserve (``mps_server_mib``) applies on the node's GPUs while MPS runs on it (sm-sharing
  is enforceable there), as KAI's newest binder holds back a per-GPU reserve for the server.

A whole-GPU (exclusive) container still gets the whole device: nothing else shares it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from gpufrac.node.inventory.backend import GpuInfo


class MemoryReserveSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    unreported_percent: float = Field(
        3.0, ge=0, lt=100, description="driver reserve, % of the total, when the driver does not report it"
    )
    unreported_min_mib: int = Field(
        256, ge=0, description="driver reserve at least this, when the driver does not report it"
    )
    mps_server_mib: int = Field(
        512, ge=0, description="held back per GPU for the MPS server's own context while MPS runs"
    )


def driver_reserve_mib(gpu: GpuInfo, *, settings: MemoryReserveSettings) -> int:
    if gpu.reserved_mib is not None:
        return gpu.reserved_mib
    return max(settings.unreported_min_mib, math.ceil(gpu.mib * settings.unreported_percent / 100))


def usable_mib(gpu: GpuInfo, *, settings: MemoryReserveSettings, mps: bool) -> int:
    """The MiB the scheduler may pack into ``gpu`` (at least 1: a tiny GPU stays a GPU, just a full one)."""
    held = driver_reserve_mib(gpu, settings=settings) + (settings.mps_server_mib if mps else 0)
    return max(1, gpu.mib - held)
