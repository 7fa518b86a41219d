"""Long soak of the embedded cluster: N minutes of pod churn with periodic faults (not in CI).

The same churn, faults, audits and verdict as the suite's three-minute soak (gpufrac.local.soak), for
as long as asked: a pod created every ``--interval`` seconds (six shapes in turn, one of which fits no
GPU), the oldest deleted once ``--live`` exist, and every ``--fault-every`` seconds the next fault in
turn: SIGKILL of the scheduler, SIGKILL of a node agent (the nodes in turn), SIGKILL of the webhook,
SIGSTOP of the control plane (API server and etcd) for ``--pause`` seconds then SIGCONT. The periods
are the soak's short ones (lease renewed every second, the kubelet's watch deadline every minute, ...);
the API server's bookmarks come about once a minute per watch, in real time.

Reported: pods created, deleted and how each deleted pod had ended (placed, explained, undecided), API
errors by kind (faults cause some on purpose), the audits run and every double-booking they found
(must be zero), unexpected exits, the final verdict, and the resident memory of every process (each
component, the control plane, each NRI runtime, and this process, which runs the simulated kubelet)
with its growth per hour (least-squares slope over the samples of its current process, after a
warm-up; a restarted component starts a new series).

    .venv/bin/python bench/soak.py                       # 30 minutes
    .venv/bin/python bench/soak.py --minutes 5 --fault-every 30

The last line is a one-line JSON summary; the exit status is 0 when the verdict holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.simnodes import NodeShape
from gpufrac.local.soak import (
    Auditor,
    Churn,
    Fault,
    Faults,
    Injected,
    RssSampler,
    Step,
    background,
    run_schedule,
    soak_timings,
    verdict,
)

FAULT_ORDER = (Fault.KILL_SCHEDULER, Fault.KILL_NODE_AGENT, Fault.KILL_WEBHOOK, Fault.PAUSE_APISERVER)


def schedule(*, minutes: float, every_s: float) -> list[Step]:
    """A fault every ``every_s`` from ``every_s`` on, the kinds in turn, none in the last ``every_s``."""
    count = max(0, int(minutes * 60 // every_s) - 1)
    return [Step(at_s=every_s * (i + 1), fault=FAULT_ORDER[i % len(FAULT_ORDER)]) for i in range(count)]


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = ClusterShape(nodes=args.nodes, node=NodeShape(gpus=args.gpus, model=args.model))
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="gpufrac-soak-"))  # kept: logs to read after
    cluster = LocalCluster(shape=shape, work_dir=work_dir, timings=soak_timings(), progress=say)
    async with cluster:
        churn = Churn(cluster, interval_s=args.interval, live=args.live)
        await churn.prepare()
        faults = Faults(cluster, pause_s=args.pause)
        auditor = Auditor(cluster, every_s=args.audit_every)
        sampler = RssSampler(cluster, every_s=args.rss_every)
        steps = schedule(minutes=args.minutes, every_s=args.fault_every)
        say(f"soak: {args.minutes} min, {len(steps)} faults, logs in {cluster.logs}")

        def injected(i: Injected) -> None:
            say(f"fault at {i.at_s:.0f}s: {i.fault} ({i.target}); created {churn.counts.created} so far")

        started = time.monotonic()
        async with background(churn.run(), auditor.run(), sampler.run()):
            await run_schedule(faults, steps, on_fault=injected)
            await asyncio.sleep(max(0.0, started + args.minutes * 60 - time.monotonic()))
        churned_s = time.monotonic() - started
        sampler.sample()
        result = await verdict(cluster, faults=faults)
        watch_restarts = cluster.kubelet.informer.watch_restarts if cluster.kubelet else 0
        restarts = {name: c.restarts for name, c in cluster.components.items()}
        logs = str(cluster.logs)

    counts = churn.counts
    memory = sampler.summary(skip_s=args.warmup)
    for name, figures in memory.items():
        say(f"rss {name}: {figures}")
    for failure in result.failures:
        say(f"FAILED: {failure}")
    return {
        "bench": "soak",
        "minutes": round(churned_s / 60, 1),
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "pods_created": counts.created,
        "pods_deleted": counts.deleted,
        "deleted_pods_outcome": dict(counts.outcomes),
        "api_errors": dict(counts.errors),
        "faults": dict(sorted(faults.kills().items()))
        | {"controlplane-pauses": sum(1 for i in faults.injected if i.fault is Fault.PAUSE_APISERVER)},
        "restarts": restarts,
        "unexpected_exits": result.unexpected_exits,
        "kubelet_failures": len(cluster.kubelet_failures),
        "kubelet_watch_restarts": watch_restarts,
        "audits": auditor.audits,
        "double_bookings": len(auditor.problems),
        "final_pods": dict(result.pods),
        "verdict": "ok" if result.ok else "failed",
        "failures": result.failures,
        "memory": memory,
        "logs": logs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--model", default="H100-80GB")
    parser.add_argument("--interval", type=float, default=1.0, help="Seconds between pod creations.")
    parser.add_argument("--live", type=int, default=12, help="Pods kept before the oldest is deleted.")
    parser.add_argument("--fault-every", type=float, default=60.0, help="Seconds between faults.")
    parser.add_argument("--pause", type=float, default=4.0, help="Seconds the control plane is stopped.")
    parser.add_argument("--audit-every", type=float, default=15.0)
    parser.add_argument("--rss-every", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=120.0, help="RSS samples ignored after a start.")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="Cluster state and logs (default: a new, kept temp dir)."
    )
    args = parser.parse_args()
    for name in ("minutes", "interval", "fault_every", "pause", "audit_every", "rss_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = asyncio.run(run(args))
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
