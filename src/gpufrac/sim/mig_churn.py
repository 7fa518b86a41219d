"""MIG beside fractions with departures: the three variants of ``mig_replay`` on the trace's own clock, so
re-partitions can be counted per hour (issue #40; docs/benchmarks.md, "MIG beside fractions").

Pods arrive at their ``creation_time`` (divided by ``load``) and leave ``deletion_time - creation_time``
seconds after they start, as in ``churn``; a pod that fits nowhere waits, and waiting pods are tried
again, oldest first, after every departure (at most ``retry_limit`` per departure). No queues, no reclaim,
no moves: only placement and, in ``dynamic``, layout changes (a waiting pod is handed to the planner
each time it is tried, so an idle MIG GPU goes back to fractions once a fraction pod waits for it).
An isolation pod its variant can never serve (a profile the static layout lacks, or more memory than the
largest slice) is counted and not retried. SIMULATED like ``mig_replay``: changes are instantaneous.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gpufrac.mig.geometry import smallest_fitting
from gpufrac.mig.profiles import MIG_MODELS
from gpufrac.placement.decision import Placement
from gpufrac.placement.mig_layouts import RecentMigAsks
from gpufrac.placement.model import GpuMode

from .mig_replay import mig_cluster, repartition
from .mig_workload import BALANCED, MIG_MODEL, isolated, isolation_mib
from .trace import TraceNode, TracePod
from .workload import PodFactory


@dataclass
class MigChurnRun:
    variant: str
    policy: str
    seed: int
    load: float
    nodes: int
    static_mig_gpus: int
    hours: float
    pods: int
    started: int
    never_started: int
    isolation_pods: int
    isolation_started: int
    isolation_unservable: int
    pending_p50_s: float
    pending_p99_s: float
    repartitions: int
    to_mig: int
    to_fractions: int
    repartitions_per_hour: float
    mig_gpus_end: int

    def summary(self) -> dict[str, Any]:
        return asdict(self)


def mig_churn_replay(
    *,
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    variant: str,
    policy: str,
    seed: int,
    share: float,
    static_share: float | None = None,
    load: float = 1.0,
    cluster: float = 1.0,
    retry_limit: int = 64,
    fill: bool = True,
) -> MigChurnRun:
    """One variant with arrivals and departures (module docstring); ``load`` divides the arrival times,
    ``cluster`` keeps that fraction of the nodes (the same seeded sample as ``churn``'s); ``fill`` as in
    ``mig_replay``."""
    if load <= 0:
        raise ValueError(f"--churn-load {load}: arrivals must be sped up by a positive factor")
    if not 0 < cluster <= 1:
        raise ValueError(f"--churn-cluster {cluster}: the fraction of nodes kept must be in (0, 1]")
    if cluster < 1:
        rng = np.random.default_rng(seed)
        keep = max(1, round(len(nodes) * cluster))
        nodes = [nodes[i] for i in sorted(rng.choice(len(nodes), size=keep, replace=False).tolist())]
    timed = [p for p in pods if p.created is not None and p.deleted is not None]
    if not timed:
        raise ValueError("the pod list has no creation_time/deletion_time columns: no churn to replay")
    engine, specs, workload, partitioned = mig_cluster(
        nodes, timed, variant, policy, seed, share, static_share
    )
    model = MIG_MODELS[MIG_MODEL]
    make = PodFactory()
    pending = [make(tp, i) for i, tp in enumerate(workload)]
    iso = [isolated(tp, share) for tp in timed]

    def servable(i: int) -> bool:
        if not workload[i].isolation_mib:
            return True
        profile = smallest_fitting(model, isolation_mib(workload[i]))
        return profile is not None and (variant != "static" or profile.name in BALANCED)

    ok = [servable(i) for i in range(len(timed))]
    arrive = [int(int(tp.created) / load) for tp in timed]  # type: ignore[arg-type]
    run_s = [max(0, int(tp.deleted) - int(tp.created)) for tp in timed]  # type: ignore[arg-type]
    events: list[tuple[int, int, int]] = [(arrive[i], 1, i) for i in range(len(timed)) if ok[i]]
    heapq.heapify(events)
    waiting: dict[int, None] = {}
    waits: dict[int, int] = {}
    moves = {GpuMode.MIG: 0, GpuMode.FRACTIONS: 0}
    recent = RecentMigAsks() if fill else None

    def attempt(i: int, now: int) -> bool:
        decision = engine.place(pending[i])
        if not isinstance(decision, Placement) and variant == "dynamic":
            for change in repartition(engine, specs, pending[i], recent=recent):
                moves[change.mode] = moves.get(change.mode, 0) + 1
            decision = engine.place(pending[i])
        if not isinstance(decision, Placement):
            return False
        waits[i] = now - arrive[i]
        waiting.pop(i, None)
        heapq.heappush(events, (now + run_s[i], 0, i))
        return True

    first = events[0][0] if events else 0
    last = first
    while events:
        now, kind, i = heapq.heappop(events)
        last = now
        if kind == 1:
            if not attempt(i, now):
                waiting[i] = None
            continue
        engine.forget(pending[i].uid)
        for j in list(waiting)[:retry_limit]:
            attempt(j, now)
    hours = max(1, last - first) / 3600
    done = list(waits.values())
    changes = moves[GpuMode.MIG] + moves[GpuMode.FRACTIONS]
    return MigChurnRun(
        variant=variant,
        policy=policy,
        seed=seed,
        load=load,
        nodes=len(nodes),
        static_mig_gpus=sum(len(specs[n].gpus) for n in partitioned),
        hours=round(hours, 3),
        pods=len(timed),
        started=len(done),
        never_started=len(timed) - len(done),
        isolation_pods=sum(iso),
        isolation_started=sum(1 for i in waits if iso[i]),
        isolation_unservable=sum(1 for i in range(len(timed)) if not ok[i]),
        pending_p50_s=round(float(np.percentile(done, 50)), 1) if done else float("nan"),
        pending_p99_s=round(float(np.percentile(done, 99)), 1) if done else float("nan"),
        repartitions=changes,
        to_mig=moves[GpuMode.MIG],
        to_fractions=moves[GpuMode.FRACTIONS],
        repartitions_per_hour=round(changes / hours, 3),
        mig_gpus_end=sum(g.mode is GpuMode.MIG for spec in specs.values() for g in spec.gpus),
    )
