"""Engine memory at scale: a 5,000-node, 40,000-GPU cluster holding 100,000 placed pods.

Builds the cluster (8 x 80 GiB GPUs, 256 cores, 2 TiB per node), places pods of mixed shapes (shares of
one GPU, MiB requests, two-device fractions, whole GPUs, sm-sharing in several namespaces) until 100,000
are held, and reads the process RSS. Baseline in the same run: the RSS after imports and after adding
the nodes, so the figure splits into interpreter, cluster and per-pod cost.

Target: < 1 GiB RSS with 100,000 placed pods.

Usage: .venv/bin/python bench/placement_memory.py [--nodes 5000] [--pods 100000] [--policy fgd]
Prints progress, then a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from gpufrac.contract.keys import GPU_MODEL_LABEL  # noqa: E402
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest  # noqa: E402
from gpufrac.placement.decision import Placement  # noqa: E402
from gpufrac.placement.engine import Engine  # noqa: E402
from gpufrac.placement.model import GpuDevice, NodeSpec, PendingPod  # noqa: E402

TARGET_MIB = 1024.0
GPUS_PER_NODE = 8
GPU_MIB = 81920


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shapes() -> list[tuple[PodGpuRequest, int]]:
    def share(portion: float, mode: ComputeMode = ComputeMode.TIME_SLICING, count: int = 1) -> PodGpuRequest:
        return PodGpuRequest((ContainerGpuRequest("main", GpuMemory(portion=portion), None, mode, count),))

    return [
        (share(0.25), 2000),
        (share(0.125), 1000),
        (share(0.5, ComputeMode.SM_SHARING), 4000),
        (PodGpuRequest((ContainerGpuRequest("main", GpuMemory(mib=10240), GpuMemory(mib=20480)),)), 2000),
        (share(0.25, count=2), 4000),
        (PodGpuRequest((ContainerGpuRequest("main", None, None, device_count=1, exclusive=True),)), 8000),
        (PodGpuRequest(), 1000),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=100_000)
    parser.add_argument("--policy", default="fgd")
    args = parser.parse_args()
    gc.collect()
    rss_imports = rss_mib()
    engine = Engine(policy=args.policy, seed=1)
    for i in range(args.nodes):
        name = f"node-{i:05d}"
        engine.add_node(
            NodeSpec(
                name=name,
                cpu_milli=256_000,
                memory_bytes=2 << 40,
                max_pods=250,
                labels={GPU_MODEL_LABEL: "A100", "zone": f"z{i % 3}"},
                gpu_model="A100",
                gpus=tuple(GpuDevice(f"GPU-{i:05d}-{g}", g, GPU_MIB, "A100") for g in range(GPUS_PER_NODE)),
            )
        )
    gc.collect()
    rss_nodes = rss_mib()
    rng = np.random.default_rng(7)
    kinds = shapes()
    # Weights keep GPU demand under capacity so the target number of pods is actually held.
    picks = rng.choice(len(kinds), size=args.pods * 2, p=[0.3, 0.3, 0.15, 0.1, 0.05, 0.02, 0.08])
    placed = attempted = 0
    start = time.perf_counter()
    for k in picks:
        if placed >= args.pods:
            break
        gpu, cpu = kinds[int(k)]
        attempted += 1
        pod = PendingPod(
            namespace=f"ns-{attempted % 50}",
            name=f"pod-{attempted}",
            uid=f"uid-{attempted:07d}",
            gpu=gpu,
            cpu_milli=cpu,
            memory_bytes=cpu << 21,
            arrival=attempted,
        )
        placed += isinstance(engine.place(pod), Placement)
        if attempted % 20_000 == 0:
            print(f"{placed} placed, RSS {rss_mib():.0f} MiB", flush=True)
    seconds = time.perf_counter() - start
    gc.collect()
    rss_end = rss_mib()
    summary = {
        "bench": "placement_memory",
        "policy": args.policy,
        "nodes": args.nodes,
        "gpus": args.nodes * GPUS_PER_NODE,
        "pods_placed": placed,
        "pods_attempted": attempted,
        "rss_after_imports_mib": round(rss_imports, 1),
        "rss_after_nodes_mib": round(rss_nodes, 1),
        "rss_with_pods_mib": round(rss_end, 1),
        "bytes_per_pod": round((rss_end - rss_nodes) * 1024 * 1024 / max(placed, 1)),
        "placements_per_s": round(placed / seconds, 1),
        "target_mib": TARGET_MIB,
        "meets_target": rss_end < TARGET_MIB and placed >= args.pods,
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
