"""A synthetic trace in the openb shape, for tests and quick experiments.

Small clusters of mixed nodes (GPU count, model, CPU per GPU) and pods that mix the trace's kinds:
CPU-only, GPU-sharing (a share of one GPU), whole single GPUs and multi-GPU pods, some with a model
constraint. Everything comes from one seeded generator, so a seed names a trace.
"""

from __future__ import annotations

import numpy as np

from gpufrac.contract.request import ComputeMode

from .trace import TraceNode, TracePod

MODELS = ("T4", "V100M32", "G2")
SHARES = (100, 250, 300, 470, 500, 650, 810)


def synthetic_trace(
    *,
    seed: int,
    nodes: int = 24,
    pods: int = 300,
    mixed_modes: bool = False,
) -> tuple[list[TraceNode], list[TracePod]]:
    rng = np.random.default_rng(seed)
    node_list = []
    for i in range(nodes):
        gpus = int(rng.choice([1, 2, 4, 8]))
        model = str(rng.choice(MODELS))
        cpu_per_gpu = int(rng.choice([8, 12, 16, 48]))
        node_list.append(
            TraceNode(
                name=f"syn-node-{i:04d}",
                cpu_milli=gpus * cpu_per_gpu * 1000,
                memory_mib=gpus * 65536,
                gpus=gpus,
                model=model,
            )
        )
    pod_list = []
    for i in range(pods):
        kind = rng.random()
        cpu = int(rng.choice([1000, 2000, 4000, 8000, 12000]))
        spec: tuple[str, ...] = ()
        if rng.random() < 0.1:
            spec = (str(rng.choice(MODELS)),)
        if kind < 0.15:
            num, milli = 0, 0
        elif kind < 0.6:
            num, milli = 1, int(rng.choice(SHARES))
        elif kind < 0.9:
            num, milli = 1, 1000
        else:
            num, milli = int(rng.choice([2, 4, 8])), 1000
            if mixed_modes and rng.random() < 0.5:
                milli = 500
        qos = "LS" if rng.random() < 0.4 else "BE"
        mode = ComputeMode.TIME_SLICING
        if mixed_modes and 0 < milli < 1000 and qos == "LS":
            mode = ComputeMode.SM_SHARING
        pod_list.append(
            TracePod(
                name=f"syn-pod-{i:05d}",
                cpu_milli=cpu,
                memory_mib=cpu * 4,
                num_gpu=num,
                gpu_milli=milli,
                gpu_spec=spec if num else (),
                qos=qos,
                mode=mode,
                namespace=f"team-{i % 4}" if mixed_modes else "openb",
            )
        )
    return node_list, pod_list
