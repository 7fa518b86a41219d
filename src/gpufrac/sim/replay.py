"""One replay: a trace, a policy and a seed through the placement engine, with the paper's metrics.

The engine is the product's (``gpufrac.placement.Engine``), fed ``NodeSpec``s and ``PendingPod``s built
from trace rows; the replay only submits, records and measures.

``window`` hands the engine the pods in consecutive groups, as a scheduler that collects a burst before
placing it (the service's batch): each group holds only pods that have arrived, never later ones, and the
metrics are recorded pod by pod in arrival order once its group is placed. A window of 1 is the published
protocol.

``offline_bound`` is a reference, not a policy: the same sampled workload known in advance, placed
largest first with FGD (first-fit-decreasing with FGD's node choice). Where whole-GPU pods dominate it
lies 2-3 points above every online policy and shows what arrival order costs; on sharing-heavy traces
it lands below online FGD (docs/benchmarks.md), so it is a reference to read figures against, not a
ceiling. Reports mark it as a bound, never as a policy.
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
BOUND = "offline-bound"
"""The name the offline reference carries in results (not a policy: ``make_policy`` does not know it)."""
BOUND_POLICY = "fgd"


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
    window: int = 1

    @property
    def bound(self) -> bool:
        return self.policy == BOUND

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
    window: int = 1,
) -> RunResult:
    """Replay ``pods`` (the original list; sampling happens here) on ``nodes`` with ``policy``.

    FGD-based policies get the typical pods of ``pods`` as a prior, as in the paper; with ``online``
    they get none and learn the distribution from the pods they see, as the scheduler service does.
    ``window`` > 1 submits groups of that many received pods at once (module docstring).
    """
    if window < 1:
        raise ValueError(f"window must be at least 1 pod, got {window}")
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
    for first in range(0, len(sequence), window):
        group = [make(tp, first + j) for j, tp in enumerate(sequence[first : first + window])]
        start = time.perf_counter()
        decisions = engine.schedule(group) if window > 1 else [engine.place(group[0])]
        engine_seconds += time.perf_counter() - start
        for j, decision in enumerate(decisions):
            i = first + j
            tp = sequence[i]
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
        window=window,
    )


def offline_bound(
    *,
    trace: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    seed: int,
    gpu_mib: dict[str, int] | None = None,
) -> RunResult:
    """The offline reference for one seed (module docstring).

    Every pod of the seed's sampled sequence (130 % arrival), sorted largest first (GPU, then CPU, then
    memory; arrival order among equals), placed with FGD and its prior; allocation is what was placed
    over capacity. It has no value at 100 %: the pods that had arrived by 100 % (exactly the cluster's
    capacity), placed the same way, measured below online FGD (default trace, seed 42: 92.38 against
    95.42), so no figure is claimed there.
    """
    capacity = capacity_milli(nodes)
    gpus = capacity // 1000
    sequence = inflate(pods, seed=seed, capacity=capacity)
    engine = Engine(policy=BOUND_POLICY, seed=seed, typical=shape_counts(pods))
    for node in nodes:
        engine.add_node(node_spec(node, gpu_mib))
    make = PodFactory()
    submitted = [make(tp, i) for i, tp in enumerate(sequence)]
    start = time.perf_counter()
    decisions = engine.schedule(submitted, largest_first=True)
    seconds = time.perf_counter() - start
    placed = [tp for tp, d in zip(sequence, decisions, strict=True) if isinstance(d, Placement)]
    a130 = round(100.0 * sum(tp.gpu_total_milli for tp in placed) / capacity, 2)
    return RunResult(
        trace=trace,
        policy=BOUND,
        seed=seed,
        pods=len(sequence),
        placed=len(placed),
        failed=len(sequence) - len(placed),
        alloc_100=float("nan"),
        alloc_130=a130,
        unallocated_gpus_100=float("nan"),
        unallocated_gpus_130=unallocated_gpus(a130, gpus),
        frag_rate_90=float("nan"),
        frag_rate_100=float("nan"),
        frag_rate_end=fragmentation_rate(engine, typical_pods(pods)),
        seconds=seconds,
        placements_per_s=len(placed) / seconds if seconds else 0.0,
        window=len(sequence),
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
