"""The seam between the usage reporter and whatever reads GPU processes.

NVML answers "which processes run on this GPU and how much memory / SM time do they use"; tests and the
embedded cluster answer the same question from a simulated table. Both return plain frozen values so
the rest of the pipeline never touches NVML handles.
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
    """The processes of one physical GPU at one sample."""

    uuid: str
    index: int
    memory_total_bytes: int
    processes: tuple[GpuProcess, ...] = ()


class ProcessUsageBackend(Protocol):
    """Reads, per GPU of this node, the processes with their used memory and SM utilization."""

    def sample(self) -> Sequence[GpuProcesses]:
        """One reading of every GPU. Called once per collection interval, from one thread."""
        ...
