"""Which ideas make a better default policy: each idea of issue 16 as a variant, same traces, same seeds.

Variants (registered here, not in the product's policy table, except the named policies):

- ``fgd`` (the paper), ``fgd-align`` (FGD, then (CPU, GPU) alignment in ten steps): the baselines;
- ``fgd-joint``: FGD's fragmentation measured over the joint GPU x CPU shape of the typical pods (a
  typical pod's usable GPU room is cut to the copies the node's free CPU can host), replacing the
  GPU-only measure; ``fgd-joint-align``: the same, then alignment;
- ``fgd+joint+align``: CPU stranded next to free GPU charged as a tie-break only: FGD's integer score,
  then the joint measure's score, then alignment;
- ``fgd-align+joint``: FGD, alignment, then the joint measure as the last tie-break;
- ``fgd-align+bestfit``: FGD, alignment, then BestFit's fullest node; ``fgd50-align`` /
  ``fgd200-align``: FGD's sigmoid scaled to 0..50 or 0..200 instead of 0..100 (fewer or more ties);
- ``fgd-align-cpujoint``: the joint measure for CPU-only pods only (the pods that strand GPUs by eating a
  node's CPU), GPU pods scored as in fgd-align;
- ``fgd-plus-bygpu``: fgd-plus one pod at a time with FGD's typical pods weighted by the GPU each shape
  asks for instead of its pod count; ``fgd-plus-cov99`` / ``fgd-plus-cov100``: the typical pods cover
  99 % / all of the workload instead of 95 % (so the rare 0.05-0.16 GPU pods that alone fit next to a
  0.81 GPU pod count as typical);
- ``ss-fgd-plus``: online bin packing's Sum-of-Squares rule (``SumOfSquares``) first for pods that share
  one GPU, then fgd-plus's keys; ``fgd-plus-ss``: fgd-plus's FGD, Sum-of-Squares, then alignment;
  ``fgd-plus-ssgpu``: the same with FGD and Sum-of-Squares scored on the same GPU
  (``FgdThen``). Slow: every node is rescored for every pod;
- ``fgd-room`` (the product's default) ranks one-GPU shares by the room they leave stranded
  (``gpufrac.placement.room_waste``) before fgd-plus's keys; ``fgd-room-stop<X>``: the same with the
  stranded-room estimate's stop weight X instead of 0.005; ``fgd-room-cov100``: its table built from
  every share of the workload, not the typical 95 %; ``fgd-plus-room``: fgd-plus's FGD first, the
  stranded room only as its tie-break on the same GPU (``FgdThen``); ``fgd-room-gpuonly``: fgd-room
  without the charge for the GPU room a share's CPU strands (``RoomWaste(host=False)``: fgd-room as it
  was until 2026-12-03); ``fgd-room-crossed``: the charge for every typical pod whose CPU need a share
  crosses, not only when the node is left too little CPU for any (``RoomWaste(every_crossing=True)``);
- look-ahead: any policy run with ``--window W`` gets the pods in bursts of W already received pods;
  a ``+lf`` suffix places each burst largest first (``Policy.largest_first``);
- online learning: ``--online`` gives no prior; ``fgd-align-decay<N>`` forgets with a half-life of N
  requests (``OnlineTypicalPods(half_life=N)``).

Usage: .venv/bin/python bench/policy_ablation.py --traces default,cpu2x --policies fgd,fgd-align
       [--seeds 42-51] [--window 1] [--online] [--bound] [--workers 1]
Traces are the published names or the CPU-heavier variants (``gpufrac.sim.variants``). Prints a line per
(trace, variant), then a one-line JSON summary last.
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

from gpufrac.placement.demand import Demand  # noqa: E402
from gpufrac.placement.filters import Fit  # noqa: E402
from gpufrac.placement.fragmentation import Fgd, _sigmoid_score  # noqa: E402
from gpufrac.placement.policies import POLICIES, Policy, Prior, _typical  # noqa: E402
from gpufrac.placement.room_waste import RoomWaste  # noqa: E402
from gpufrac.placement.scoring import Alignment, BestFit, BestFitGpu, Scorer, milli_of  # noqa: E402
from gpufrac.placement.state import ClusterState  # noqa: E402
from gpufrac.placement.typical import OnlineTypicalPods, PriorTypicalPods, TypicalSource  # noqa: E402
from gpufrac.sim.experiment import by_policy, mean, parse_seeds, run_experiment  # noqa: E402
from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file  # noqa: E402
from gpufrac.sim.variants import BASE, VARIANTS, variant  # noqa: E402


def chain(name: str, *keys: tuple[Scorer, int], largest_first: bool = False) -> Policy:
    """Lexicographic scorers: each (scorer, number of values it takes), most significant first."""
    weighted: list[tuple[Scorer, int]] = []
    weight = 1
    for scorer, values in reversed(keys):
        weighted.append((scorer, weight))
        weight *= values
    return Policy(name, tuple(reversed(weighted)), BestFitGpu(), largest_first=largest_first)


class SumOfSquares:
    """Online bin packing's Sum-of-Squares rule (Csirik et al., STOC'99) for a pod that shares one GPU.

    N[g]: how many partly used GPUs have g hundredths of a GPU free. Putting a pod of share s on a GPU
    with room g turns one g into g - s; the rule picks the GPU that keeps sum(N[g]^2) lowest, which
    keeps the rooms of one size few, so later pods find a room they fill exactly. Global input: the
    epoch moves on every placement, so the engine rescores every node (slow; a measurement only).
    Other pods score a constant.
    """

    BINS = 100
    CLIP = 1800
    RANGE = 2 * CLIP + 1

    def __init__(self) -> None:
        self.counts = np.zeros(self.BINS + 1, dtype=np.int64)
        self.epoch = 0
        self._seen = b""

    def prepare(self, state: ClusterState) -> None:
        fm = state.free_milli(state.live())
        rooms = np.rint(fm[(fm > 0) & (fm < 1000)] / 10).astype(np.int64)
        counts = np.bincount(rooms, minlength=self.BINS + 1)[: self.BINS + 1]
        counts[0] = counts[self.BINS] = 0
        key = counts.tobytes()
        if key != self._seen:
            self._seen = key
            self.counts = counts
            self.epoch += 1

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        single = demand.single
        if single is None or single.count != 1 or single.exclusive:
            return np.full(fit.nodes.size, self.CLIP, dtype=np.int64), None
        values = np.where(fit.masks[0], self.per_gpu(state, demand, fit), -1)
        best = values.argmax(axis=1)
        return values[np.arange(values.shape[0]), best], best

    def per_gpu(self, state: ClusterState, demand: Demand, fit: Fit) -> np.ndarray:
        """(nodes, GPU slots) score of putting the one-GPU share ``demand`` on each GPU (0..RANGE-1)."""
        single = demand.single
        assert single is not None
        cap = state.cap[fit.nodes]
        fm = fit.free_milli()
        room = np.rint(fm / 10).astype(np.int64)
        share = np.rint(milli_of(single.request_mib(cap), cap) / 10).astype(np.int64)
        left = np.maximum(room - share, 0)
        n = self.counts
        opened = room >= self.BINS
        delta = np.where(opened, 0, 1 - 2 * n[np.minimum(room, self.BINS)])  # the room g goes away
        delta = delta + np.where(left > 0, 2 * n[np.minimum(left, self.BINS)] + 1, 0)  # room g - s appears
        return self.CLIP - np.clip(delta, -self.CLIP, self.CLIP)


class FgdThen:
    """FGD's score per GPU, ties broken by ``then`` on the same GPU (one GPU choice for both).

    ``then`` scores GPUs with ``per_gpu`` in 0..RANGE-1 and gives CLIP to every pod it does not rank
    (``SumOfSquares``, ``RoomWaste``)."""

    def __init__(self, fgd: Fgd, then: SumOfSquares | RoomWaste) -> None:
        self.fgd = fgd
        self.then = then

    @property
    def epoch(self) -> tuple:
        return (self.fgd.epoch, self.then.epoch)

    def prepare(self, state: ClusterState) -> None:
        self.fgd.prepare(state)
        if isinstance(self.then, SumOfSquares):
            self.then.prepare(state)

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        delta, mask = self.fgd.deltas(state, demand, fit)
        fgd = _sigmoid_score(delta, self.fgd.scale)
        if mask is None:
            return fgd * self.then.RANGE + self.then.CLIP, None
        values = np.where(mask, fgd * self.then.RANGE + self.then.per_gpu(state, demand, fit), -1)
        best = values.argmax(axis=1)
        return values[np.arange(values.shape[0]), best], best


def decaying(prior: Prior | None, half_life: float) -> TypicalSource:
    return PriorTypicalPods(prior) if prior is not None else OnlineTypicalPods(half_life=half_life)


def _variants() -> dict[str, Callable[[Prior | None], Policy]]:
    def fgd(prior: Prior | None, **kw: object) -> Fgd:
        return Fgd(_typical(prior), **kw)  # type: ignore[arg-type]

    out: dict[str, Callable[[Prior | None], Policy]] = {
        "fgd-joint": lambda p: chain("fgd-joint", (fgd(p, joint="all"), 101)),
        "fgd-joint-align": lambda p: chain("fgd-joint-align", (fgd(p, joint="all"), 101), (Alignment(), 11)),
        "fgd+joint+align": lambda p: chain(
            "fgd+joint+align", (fgd(p), 101), (fgd(p, joint="all"), 101), (Alignment(), 11)
        ),
        "fgd-align+joint": lambda p: chain(
            "fgd-align+joint", (fgd(p), 101), (Alignment(), 11), (fgd(p, joint="all"), 101)
        ),
        "fgd-align+bestfit": lambda p: chain(
            "fgd-align+bestfit", (fgd(p), 101), (Alignment(), 11), (BestFit(), 101)
        ),
        "fgd50-align": lambda p: chain("fgd50-align", (fgd(p, scale=50.0), 51), (Alignment(), 11)),
        "fgd200-align": lambda p: chain("fgd200-align", (fgd(p, scale=200.0), 201), (Alignment(), 11)),
    }

    def typical_of(prior: Prior | None, *, by_gpu: bool = False, coverage: float = 0.95) -> TypicalSource:
        if prior is None:
            return OnlineTypicalPods(by_gpu=by_gpu, coverage=coverage)
        return PriorTypicalPods(prior, by_gpu=by_gpu, coverage=coverage)

    out["fgd-plus-bygpu"] = lambda p: chain(
        "fgd-plus-bygpu", (Fgd(typical_of(p, by_gpu=True), joint="auto"), 101), (Alignment(), 11)
    )
    for cov in (99, 100):
        out[f"fgd-plus-cov{cov}"] = lambda p, c=cov: chain(
            f"fgd-plus-cov{c}", (Fgd(typical_of(p, coverage=c / 100), joint="auto"), 101), (Alignment(), 11)
        )
    out["ss-fgd-plus"] = lambda p: chain(
        "ss-fgd-plus", (SumOfSquares(), SumOfSquares.RANGE), (fgd(p, joint="auto"), 101), (Alignment(), 11)
    )
    out["fgd-plus-ss"] = lambda p: chain(
        "fgd-plus-ss", (fgd(p, joint="auto"), 101), (SumOfSquares(), SumOfSquares.RANGE), (Alignment(), 11)
    )
    out["fgd-plus-ssgpu"] = lambda p: chain(
        "fgd-plus-ssgpu",
        (FgdThen(fgd(p, joint="auto"), SumOfSquares()), 101 * SumOfSquares.RANGE),
        (Alignment(), 11),
    )
    for stop in (0.001, 0.002, 0.01, 0.02, 0.05):
        out[f"fgd-room-stop{stop}"] = lambda p, stop=stop: chain(
            f"fgd-room-stop{stop}",
            (RoomWaste(_typical(p), stop=stop), RoomWaste.RANGE),
            (fgd(p, joint="auto"), 101),
            (Alignment(), 11),
            largest_first=True,
        )
    out["fgd-plus-room"] = lambda p: chain(
        "fgd-plus-room",
        (FgdThen(fgd(p, joint="auto"), RoomWaste(_typical(p))), 101 * RoomWaste.RANGE),
        (Alignment(), 11),
        largest_first=True,
    )

    def room_variant(name: str, **kw: bool) -> Callable[[Prior | None], Policy]:
        """fgd-room's keys with ``RoomWaste(**kw)``; one typical source for both keys, fed by FGD, as in
        the product (with ``--online`` a source of its own would never learn anything)."""

        def make(p: Prior | None) -> Policy:
            typical = _typical(p)
            return chain(
                name,
                (RoomWaste(typical, **kw), RoomWaste.RANGE),
                (Fgd(typical, joint="auto"), 101),
                (Alignment(), 11),
                largest_first=True,
            )

        return make

    out["fgd-room-gpuonly"] = room_variant("fgd-room-gpuonly", host=False)
    out["fgd-room-crossed"] = room_variant("fgd-room-crossed", every_crossing=True)
    out["fgd-room-cov100"] = lambda p: chain(
        "fgd-room-cov100",
        (RoomWaste(typical_of(p, coverage=1.0)), RoomWaste.RANGE),
        (fgd(p, joint="auto"), 101),
        (Alignment(), 11),
        largest_first=True,
    )
    out["fgd-align-cpujoint"] = lambda p: chain(
        "fgd-align-cpujoint", (fgd(p, joint="cpu-only"), 101), (Alignment(), 11)
    )
    for half_life in (1000, 4000):
        out[f"fgd-align-decay{half_life}"] = lambda p, h=half_life: chain(
            f"fgd-align-decay{h}", (Fgd(decaying(p, h)), 101), (Alignment(), 11)
        )
    for name in ("fgd", "fgd-align", "fgd-align-cpujoint"):
        base = out.get(name) or POLICIES[name]
        out[f"{name}+lf"] = lambda p, base=base, name=name: _largest_first(base(p), f"{name}+lf")
    return out


def _largest_first(policy: Policy, name: str) -> Policy:
    return Policy(name, policy.scorers, policy.picker, largest_first=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="default")
    parser.add_argument("--policies", default="fgd,fgd-align")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--window", type=int, default=1)
    parser.add_argument("--online", action="store_true")
    parser.add_argument("--bound", action="store_true", help="add the offline reference")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    POLICIES.update(_variants())  # registered before the worker processes fork
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    seeds = parse_seeds(args.seeds)
    nodes = load_nodes(node_file())
    started = time.perf_counter()
    out: dict[str, dict[str, float]] = {}
    for trace in args.traces.split(","):
        pods = variant(trace, load_pods(pod_file(BASE))) if trace in VARIANTS else load_pods(pod_file(trace))
        results = run_experiment(
            trace=trace,
            nodes=nodes,
            pods=pods,
            policies=policies,
            seeds=seeds,
            workers=args.workers,
            online=args.online,
            window=args.window,
            bound=args.bound,
        )
        out[trace] = {}
        for policy, runs in by_policy(results).items():
            value = mean([r.alloc_130 for r in runs])
            out[trace][policy] = round(value, 3)
            per_seed = " ".join(f"{r.alloc_130:.2f}" for r in runs)
            print(f"{trace:10s} {policy:22s} @130 {value:.3f}  seeds: {per_seed}", flush=True)
    summary = {
        "bench": "policy_ablation",
        "seeds": args.seeds,
        "window": args.window,
        "online": args.online,
        "alloc_130": out,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
