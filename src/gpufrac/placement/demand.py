"""A pod's request in the form filters and scorers compute with, derived once per kind of pod.

Pods of one kind (same host resources, same GPU request, same constraints, same policy) behave the same
on every node, so the engine derives a ``Demand`` once per kind and caches filter and score results per
(kind, node). ``Demand.kind`` is that identity. A portion resolves differently on GPUs of different
sizes, so resolution is vectorised over GPU capacities here, with exactly the arithmetic of
``GpuMemory.resolve`` (``max(1, floor(portion x MiB))``, or ``ceil`` for a claim's ``round_up`` share).

Compute portions are kept as integer parts per million (ppm) so that sums are exact: a GPU accepts
sm-sharing tenants while the sum of their ppm stays at or below 1,000,000.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from gpufrac.contract.request import ROUND_UP_SLACK, ComputeMode, ContainerGpuRequest, GpuMemory

from .mig_book import MigDemand, compute_slices
from .model import ModePolicy, PendingPod

PPM = 1_000_000
SIZE_GPU_MIB = 32768
"""The GPU a MiB request is measured against when pods of a batch are compared by size."""


def resolve_mib(memory: GpuMemory, cap: np.ndarray) -> np.ndarray:
    """Whole MiB of ``memory`` on GPUs of capacities ``cap`` (vectorised ``GpuMemory.resolve``)."""
    if memory.mib is not None:
        return np.full(cap.shape, memory.mib, dtype=np.int64)
    assert memory.portion is not None
    exact = memory.portion * cap
    whole = np.ceil(exact - ROUND_UP_SLACK) if memory.round_up else np.floor(exact)
    return np.maximum(1, whole).astype(np.int64)


def portion_ppm(portion: float) -> int:
    """A compute portion in ppm, floored (a tiny epsilon absorbs float noise of decimal inputs)."""
    return int(portion * PPM + 1e-6)


@dataclass(frozen=True, slots=True)
class ContainerDemand:
    """One container's GPU need, with the compute mode it will actually run in."""

    name: str
    count: int
    exclusive: bool
    request: GpuMemory | None
    limit: GpuMemory | None
    mode: ComputeMode

    def request_mib(self, cap: np.ndarray) -> np.ndarray:
        if self.exclusive or self.request is None:
            return cap.astype(np.int64, copy=True)
        return resolve_mib(self.request, cap)

    def limit_mib(self, cap: np.ndarray) -> np.ndarray:
        if self.exclusive:
            return cap.astype(np.int64, copy=True)
        chosen = self.limit if self.limit is not None else self.request
        return cap.astype(np.int64, copy=True) if chosen is None else resolve_mib(chosen, cap)

    def ppm(self, cap: np.ndarray) -> np.ndarray:
        """Compute portion in ppm on GPUs of ``cap`` (0 for time-slicing, which reserves none)."""
        if self.mode is not ComputeMode.SM_SHARING:
            return np.zeros(cap.shape, dtype=np.int64)
        if self.exclusive or self.request is None:
            return np.full(cap.shape, PPM, dtype=np.int64)
        if self.request.portion is not None:
            return np.full(cap.shape, portion_ppm(self.request.portion), dtype=np.int64)
        share = np.minimum(1.0, self.request.mib / np.maximum(cap, 1))
        return (share * PPM + 1e-6).astype(np.int64)

    def compute_portion(self, gpu_mib: int) -> float | None:
        if self.mode is not ComputeMode.SM_SHARING:
            return None
        return int(self.ppm(np.array([gpu_mib]))[0]) / PPM


