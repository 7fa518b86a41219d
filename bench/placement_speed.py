"""Placement speed on the 1,213-node openb cluster, one process, against an uncached baseline.

Replays one seed of the default trace (the published protocol: ~10,800 pods, 1.3x arrival) per policy
and reports engine placements per second (placed pods / engine time; failed attempts count in the time).
Baseline in the same run: the same engine with its per-node caches defeated (the per-kind results and
FGD's kept node terms), i.e. every node is filtered and scored for every pod (vectorised, but not
incremental), on the first ``--baseline-pods`` pods. The ratio shows what the incremental design
buys; load average is printed because the machine is shared.

With pod rules (issue #19), in the same run: the replay again with ``--rules`` (default 25%) of the pods
belonging to one of ``--apps`` deployments, as inference replicas do: half of those carry a required pod
anti-affinity on the hostname against their own replicas, half a topology spread constraint (maxSkew 1,
DoNotSchedule) over eight zones; every node gets a hostname and a zone label. Those rules are evaluated
per pod (``gpufrac.placement.topology``), outside the per-kind cache, so this is what they cost.

Targets: binpack >= 5,000 placements/s, fgd >= 1,000 placements/s, fgd-room (the default) >= 1,500;
with pod rules, fgd-class policies (fgd, fgd-align, fgd-plus, fgd-room) >= 1,500 placements/s.

Usage: .venv/bin/python bench/placement_speed.py [--policies binpack,fgd,fgd-align,fgd-room] [--seed 42]
       [--repeat 3] [--baseline-pods 1500] [--rules 0.25] [--apps 200] [--clock wall|cpu]
Prints a line per policy, then a one-line JSON summary last; its ``decisions_sha256`` per policy digests
every decision of the first timed replay (node and devices, in order): equal digests before and after a
change mean it placed every pod alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpufrac.placement.decision import Placement  # noqa: E402
from gpufrac.placement.engine import Engine  # noqa: E402
from gpufrac.placement.fragmentation import Fgd  # noqa: E402
from gpufrac.placement.model import NodeSpec, PendingPod  # noqa: E402
from gpufrac.placement.pod_constraints import (  # noqa: E402
    LabelSelector,
    PodAffinityTerm,
    PodConstraints,
    SpreadConstraint,
    WhenUnsatisfiable,
)
from gpufrac.sim.trace import load_nodes, load_pods, node_file, pod_file  # noqa: E402
from gpufrac.sim.workload import PodFactory, capacity_milli, inflate, node_spec, shape_counts  # noqa: E402

TARGETS = {"binpack": 5000.0, "fgd": 1000.0, "fgd-room": 1500.0}
RULES_TARGETS = {"fgd": 1500.0, "fgd-align": 1500.0, "fgd-plus": 1500.0, "fgd-room": 1500.0}
HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
ZONES = 8


def with_topology(spec: NodeSpec, i: int) -> NodeSpec:
    return dataclasses.replace(spec, labels={**spec.labels, HOST: spec.name, ZONE: f"zone-{i % ZONES}"})


def with_rules(pods: list[PendingPod], *, share: float, apps: int, seed: int) -> list[PendingPod]:
    """``share`` of the pods as replicas of ``apps`` deployments: anti-affine or spread (see module)."""
    rng = random.Random(seed)
    rules = []
    for a in range(apps):
        selector = LabelSelector(match_labels=(("app", f"app-{a}"),))
        if a % 2:
            term = PodAffinityTerm(HOST, selector, frozenset({"default"}))
            rules.append(PodConstraints(required_anti_affinity=(term,)))
        else:
            spread = SpreadConstraint(1, ZONE, WhenUnsatisfiable.DO_NOT_SCHEDULE, selector)
            rules.append(PodConstraints(spread=(spread,)))
    out = []
    for pod in pods:
        if rng.random() < share:
            a = rng.randrange(apps)
            pod = dataclasses.replace(
                pod, namespace="default", labels={"app": f"app-{a}"}, constraints=rules[a]
            )
        out.append(pod)
    return out


def defeat_caches(engine: Engine) -> None:
    """Every node is filtered and scored anew: the per-kind results and FGD's kept node terms dropped."""
    for kind in engine._kinds.values():
        kind.version[:] = -1
        for scorer, _ in kind.policy.scorers:
            if isinstance(scorer, Fgd):
                scorer.forget()


