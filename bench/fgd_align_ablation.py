"""Why fgd-align is built the way it is: its tie-break against alternatives, same trace, same seeds.

Variants (all: FGD's integer score first, then the named tie-break, then the fixed node order):

- ``fgd``: no tie-break (the baseline; the paper's algorithm);
- ``fgd+bestfit``: fullest node (BestFit's 0..100 score);
- ``fgd+align4`` / ``fgd-align`` (10 steps) / ``fgd+align30``: alignment in coarser or finer steps;
- ``fgd+align-continuous``: alignment with a million steps, i.e. almost no ties left for the fixed order.

Usage: .venv/bin/python bench/fgd_align_ablation.py [--trace default] [--seeds 42-46] [--workers 2]
Prints a line per variant, then a one-line JSON summary last (delta against ``fgd`` in the same run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpufrac.placement.fragmentation import Fgd  # noqa: E402
from gpufrac.placement.policies import POLICIES, Policy, _typical, lexicographic  # noqa: E402
from gpufrac.placement.scoring import Alignment, BestFit, BestFitGpu  # noqa: E402
from gpufrac.sim.experiment import by_policy, mean, parse_seeds, run_experiment  # noqa: E402
from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file  # noqa: E402


def variant(name: str, tie_break, then_range: int):
    return lambda prior: Policy(
        name, lexicographic(Fgd(_typical(prior)), tie_break(), then_range=then_range), BestFitGpu()
    )


VARIANTS = {
    "fgd+bestfit": variant("fgd+bestfit", BestFit, 101),
    "fgd+align4": variant("fgd+align4", lambda: Alignment(levels=4), 5),
    "fgd+align30": variant("fgd+align30", lambda: Alignment(levels=30), 31),
    "fgd+align-continuous": variant("fgd+align-continuous", lambda: Alignment(levels=1_000_000), 1_000_001),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="default")
    parser.add_argument("--seeds", default="42-46")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    POLICIES.update(VARIANTS)  # registered before the worker processes fork
    policies = ["fgd", "fgd+bestfit", "fgd+align4", "fgd-align", "fgd+align30", "fgd+align-continuous"]
    started = time.perf_counter()
    results = run_experiment(
        trace=args.trace,
        nodes=load_nodes(node_file()),
        pods=load_pods(pod_file(args.trace)),
        policies=policies,
        seeds=parse_seeds(args.seeds),
        workers=args.workers,
    )
    means = {p: mean([r.alloc_130 for r in runs]) for p, runs in by_policy(results).items()}
    for p in policies:
        print(f"{p:22s} @130 {means[p]:.3f}  ({means[p] - means['fgd']:+.3f} vs fgd)")
    summary = {
        "bench": "fgd_align_ablation",
        "trace": args.trace,
        "seeds": args.seeds,
        "alloc_130": {p: round(v, 3) for p, v in means.items()},
        "delta_vs_fgd": {p: round(v - means["fgd"], 3) for p, v in means.items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
