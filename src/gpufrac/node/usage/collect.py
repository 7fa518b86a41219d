"""One collection cycle: GPU processes → containers → fractions, with entitlement and received compute.

The reporter (Prometheus) and the audit read the same ``UsageSnapshot`` so a user never sees a metric
and an audit finding that disagree about who used what.

Attribution joins three sources: the backend's processes per GPU, each PID's container id from its
cgroup file, and the node's allocation records (one per fractional container, written by the NRI
plugin when it injected the container). A process counts for a fraction on a GPU only if that GPU is
among the fraction's devices; anything else on a GPU is a stray: the audit's "process that belongs to
no fraction". The MPS server and control daemon are GPU processes of the node itself and never strays.

A whole-GPU (exclusive) container is reported like a fraction whose request and limit are the GPU's
memory; so is a container on a MIG slice, on the slice (the backend reports each slice as a device of its
own, with its memory: ``gpufrac.node.usage.backend``). A slice is managed when its parent GPU is, so a
process on a slice that is not its container's is a stray like one on a GPU. Every allocated (fraction,
GPU) pair appears in the snapshot, with zeros when its container has not touched the GPU yet, so
dashboards show an idle fraction instead of no fraction.

Compute, per (fraction, GPU):

- entitlement: sm-sharing with a portion → the portion (its active-thread share of the SMs);
  time-slicing → its share of the busy tenants on the GPU: 1/k for k busy tenants; an idle tenant is
  shown the 1/(k+1) it would get the moment it submits work.
- received: its SM time as a share of all SM time measured on the GPU in the interval (0 on an idle
  GPU). Under contention received ≈ entitlement when sharing is fair; received below entitlement on a
  saturated GPU means the fraction is being starved.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpufrac.contract.quantities import MIB
from gpufrac.contract.request import ComputeMode
from gpufrac.node.usage.backend import GpuProcesses, ProcessUsageBackend
from gpufrac.node.usage.cgroup import container_id_of

NODE_GPU_COMMANDS = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})


class Allocation(Protocol):
    """What the node agent recorded for one fractional container (the mapping store's record)."""

    @property
    def container_id(self) -> str: ...
    @property
    def pod_namespace(self) -> str: ...
    @property
    def pod_name(self) -> str: ...
    @property
    def pod_uid(self) -> str: ...
    @property
    def container_name(self) -> str: ...
    @property
    def devices(self) -> Sequence[str]: ...
    @property
    def request_mib(self) -> int: ...
    @property
    def limit_mib(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def portion(self) -> float | None: ...
    @property
    def exclusive(self) -> bool:
        """Whole GPUs: request and limit are the GPU's memory (the record stores 0 for both)."""
        ...


class AllocationLookup(Protocol):
    """Read side of the container → allocation mapping (REAL: ``gpufrac.node.mapping.MappingStore``)."""

    def allocations(self) -> Iterable[Allocation]:
        """Every fractional container this node currently hosts."""
        ...


@dataclass(frozen=True, slots=True)
class FractionUsage:
    """One fractional container on one of its GPUs during the last interval."""

    allocation: Allocation
    gpu_uuid: str
    gpu_index: int
    request_bytes: int
    limit_bytes: int
    used_bytes: int
    sm_ratio: float
    pids: tuple[int, ...]
    entitlement_ratio: float
    received_ratio: float

    @property
    def busy(self) -> bool:
        return self.sm_ratio > 0


@dataclass(frozen=True, slots=True)
class GpuUsage:
    uuid: str
    index: int
    memory_total_bytes: int
    used_bytes: int
    allocated_bytes: int
    unattributed_bytes: int
    busy_tenants: int
    managed: bool
    #: A MIG slice: the GPU it is carved from and its profile (None for a GPU).
    parent_uuid: str | None = None
    mig_profile: str | None = None


@dataclass(frozen=True, slots=True)
class StrayProcess:
    """A GPU process that belongs to no fraction allocated on that GPU."""

    gpu_uuid: str
    gpu_index: int
    pid: int
    used_bytes: int
    container_id: str | None


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    taken_at: float
    gpus: tuple[GpuUsage, ...]
    fractions: tuple[FractionUsage, ...]
    strays: tuple[StrayProcess, ...]


class UsageCollector:
    """Builds a ``UsageSnapshot`` from a backend, /proc and the allocation records.

    ``managed_gpus`` limits the stray check to GPUs gpufrac owns (None: every GPU the backend sees). It
    is read at every collection, so the node agent passes a set it keeps equal to its published inventory.
    """

    def __init__(
        self,
        *,
        backend: ProcessUsageBackend,
        allocations: AllocationLookup,
        proc_root: Path = Path("/proc"),
        managed_gpus: Collection[str] | None = None,
        node_gpu_commands: Collection[str] = NODE_GPU_COMMANDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self._allocations = allocations
        self._proc_root = proc_root
        self._managed = managed_gpus
        self._node_commands = frozenset(node_gpu_commands)
        self._clock = clock

    def collect(self) -> UsageSnapshot:
        taken_at = self._clock()
        gpus = self._backend.sample()
        by_device = _index_by_device(self._allocations.allocations())
        fractions: list[FractionUsage] = []
        strays: list[StrayProcess] = []
        gpu_usage: list[GpuUsage] = []
        for gpu in gpus:
            tenants = _tenants(by_device, gpu)
            own, gpu_strays = self._attribute(gpu, tenants={a.container_id for a in tenants})
            managed = self._managed is None or gpu.uuid in self._managed or gpu.parent_uuid in self._managed
            if managed:
                strays.extend(gpu_strays)
            on_gpu = _fractions_on_gpu(gpu, tenants=tenants, own=own)
            fractions.extend(on_gpu)
            gpu_usage.append(
                GpuUsage(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    memory_total_bytes=gpu.memory_total_bytes,
                    used_bytes=sum(p.used_bytes for p in gpu.processes),
                    allocated_bytes=sum(f.request_bytes for f in on_gpu),
                    unattributed_bytes=sum(s.used_bytes for s in gpu_strays),
                    busy_tenants=sum(1 for f in on_gpu if f.busy),
                    managed=managed,
                    parent_uuid=gpu.parent_uuid,
                    mig_profile=gpu.mig_profile,
                )
            )
        return UsageSnapshot(
            taken_at=taken_at, gpus=tuple(gpu_usage), fractions=tuple(fractions), strays=tuple(strays)
        )

    def _attribute(
        self, gpu: GpuProcesses, *, tenants: set[str]
    ) -> tuple[dict[str, list[tuple[int, int, float]]], list[StrayProcess]]:
        own: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
        strays: list[StrayProcess] = []
        for process in gpu.processes:
            container = container_id_of(pid=process.pid, proc_root=self._proc_root)
            if container is not None and container in tenants:
                own[container].append((process.pid, process.used_bytes, process.sm_ratio))
            elif container is not None or not self._is_node_process(process.pid):
                strays.append(
                    StrayProcess(
                        gpu_uuid=gpu.uuid,
                        gpu_index=gpu.index,
                        pid=process.pid,
                        used_bytes=process.used_bytes,
                        container_id=container,
                    )
                )
        return own, strays

    def _is_node_process(self, pid: int) -> bool:
        try:
            command = (self._proc_root / str(pid) / "comm").read_text().strip()
        except OSError:
            return False
        return command in self._node_commands


def entitlement(*, mode: str, portion: float | None, busy: bool, busy_tenants: int) -> float:
    """The compute share a fraction is entitled to on one GPU (see the module docstring)."""
    if mode == ComputeMode.SM_SHARING and portion is not None:
        return portion
    return 1.0 / busy_tenants if busy else 1.0 / (busy_tenants + 1)


def _fractions_on_gpu(
    gpu: GpuProcesses, *, tenants: list[Allocation], own: dict[str, list[tuple[int, int, float]]]
) -> list[FractionUsage]:
    total_sm = sum(p.sm_ratio for p in gpu.processes)
    sm_of = {a.container_id: _ratio(sum(sm for _, _, sm in own.get(a.container_id, ()))) for a in tenants}
    busy_tenants = sum(1 for sm in sm_of.values() if sm > 0)
    result = []
    for a in tenants:
        processes = own.get(a.container_id, [])
        own_sm = sum(sm for _, _, sm in processes)
        result.append(
            FractionUsage(
                allocation=a,
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                request_bytes=gpu.memory_total_bytes if a.exclusive else a.request_mib * MIB,
                limit_bytes=gpu.memory_total_bytes if a.exclusive else a.limit_mib * MIB,
                used_bytes=sum(b for _, b, _ in processes),
                sm_ratio=sm_of[a.container_id],
                pids=tuple(pid for pid, _, _ in processes),
                entitlement_ratio=entitlement(
                    mode=a.mode, portion=a.portion, busy=sm_of[a.container_id] > 0, busy_tenants=busy_tenants
                ),
                received_ratio=_ratio(own_sm / total_sm) if total_sm > 0 else 0.0,
            )
        )
    return result


def _ratio(value: float) -> float:
    """A share in [0, 1], rounded so float sums of samples read as the numbers NVML reported."""
    return round(min(1.0, value), 6)


def _index_by_device(allocations: Iterable[Allocation]) -> dict[str, list[Allocation]]:
    """Allocations by device name; a CDI name ``vendor/class=<uuid|index>`` is indexed by its last part."""
    index: dict[str, list[Allocation]] = defaultdict(list)
    for a in allocations:
        for device in a.devices:
            index[device.rpartition("=")[2]].append(a)
    return index


def _tenants(by_device: dict[str, list[Allocation]], gpu: GpuProcesses) -> list[Allocation]:
    seen: dict[str, Allocation] = {}
    for a in (*by_device.get(gpu.uuid, ()), *by_device.get(str(gpu.index), ())):
        seen.setdefault(a.container_id, a)
    return list(seen.values())
