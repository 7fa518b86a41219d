"""Many replays: every (policy, seed) of one trace, in worker processes, and their means.

Replays are independent and CPU-bound, so ``workers > 1`` runs them in a process pool (a 2-core machine
halves the wall time). Results are returned in a fixed (policy, seed) order whatever the completion
order, so output is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from gpufrac.placement.policies import POLICIES

from .replay import BOUND, RunResult, offline_bound, replay
from .scenarios import prepare
from .trace import TraceNode, TracePod

DEFAULT_POLICIES = ("binpack", "spread", "kai", "fgd", "fgd-align", "fgd-plus", "fgd-room")


@dataclass(frozen=True, slots=True)
class Job:
    trace: str
    policy: str
    seed: int


def parse_seeds(text: str) -> list[int]:
    """``42-51``, ``42,45,47`` or ``42``."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            seeds.extend(range(lo, hi + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def parse_policies(text: str) -> list[str]:
    if text == "all":
        return list(DEFAULT_POLICIES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}, all")
    return names


@dataclass(frozen=True, slots=True)
class _Inputs:
    trace: str
    nodes: list[TraceNode]
    pods: list[TracePod]
    online: bool
    window: int = 1


_WORKER: _Inputs | None = None


def _init(inputs: _Inputs) -> None:
    global _WORKER
    _WORKER = inputs


def _run(job: Job) -> RunResult:
    assert _WORKER is not None
    w = _WORKER
    if job.policy == BOUND:
        return offline_bound(trace=w.trace, nodes=w.nodes, pods=w.pods, seed=job.seed)
    return replay(
        trace=w.trace,
        nodes=w.nodes,
        pods=w.pods,
        policy=job.policy,
        seed=job.seed,
        online=w.online,
        window=w.window,
    )


def run_experiment(
    *,
    trace: str,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policies: Sequence[str],
    seeds: Sequence[int],
    workers: int = 1,
    scenario: str = "plain",
    online: bool = False,
    window: int = 1,
    bound: bool = False,
    progress: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Every (policy, seed) replay of ``pods`` (under ``scenario``) on ``nodes``, in a fixed order;
    with ``bound``, the offline reference of every seed after them (``replay.offline_bound``)."""
    jobs = [Job(trace, p, s) for p in [*policies, *([BOUND] if bound else [])] for s in seeds]
    inputs = _Inputs(trace, nodes, prepare(pods, scenario), online, window)
    results: dict[Job, RunResult] = {}
    if workers <= 1:
        _init(inputs)
        for job in jobs:
            results[job] = _run(job)
            if progress:
                progress(results[job])
    else:
        with ProcessPoolExecutor(max_workers=workers, initializer=_init, initargs=(inputs,)) as pool:
            futures = {pool.submit(_run, job): job for job in jobs}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if progress:
                    progress(results[futures[future]])
    return [results[j] for j in jobs]


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def by_policy(results: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    out: dict[str, list[RunResult]] = {}
    for r in results:
        out.setdefault(r.policy, []).append(r)
    return out
