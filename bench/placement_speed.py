"""Placement speed on the 1,213-node openb cluster, one process, against an uncached baseline.

Replays one seed of the default trace (the published protocol: ~10,800 pods, 1.3x arrival) per policy
and reports engine placements per second (placed pods / engine time; failed attempts count in the time).
Baseline in the same run: the same engine with its per-node result cache defeated, i.e. every node is
filtered and scored for every pod (vectorised, but not incremental), on the first ``--baseline-pods``
pods. The ratio shows what the incremental design buys; load average is printed because the machine is
shared.

Targets: binpack >= 5,000 placements/s, fgd >= 1,000 placements/s, fgd-plus (the default) >= 1,500.

Usage: .venv/bin/python bench/placement_speed.py [--policies binpack,fgd,fgd-align,fgd-plus] [--seed 42]
       [--repeat 3] [--baseline-pods 1500]
Prints a line per policy, then a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpufrac.placement.decision import Placement  # noqa: E402
from gpufrac.placement.engine import Engine  # noqa: E402
from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file  # noqa: E402
from gpufrac.sim.workload import PodFactory, capacity_milli, inflate, node_spec, shape_counts  # noqa: E402

TARGETS = {"binpack": 5000.0, "fgd": 1000.0, "fgd-plus": 1500.0}


def run(policy: str, nodes, pods, seed: int, *, limit: int | None = None, cached: bool = True) -> float:
    engine = Engine(policy=policy, seed=seed, typical=shape_counts(pods))
    for n in nodes:
        engine.add_node(node_spec(n))
    sequence = inflate(pods, seed=seed, capacity=capacity_milli(nodes))[:limit]
    make = PodFactory()
    submitted = [make(p, i) for i, p in enumerate(sequence)]
    placed = 0
    start = time.perf_counter()
    for pod in submitted:
        if not cached:
            for kind in engine._kinds.values():
                kind.version[:] = -1
        placed += isinstance(engine.place(pod), Placement)
    return placed / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="binpack,fgd,fgd-align,fgd-plus")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--repeat", type=int, default=3, help="best of N (the machine is shared)")
    parser.add_argument("--baseline-pods", type=int, default=1500)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    nodes = load_nodes(node_file(None, args.data_dir))
    pods = load_pods(pod_file("default", args.data_dir))
    summary: dict[str, object] = {
        "bench": "placement_speed",
        "nodes": len(nodes),
        "load_before": os.getloadavg()[0],
    }
    results = {}
    for policy in args.policies.split(","):
        best = max(run(policy, nodes, pods, args.seed) for _ in range(args.repeat))
        baseline = run(policy, nodes, pods, args.seed, limit=args.baseline_pods, cached=False)
        target = TARGETS.get(policy)
        results[policy] = {
            "placements_per_s": round(best, 1),
            "uncached_baseline_per_s": round(baseline, 1),
            "speedup_vs_uncached": round(best / baseline, 2),
            "target": target,
            "meets_target": None if target is None else best >= target,
        }
        ratio = best / baseline
        print(f"{policy:10s} {best:8.0f} placements/s  (uncached baseline {baseline:6.0f}/s, x{ratio:.1f})")
        sys.stdout.flush()
    summary["policies"] = results
    summary["load_after"] = os.getloadavg()[0]
    summary["all_targets_met"] = all(r["meets_target"] is not False for r in results.values())
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
