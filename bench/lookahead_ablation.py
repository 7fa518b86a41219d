"""Look-ahead orders for a window of received pods: which order of a burst places the most GPU.

fgd-plus places a batch of pods it already holds largest first (``Policy.largest_first``): +0.22 point
at 64 pods and +0.29 at 256 on the default trace (seed 42), against 96.3 % asked by issue 16. This bench
tries other orders of the same windows, with the same engine and policy, to see whether a smarter order
gets more out of the pods the scheduler already holds (never future ones: each window holds only pods
that have arrived, as in ``gpufrac.sim.replay``):

- ``lf``: largest first by GPU, then CPU, then memory (what fgd-plus does);
- ``hard``: hardest first: multi-GPU pods, then whole-GPU pods, then shares, then CPU-only pods, each
  group by its dominant share of GPU, CPU and memory against a typical GPU node's per-GPU amounts;
- ``lfcpu``: largest GPU first, then the most CPU per GPU first;
- ``small-shares``: whole-GPU pods largest first, shares smallest first;
- ``arrival``: arrival order (no look-ahead);
- ``policy``: the policy's own look-ahead order (``Engine.batch_key``): largest first for fgd-plus; for
  fgd-room whole GPUs first, then the shares in tiers of the room they strand on a fresh GPU, least
  first, arrival order within a tier (``RoomWaste.batch_key``); ``room@X``: that order with its table's
  stop weight X instead of ``ORDER_STOP_WEIGHT``; ``tier@N``: with tiers of N thousandths instead of
  ``ORDER_TIER`` (``tier@1``: every distinct stranded room its own tier, the order of 2026-12-03's
  fourth round up to ties; the sweeps are in docs/benchmarks.md);
- ``best-placed``: largest first; when a pod of the window fails, also ``hard``, ``lfcpu`` and
  ``arrival`` (each on a statement that is discarded), and the order that placed the most GPU is kept;
- ``best-frag``: ``lf``, ``hard`` and ``lfcpu`` for every window, keeping the one that placed the most
  GPU and, among those, left the lowest FGD fragmentation of the cluster (about six times slower);
- ``arrival-then-lf``: arrival order while every pod of the window fits; when one fails, the window is
  placed again largest first and the order that placed more GPU is kept (reordering only near
  saturation, where it decides which pods get the last free GPUs).

Usage: .venv/bin/python bench/lookahead_ablation.py --window 64 --orders lf,hard,best-frag --seeds 42-44
       [--policy fgd-plus] [--trace default]
Prints a line per order, then a one-line JSON summary last. docs/benchmarks.md (issue 16) has the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from gpufrac.placement.decision import Placement  # noqa: E402
from gpufrac.placement.demand import demand_of  # noqa: E402
from gpufrac.placement.engine import Engine  # noqa: E402
from gpufrac.placement.fragmentation import node_fragmentation  # noqa: E402
from gpufrac.placement.model import PendingPod  # noqa: E402
from gpufrac.placement.room_waste import RoomWaste  # noqa: E402
from gpufrac.placement.typical import PriorTypicalPods  # noqa: E402
from gpufrac.sim.experiment import mean, parse_seeds  # noqa: E402
from gpufrac.sim.metrics import allocation_at  # noqa: E402
from gpufrac.sim.trace import TraceNode, TracePod, load_nodes, load_pods, node_file, pod_file  # noqa: E402
from gpufrac.sim.variants import BASE, VARIANTS, variant  # noqa: E402
from gpufrac.sim.workload import (  # noqa: E402
    PodFactory,
    capacity_milli,
    inflate,
    node_spec,
    shape_counts,
    typical_pods,
)

Key = Callable[[TracePod, int], tuple]


def keys(nodes: list[TraceNode]) -> dict[str, Key]:
    gpu_nodes = [n for n in nodes if n.gpus]
    cpu_per_gpu = float(np.median([n.cpu_milli / n.gpus for n in gpu_nodes]))
    mem_per_gpu = float(np.median([n.memory_mib / n.gpus for n in gpu_nodes]))

    def largest(tp: TracePod, i: int) -> tuple:
        return (-tp.gpu_total_milli, -tp.cpu_milli, -tp.memory_mib, i)

    def hard(tp: TracePod, i: int) -> tuple:
        dominant = max(tp.gpu_total_milli / 1000, tp.cpu_milli / cpu_per_gpu, tp.memory_mib / mem_per_gpu)
        group = 0 if tp.num_gpu > 1 else 1 if tp.gpu_milli >= 1000 else 2 if tp.gpu_milli else 3
        return (group, -dominant, i)

    def cpu_per_device(tp: TracePod, i: int) -> tuple:
        return (-tp.gpu_total_milli, -tp.cpu_milli / max(tp.num_gpu, 1), i)

    def small_shares(tp: TracePod, i: int) -> tuple:
        if tp.gpu_milli >= 1000:
            return (0, -tp.gpu_total_milli, -tp.cpu_milli, i)
        return (1, tp.gpu_milli if tp.gpu_milli else 1 << 30, i)

    return {
        "lf": largest,
        "hard": hard,
        "lfcpu": cpu_per_device,
        "small-shares": small_shares,
        "arrival": lambda tp, i: (i,),
    }


BEST = {
    "best-placed": ("lf", "hard", "lfcpu", "arrival"),
    "best-frag": ("lf", "hard", "lfcpu"),
    "arrival-then-lf": ("arrival", "lf"),
}


def replay(
    *, nodes: list[TraceNode], pods: list[TracePod], policy: str, seed: int, window: int, order: str
) -> float:
    """Allocation at 130 % arrival (the replay's metric) with windows placed in ``order``."""
    capacity = capacity_milli(nodes)
    engine = Engine(policy=policy, seed=seed, typical=shape_counts(pods))
    for node in nodes:
        engine.add_node(node_spec(node))
    typical = typical_pods(pods)
    orders = keys(nodes)
    if order == "policy":
        orders[order] = lambda tp, i: (tuple(-v for v in engine.batch_key(pending[i])), i)
    elif order.startswith(("room@", "tier@")):
        value = order.split("@", 1)[1]
        room = RoomWaste(
            PriorTypicalPods(shape_counts(pods)),
            **({"order_stop": float(value)} if order.startswith("room@") else {"order_tier": int(value)}),
        )
        orders[order] = lambda tp, i: (
            tuple(-v for v in room.batch_key(demand_of(pending[i], policy=policy))),
            i,
        )
    sequence = inflate(pods, seed=seed, capacity=capacity)
    make = PodFactory()
    arrived = np.zeros(len(sequence))
    allocated = np.zeros(len(sequence))
    arrived_milli = allocated_milli = 0

    def fragmentation() -> float:
        frag, _ = node_fragmentation(engine.state, typical, engine.state.live())
        return float(frag.sum())

    def attempt(name: str, group: list[tuple[int, TracePod]], pending: dict[int, PendingPod]) -> tuple:
        """Place ``group`` in order ``name`` on a statement: (statement, placed per index, GPU placed)."""
        statement = engine.statement()
        ok = {
            i: isinstance(statement.place(pending[i]), Placement)
            for i, tp in sorted(group, key=lambda item: orders[name](item[1], item[0]))
        }
        return statement, ok, sum(tp.gpu_total_milli for i, tp in group if ok[i])

    pending: dict[int, PendingPod] = {}
    for first in range(0, len(sequence), window):
        group = list(enumerate(sequence[first : first + window], start=first))
        pending = {i: make(tp, i) for i, tp in group}

        if order in orders:
            statement, ok, _ = attempt(order, group, pending)
        else:
            candidates = BEST[order]
            statement, ok, milli = attempt(candidates[0], group, pending)
            if order == "best-frag" or not all(ok.values()):  # best-placed, arrival-then-lf: on a failure
                best: tuple | None = None
                for name in candidates:
                    if name != candidates[0]:
                        statement, ok, milli = attempt(name, group, pending)
                    value = (milli, -fragmentation() if order == "best-frag" else 0.0)
                    if best is None or value > best[0]:
                        best = (value, name)
                    statement.discard()
                assert best is not None
                statement, ok, _ = attempt(best[1], group, pending)
        statement.commit()
        for i, tp in group:
            arrived_milli += tp.gpu_total_milli
            allocated_milli += tp.gpu_total_milli if ok[i] else 0
            arrived[i] = 100.0 * arrived_milli / capacity
            allocated[i] = 100.0 * allocated_milli / capacity
    return allocation_at(arrived, allocated, 130)


def _parametrised(order: str) -> bool:
    """Whether ``order`` is ``room@X`` with a positive number X or ``tier@N`` with a whole N >= 1."""
    name, _, value = order.partition("@")
    try:
        return (name == "room" and float(value) > 0) or (name == "tier" and int(value) >= 1)
    except ValueError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument("--policy", default="fgd-plus")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--orders", default="lf,hard,best-frag")
    parser.add_argument("--seeds", default="42")
    args = parser.parse_args()
    nodes = load_nodes(node_file())
    known = [*keys(nodes), "policy", "room@X", "tier@N", *BEST]
    orders = args.orders.split(",")
    unknown = [o for o in orders if o not in known and not _parametrised(o)]
    if unknown:
        parser.error(f"unknown order {', '.join(unknown)}; known: {', '.join(known)}")
    if args.window < 2:
        parser.error(f"--window must be at least 2 pods to reorder anything, got {args.window}")
    trace = args.trace
    pods = variant(trace, load_pods(pod_file(BASE))) if trace in VARIANTS else load_pods(pod_file(trace))
    seeds = parse_seeds(args.seeds)
    started = time.perf_counter()
    out: dict[str, float] = {}
    for order in orders:
        values = [
            replay(nodes=nodes, pods=pods, policy=args.policy, seed=s, window=args.window, order=order)
            for s in seeds
        ]
        out[order] = round(mean(values), 3)
        per_seed = " ".join(f"{v:.2f}" for v in values)
        print(
            f"{trace} {args.policy} W={args.window} {order:13s} @130 {out[order]:.3f}  seeds: {per_seed}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "bench": "lookahead_ablation",
                "trace": trace,
                "policy": args.policy,
                "window": args.window,
                "seeds": args.seeds,
                "alloc_130": out,
                "seconds": round(time.perf_counter() - started, 1),
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