@dataclass(frozen=True, slots=True)
class Demand:
    """Everything about a pod that decides where it can go and how a node scores it."""

    kind: Hashable
    cpu_milli: int
    memory_bytes: int
    containers: tuple[ContainerDemand, ...]
    namespace: str
    policy: str
    static_key: Hashable
    #: MIG containers (``gpufrac.placement.mig_book``): slices, never shares of a GPU.
    mig: tuple[MigDemand, ...] = ()

    @property
    def wants_gpu(self) -> bool:
        return bool(self.containers) or bool(self.mig)

    @property
    def modes(self) -> frozenset[ComputeMode]:
        return frozenset(c.mode for c in self.containers if not c.exclusive)

    @property
    def size(self) -> tuple[int, int, int]:
        """(thousandths of a GPU, CPU milli, memory bytes) the pod asks for, largest GPU demand first:
        the order a look-ahead places a batch in. A MiB request counts against a ``SIZE_GPU_MIB`` GPU."""
        milli = 0
        for c in self.containers:
            if c.exclusive or c.request is None:
                milli += 1000 * c.count
            elif c.request.portion is not None:
                milli += round(1000 * c.request.portion) * c.count
            else:
                assert c.request.mib is not None
                milli += min(1000, -(-c.request.mib * 1000 // SIZE_GPU_MIB)) * c.count
        for m in self.mig:
            if m.profile is not None:
                milli += compute_slices(m.profile) * 1000 // 7 * m.count
            else:
                milli += min(1000, -(-(m.min_mib or 0) * 1000 // SIZE_GPU_MIB)) * m.count
        return (milli, self.cpu_milli, self.memory_bytes)

    @property
    def single(self) -> ContainerDemand | None:
        """The one container when the pod asks for exactly one GPU-using container, else None."""
        return self.containers[0] if len(self.containers) == 1 else None


def static_key(pod: PendingPod) -> Hashable:
    """The part of a pod that static (node-spec only) filters look at."""
    return (
        tuple(sorted(pod.node_selector.items())),
        pod.affinity,
        pod.tolerations,
    )


def mig_demand(request: ContainerGpuRequest) -> MigDemand | None:
    """The container's MIG request, or None when it asks for a share of a GPU or whole GPUs."""
    mig = request.mig
    if mig is None:
        return None
    return MigDemand(request.container, mig.profile, mig.min_mib, mig.count)


def container_demand(request: ContainerGpuRequest, mode: ComputeMode | None = None) -> ContainerDemand:
    return ContainerDemand(
        name=request.container,
        count=request.device_count,
        exclusive=request.exclusive,
        request=None if request.exclusive else request.request,
        limit=None if request.exclusive else request.limit,
        mode=request.mode if mode is None else mode,
    )


def demand_of(pod: PendingPod, *, policy: str, flip_modes: bool = False) -> Demand:
    """The Demand of ``pod`` under ``policy``; ``flip_modes`` builds the Preferred-mode fallback."""
    containers = []
    migs = []
    for request in pod.gpu.containers:
        slices = mig_demand(request)
        if slices is not None:
            migs.append(slices)
            continue
        mode = request.mode
        if flip_modes and not request.exclusive:
            mode = ComputeMode.SM_SHARING if mode is ComputeMode.TIME_SLICING else ComputeMode.TIME_SLICING
        containers.append(container_demand(request, mode))
    skey = static_key(pod)
    cds = tuple(containers)
    # The namespace matters only where sm-sharing tenancy is checked.
    tenant = pod.namespace if any(c.mode is ComputeMode.SM_SHARING for c in cds) else ""
    mig = tuple(migs)
    kind = (pod.cpu_milli, pod.memory_bytes, cds, tenant, policy, skey, mig)
    return Demand(
        kind=kind,
        cpu_milli=pod.cpu_milli,
        memory_bytes=pod.memory_bytes,
        containers=cds,
        namespace=pod.namespace,
        policy=policy,
        static_key=skey,
        mig=mig,
    )


def can_fall_back(pod: PendingPod) -> bool:
    return pod.mode_policy is ModePolicy.PREFERRED and any(
        not c.exclusive and c.mig is None for c in pod.gpu.containers
    )
