"""The published experiment's workload, and the translation of trace rows into engine inputs.

Protocol (shared/data/openb/README.md, confirmed against the paper's simulator): shuffle the whole pod
list (each pod once), then append pods drawn uniformly with replacement until the next draw would push
the requested GPU total past 1.3 x cluster capacity (a list already above that has random pods removed
instead). Pods are submitted one by one, never deleted. Everything random comes from one
``numpy.random.default_rng(seed)``.

Translation: ``gpu_milli < 1000`` becomes the contract's portion request (``gpu-fraction``) on each of
``num_gpu`` GPUs (rounded up to whole MiB instead of down for a pod expressed as a DRA claim,
``TracePod.claim``); ``gpu_milli == 1000`` becomes an exclusive request for ``num_gpu`` whole GPUs;
a pod that asks for hardware isolation (``TracePod.isolation_mib``, scenario ``mig``) becomes a MIG size
request;
``gpu_spec`` becomes a required node affinity ``gpufrac.io/gpu-model In (...)``; CPU and host memory are
requested as in the trace. The typical pods of FGD's prior are built from the original list (before
sampling), keyed by (cpu, gpu_milli, num_gpu, gpu_spec), CPU-only pods included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from gpufrac.contract.keys import GPU_MODEL_LABEL
from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, MigRequest, PodGpuRequest
from gpufrac.placement.model import (
    GpuDevice,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    NodeSpec,
    PendingPod,
    SelectorOperator,
)
from gpufrac.placement.typical import TypicalPod, TypicalSet, select_typical

from .trace import DEFAULT_GPU_MIB, GPU_MIB, TraceNode, TracePod

ARRIVAL_TARGET = 1.3
CONTAINER = "main"


def capacity_milli(nodes: Sequence[TraceNode]) -> int:
    return 1000 * sum(n.gpus for n in nodes)


def inflate(
    pods: Sequence[TracePod], *, seed: int, capacity: int, target: float = ARRIVAL_TARGET
) -> list[TracePod]:
    """The submitted sequence for one seed (see module docstring)."""
    rng = np.random.default_rng(seed)
    limit = target * capacity
    sequence = [pods[i] for i in rng.permutation(len(pods))]
    total = sum(p.gpu_total_milli for p in sequence)
    while total > limit and sequence:
        removed = sequence.pop(int(rng.integers(len(sequence))))
        total -= removed.gpu_total_milli
    while pods:
        drawn = pods[int(rng.integers(len(pods)))]
        if total + drawn.gpu_total_milli > limit:
            break
        sequence.append(drawn)
        total += drawn.gpu_total_milli
    return sequence


def node_spec(node: TraceNode, gpu_mib: dict[str, int] | None = None) -> NodeSpec:
    mib = (gpu_mib or GPU_MIB).get(node.model, DEFAULT_GPU_MIB)
    return NodeSpec(
        name=node.name,
        cpu_milli=node.cpu_milli,
        memory_bytes=node.memory_mib << 20,
        max_pods=10_000,  # the trace has no pod-count limit
        labels={GPU_MODEL_LABEL: node.model} if node.model else {},
        gpu_model=node.model,
        gpus=tuple(GpuDevice(f"{node.name}-gpu{i}", i, mib, node.model) for i in range(node.gpus)),
    )


def gpu_request(pod: TracePod) -> PodGpuRequest:
    if pod.num_gpu == 0 or pod.gpu_milli == 0:
        return PodGpuRequest()
    if pod.isolation_mib:
        mig = MigRequest(min_mib=pod.isolation_mib, count=pod.num_gpu)
        return PodGpuRequest((ContainerGpuRequest(CONTAINER, None, None, device_count=pod.num_gpu, mig=mig),))
    if pod.gpu_milli >= 1000:
        request = ContainerGpuRequest(
            CONTAINER, None, None, pod.mode, device_count=pod.num_gpu, exclusive=True
        )
    else:
        memory = GpuMemory(portion=pod.gpu_milli / 1000, round_up=pod.claim)
        request = ContainerGpuRequest(CONTAINER, memory, None, pod.mode, device_count=pod.num_gpu)
    return PodGpuRequest((request,))


def affinity(pod: TracePod) -> tuple[NodeSelectorTerm, ...]:
    if not pod.gpu_spec:
        return ()
    return (NodeSelectorTerm((NodeSelectorRequirement(GPU_MODEL_LABEL, SelectorOperator.IN, pod.gpu_spec),)),)


class PodFactory:
    """Builds the PendingPod of each submission; the GPU request and affinity of a trace row are built
    once and shared by every copy the sampling draws."""

    def __init__(self) -> None:
        self._parts: dict[TracePod, tuple[PodGpuRequest, tuple[NodeSelectorTerm, ...]]] = {}

    def __call__(self, pod: TracePod, seq: int) -> PendingPod:
        parts = self._parts.get(pod)
        if parts is None:
            parts = self._parts[pod] = (gpu_request(pod), affinity(pod))
        return PendingPod(
            namespace=pod.namespace,
            name=f"{pod.name}-{seq}",
            uid=str(seq),
            gpu=parts[0],
            cpu_milli=pod.cpu_milli,
            memory_bytes=pod.memory_mib << 20,
            affinity=parts[1],
            arrival=seq,
        )


def typical_shape(pod: TracePod) -> TypicalPod:
    models = frozenset(pod.gpu_spec) or None
    if pod.num_gpu == 0 or pod.gpu_milli == 0:
        return TypicalPod(cpu_milli=pod.cpu_milli, memory=None, count=0, models=models)
    if pod.gpu_milli >= 1000:
        return TypicalPod(pod.cpu_milli, None, pod.num_gpu, exclusive=True, models=models, mode=pod.mode)
    return TypicalPod(
        pod.cpu_milli, GpuMemory(portion=pod.gpu_milli / 1000), pod.num_gpu, models=models, mode=pod.mode
    )


def shape_counts(pods: Sequence[TracePod]) -> Counter[TypicalPod]:
    """FGD's prior: the shapes of the original list (see module docstring)."""
    return Counter(typical_shape(p) for p in pods)


def typical_pods(pods: Sequence[TracePod]) -> TypicalSet:
    """The paper's typical pods of the original list (what the fragmentation rate is measured against)."""
    return select_typical(shape_counts(pods))
