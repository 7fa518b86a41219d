"""The seam between the usage reporter and whatever reads GPU processes.

NVML answers "which processes run on this GPU and how much memory / SM time do they use"; tests and the
embedded cluster answer the same question from a simulated table. Both return plain frozen values so
the rest of the pipeline never touches NVML handles.

A MIG slice (a MIG device: one GPU instance with its compute instance, docs/mig.md) is reported as a
device of its own, keyed by its ``MIG-`` UUID, with its own memory and processes (NVML answers the
same queries on a MIG device handle), and names its parent GPU and profile. A container placed on a
slice names that UUID among its devices, so attribution needs no special case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One host process using a GPU.

    ``sm_ratio`` is the share of the last sampling window in which the process had a kernel running on
    the GPU's SMs (NVML's per-process ``smUtil`` / 100), 0 when NVML reported no sample for it.
    """

    pid: int
    used_bytes: int
    sm_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuProcesses:
    """The processes of one GPU, or of one MIG slice of a GPU, at one sample.

    A slice has ``parent_uuid`` (the GPU it is carved from; ``index`` is the GPU's) and ``mig_profile``
    (``1g.10gb``); both are None for a GPU."""

    uuid: str
    index: int
    memory_total_bytes: int
    processes: tuple[GpuProcess, ...] = ()
    parent_uuid: str | None = None
    mig_profile: str | None = None


class ProcessUsageBackend(Protocol):
    """Reads, per GPU of this node, the processes with their used memory and SM utilization."""

    def sample(self) -> Sequence[GpuProcesses]:
        """One reading of every GPU. Called once per collection interval, from one thread."""
        ...
