"""One replay: a trace, a policy and a seed through the placement engine, with the paper's metrics.

The engine is the product's (``gpufrac.placement.Engine``), fed ``NodeSpec``s and ``PendingPod``s built
from trace rows; the replay only submits, records and measures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.fragmentation import node_fragmentation
from gpufrac.placement.typical import TypicalSet

from .metrics import allocation_at, curve, unallocated_gpus
from .trace import TraceNode, TracePod
from .workload import PodFactory, capacity_milli, inflate, node_spec, shape_counts, typical_pods

FRAG_EVERY_PCT = 5


@dataclass
class RunResult:
    trace: str
    policy: str
    seed: int
    pods: int
    placed: int
    failed: int
    alloc_100: float
    alloc_130: float
    unallocated_gpus_100: float
    unallocated_gpus_130: float
    frag_rate_90: float
    frag_rate_100: float
    frag_rate_end: float
    seconds: float
    placements_per_s: float
    curve: list[float] = field(default_factory=list)
    frag_curve: list[tuple[float, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("curve")
        out.pop("frag_curve")
        return out


def replay(
    *,
    trace: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policy: str,
    seed: int,
    gpu_mib: dict[str, int] | None = None,
    online: bool = False,
) -> RunResult:
    """Replay ``pods`` (the original list; sampling happens here) on ``nodes`` with ``policy``.

    FGD-based policies get the typical pods of ``pods`` as a prior, as in the paper; with ``online``
    they get none and learn the distribution from the pods they see, as the scheduler service does.
    """
    capacity = capacity_milli(nodes)
    gpus = capacity // 1000
    prior = typical_pods(pods)
    engine = Engine(policy=policy, seed=seed, typical=None if online else shape_counts(pods))
    for node in nodes:
        engine.add_node(node_spec(node, gpu_mib))
    sequence = inflate(pods, seed=seed, capacity=capacity)
    make = PodFactory()
    arrived = np.zeros(len(sequence))
    allocated = np.zeros(len(sequence))
    arrived_milli = allocated_milli = 0
    placed = 0
    frag_points: list[tuple[float, float]] = []
    next_frag = 0.0
    engine_seconds = 0.0
    for i, tp in enumerate(sequence):
        pod = make(tp, i)
        start = time.perf_counter()
        decision = engine.place(pod)
        engine_seconds += time.perf_counter() - start
        arrived_milli += tp.gpu_total_milli
        if isinstance(decision, Placement):
            placed += 1
            allocated_milli += tp.gpu_total_milli
        arrived[i] = 100.0 * arrived_milli / capacity
        allocated[i] = 100.0 * allocated_milli / capacity
        if arrived[i] >= next_frag:
            frag_points.append((float(arrived[i]), fragmentation_rate(engine, prior)))
            next_frag += FRAG_EVERY_PCT
    frag_points.append((float(arrived[-1]) if len(sequence) else 0.0, fragmentation_rate(engine, prior)))
    a100 = allocation_at(arrived, allocated, 100)
    a130 = allocation_at(arrived, allocated, 130)
    return RunResult(
        trace=trace,
        policy=policy,
        seed=seed,
        pods=len(sequence),
        placed=placed,
        failed=len(sequence) - placed,
        alloc_100=a100,
        alloc_130=a130,
        unallocated_gpus_100=unallocated_gpus(a100, gpus),
        unallocated_gpus_130=unallocated_gpus(a130, gpus),
        frag_rate_90=_frag_near(frag_points, 90.0),
        frag_rate_100=_frag_near(frag_points, 100.0),
        frag_rate_end=frag_points[-1][1],
        seconds=engine_seconds,
        placements_per_s=placed / engine_seconds if engine_seconds else 0.0,
        curve=curve(arrived, allocated),
        frag_curve=frag_points,
    )


def fragmentation_rate(engine: Engine, typical: TypicalSet) -> float:
    """Cluster fragmentation / free GPU capacity, in percent (0 when nothing is free)."""
    nodes = engine.state.live()
    frag, free = node_fragmentation(engine.state, typical, nodes)
    total = float(free.sum())
    return 100.0 * float(frag.sum()) / total if total else 0.0


def _frag_near(points: list[tuple[float, float]], x: float) -> float:
    if not points:
        return float("nan")
    return min(points, key=lambda p: abs(p[0] - x))[1]