def run(
    policy: str,
    nodes,
    pods,
    seed: int,
    *,
    limit: int | None = None,
    cached: bool = True,
    rules: float = 0.0,
    apps: int = 200,
    clock=time.perf_counter,
    digest: hashlib._Hash | None = None,
) -> float:
    """Placements per second; ``digest``, when given, is fed every decision (node and devices, in order),
    outside the timed loop, so a change meant only to be faster can show it placed every pod alike."""
    digest = hashlib.sha256() if digest is None else digest
    engine = Engine(policy=policy, seed=seed, typical=shape_counts(pods))
    for i, n in enumerate(nodes):
        engine.add_node(with_topology(node_spec(n), i) if rules else node_spec(n))
    sequence = inflate(pods, seed=seed, capacity=capacity_milli(nodes))[:limit]
    make = PodFactory()
    submitted = [make(p, i) for i, p in enumerate(sequence)]
    if rules:
        submitted = with_rules(submitted, share=rules, apps=apps, seed=seed)
    placed = 0
    decisions = []
    start = clock()
    for pod in submitted:
        if not cached:
            defeat_caches(engine)
        decision = engine.place(pod)
        decisions.append(decision)
        placed += isinstance(decision, Placement)
    rate = placed / (clock() - start)
    digest.update(repr([d.node if isinstance(d, Placement) else None for d in decisions]).encode())
    digest.update(repr([d.containers for d in decisions if isinstance(d, Placement)]).encode())
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="binpack,fgd,fgd-align,fgd-room")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--repeat", type=int, default=3, help="best of N (the machine is shared)")
    parser.add_argument("--baseline-pods", type=int, default=1500)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--rules", type=float, default=0.25, help="share of pods with pod rules (0: skip)")
    parser.add_argument("--apps", type=int, default=200, help="deployments the rule-carrying pods form")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time, which other tenants of a shared machine move less",
    )
    args = parser.parse_args()
    nodes = load_nodes(node_file(None, args.data_dir))
    pods = load_pods(pod_file("default", args.data_dir))
    summary: dict[str, object] = {
        "bench": "placement_speed",
        "nodes": len(nodes),
        "load_before": os.getloadavg()[0],
    }
    results = {}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    summary["clock"] = args.clock
    for policy in args.policies.split(","):
        digest = hashlib.sha256()
        best = run(policy, nodes, pods, args.seed, clock=clock, digest=digest)
        best = max(
            [best] + [run(policy, nodes, pods, args.seed, clock=clock) for _ in range(args.repeat - 1)]
        )
        baseline = run(policy, nodes, pods, args.seed, limit=args.baseline_pods, cached=False, clock=clock)
        target = TARGETS.get(policy)
        results[policy] = {
            "placements_per_s": round(best, 1),
            "uncached_baseline_per_s": round(baseline, 1),
            "speedup_vs_uncached": round(best / baseline, 2),
            "decisions_sha256": digest.hexdigest()[:16],
            "target": target,
            "meets_target": None if target is None else best >= target,
        }
        ratio = best / baseline
        line = f"{policy:10s} {best:8.0f} placements/s  (uncached baseline {baseline:6.0f}/s, x{ratio:.1f})"
        if args.rules:
            ruled = max(
                run(policy, nodes, pods, args.seed, rules=args.rules, apps=args.apps, clock=clock)
                for _ in range(args.repeat)
            )
            rules_target = RULES_TARGETS.get(policy)
            results[policy] |= {
                "with_rules_per_s": round(ruled, 1),
                "with_rules_vs_plain": round(ruled / best, 2),
                "rules_share": args.rules,
                "rules_target": rules_target,
                "meets_rules_target": None if rules_target is None else ruled >= rules_target,
            }
            line += f"; with pod rules on {args.rules:.0%} of pods {ruled:8.0f}/s"
        print(line)
        sys.stdout.flush()
    summary["policies"] = results
    summary["load_after"] = os.getloadavg()[0]
    summary["all_targets_met"] = all(
        r["meets_target"] is not False and r.get("meets_rules_target") is not False for r in results.values()
    )
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
