"""Allocation quality on the openb traces: our policies against the paper's published means.

For every trace: replay each policy for every seed (the published protocol, shared/data/openb/README.md)
and report the mean allocation ratio at 100% and 130% arrival next to the paper's BestFit and FGD.
The baseline in the same run is our own ``fgd`` (the paper's algorithm re-implemented): ``fgd-align``
must beat it and the paper's FGD on every trace; ``binpack``/``fgd`` must stay within 0.5 point of the
paper's BestFit/FGD on ``default`` (faithfulness).

Usage: .venv/bin/python bench/trace_quality.py [--traces default,gpushare60]
       [--policies binpack,fgd,fgd-align] [--seeds 42-51] [--workers 2]
Prints a Markdown table, then a one-line JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpufrac.sim.experiment import by_policy, mean, parse_policies, parse_seeds, run_experiment  # noqa: E402
from gpufrac.sim.paper import PUBLISHED  # noqa: E402
from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file  # noqa: E402

PAPER = {t: (p["BestFit"][0], p["BestFit"][1], p["FGD"][0], p["FGD"][1]) for t, p in PUBLISHED.items()}
OURS = "fgd-align"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(PAPER))
    parser.add_argument("--policies", default=f"binpack,fgd,{OURS}")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    policies = parse_policies(args.policies)
    seeds = parse_seeds(args.seeds)
    nodes = load_nodes(node_file(None, args.data_dir))
    rows: dict[str, dict[str, dict[str, float]]] = {}
    started = time.perf_counter()
    print(
        "| trace | policy | @100 | @130 | paper BestFit @130 | paper FGD @130 | vs paper FGD | placements/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for trace in args.traces.split(","):
        pods = load_pods(pod_file(trace, args.data_dir))
        results = run_experiment(
            trace=trace, nodes=nodes, pods=pods, policies=policies, seeds=seeds, workers=args.workers
        )
        paper = PAPER.get(trace)
        rows[trace] = {}
        for policy, runs in by_policy(results).items():
            a100 = mean([r.alloc_100 for r in runs])
            a130 = mean([r.alloc_130 for r in runs])
            pps = mean([r.placements_per_s for r in runs])
            rows[trace][policy] = {"alloc_100": round(a100, 3), "alloc_130": round(a130, 3)}
            versus = f"{a130 - paper[3]:+.2f}" if paper else "n/a"
            bestfit = f"{paper[1]:.2f}" if paper else "n/a"
            fgd = f"{paper[3]:.2f}" if paper else "n/a"
            print(
                f"| {trace} | {policy} | {a100:.2f} | {a130:.2f} | {bestfit} | {fgd} | {versus} | {pps:.0f} |"
            )
        sys.stdout.flush()
    summary: dict[str, object] = {
        "bench": "trace_quality",
        "seeds": len(seeds),
        "seconds": 0.0,
        "traces": rows,
    }
    if OURS in policies:
        margins = {t: r[OURS]["alloc_130"] - PAPER[t][3] for t, r in rows.items() if t in PAPER}
        summary["ours_minus_paper_fgd_130"] = {t: round(m, 3) for t, m in margins.items()}
        summary["ours_beats_paper_fgd_everywhere"] = all(m > 0 for m in margins.values()) if margins else None
        if "fgd" in policies:
            summary["ours_minus_our_fgd_130"] = {
                t: round(r[OURS]["alloc_130"] - r["fgd"]["alloc_130"], 3) for t, r in rows.items()
            }
    if "default" in rows:
        d = rows["default"]
        if "binpack" in d:
            summary["binpack_minus_paper_bestfit_default_130"] = round(d["binpack"]["alloc_130"] - 93.08, 3)
        if "fgd" in d:
            summary["fgd_minus_paper_fgd_default_130"] = round(d["fgd"]["alloc_130"] - 95.39, 3)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
