"""Small constructors for placement tests: nodes with GPUs and pods with the contract's request forms."""

from __future__ import annotations

from gpufrac.contract.keys import GPU_MODEL_LABEL
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.placement.decision import Placement
from gpufrac.placement.model import BOTH_MODES, GpuDevice, NodeSpec, PendingPod

GIB = 1 << 30


def node(
    name: str,
    *,
    gpus: int = 4,
    mib: int = 16384,
    cpu: int = 64_000,
    memory: int = 256 * GIB,
    model: str = "T4",
    labels: dict[str, str] | None = None,
    **kw: object,
) -> NodeSpec:
    all_labels = {GPU_MODEL_LABEL: model, **(labels or {})}
    return NodeSpec(
        name=name,
        cpu_milli=cpu,
        memory_bytes=memory,
        labels=all_labels,
        gpu_model=model,
        gpus=tuple(GpuDevice(f"{name}-g{i}", i, mib, model) for i in range(gpus)),
        compute_modes=kw.pop("compute_modes", BOTH_MODES),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def fraction(
    portion: float,
    *,
    mode: ComputeMode = ComputeMode.TIME_SLICING,
    count: int = 1,
    limit: float | None = None,
) -> PodGpuRequest:
    return PodGpuRequest(
        (
            ContainerGpuRequest(
                "main",
                GpuMemory(portion=portion),
                None if limit is None else GpuMemory(portion=limit),
                mode,
                device_count=count,
            ),
        )
    )


def mib(
    request: int, *, limit: int | None = None, mode: ComputeMode = ComputeMode.TIME_SLICING, count: int = 1
) -> PodGpuRequest:
    return PodGpuRequest(
        (
            ContainerGpuRequest(
                "main",
                GpuMemory(mib=request),
                None if limit is None else GpuMemory(mib=limit),
                mode,
                device_count=count,
            ),
        )
    )


def whole(count: int = 1) -> PodGpuRequest:
    return PodGpuRequest((ContainerGpuRequest("main", None, None, device_count=count, exclusive=True),))


_seq = [0]


def pod(
    gpu: PodGpuRequest | None = None, *, name: str | None = None, namespace: str = "ns", **kw: object
) -> PendingPod:
    _seq[0] += 1
    n = name or f"p{_seq[0]}"
    return PendingPod(namespace=namespace, name=n, uid=f"uid-{n}-{_seq[0]}", gpu=gpu or PodGpuRequest(), **kw)  # type: ignore[arg-type]


def host_only(held: PendingPod, node_name: str) -> Placement:
    """Where a pod that holds no GPU is bound: its CPU and memory on ``node_name``, nothing else."""
    return Placement(held.uid, node_name, ())
