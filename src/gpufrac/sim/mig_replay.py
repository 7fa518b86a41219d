"""MIG beside fractions: one workload (scenario ``mig``), three ways to serve its isolation pods, side by
side (issue #40; docs/benchmarks.md, "MIG beside fractions").

- ``static``: a share of the GPU nodes is partitioned up front into mig-parted's all-balanced layout
  (``mig_workload.BALANCED``); the rest are fraction pools. Nothing changes mode during the run.
- ``dynamic``: every GPU starts as a fraction pool. When a pod fails, the scheduler's planner
  (``gpufrac.placement.mig_layouts.plan_layouts``) gets it as a waiting pod with the idle GPUs (nothing
  booked: ``Engine.idle_gpus``) of the nodes that could take it: a MIG pod gets an idle GPU laid out for
  it, a fraction or whole-GPU pod gets an idle MIG GPU back as a fraction pool; then the pod is placed
  again. Each change fences the GPU first (``Engine.fence``: it refuses a GPU with anything booked, the
  engine's own check) and publishes the GPU's new mode with ``Engine.update_node``. SIMULATED: the node
  agent's change is instantaneous here (no NVML, no reset, no agent round trip). The planner fills the
  rest of a GPU it lays out with free slices in the mix of the MIG pods handed to it lately (the last
  64, ``RecentMigAsks``), as the scheduler does; ``fill=False`` lays out the waiting pod's slices only
  (the behaviour before the fill).
- ``fractions-only``: the isolation pods ask for the same memory as fractions; no GPU is ever MIG.

The replay is the arrival protocol of ``replay`` (the openb paper's: pods submitted one by one up to
130 % of the cluster's GPU, never deleted), with the same metrics; allocation counts what each pod asked
(``gpu_milli``), so a 7g slice for a pod that asked for 60 % counts 60 %. That replay has no clock, so
re-partitions are reported per 1,000 submitted pods; ``mig_churn`` replays the same variants with
departures on the trace's clock and counts them per hour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from gpufrac.mig.geometry import Slice, smallest_fitting
from gpufrac.mig.profiles import MIG_MODELS
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.mig_layouts import (
    FractionWait,
    IdleGpu,
    LayoutChange,
    MigWait,
    RecentMigAsks,
    plan_layouts,
)
from gpufrac.placement.model import GpuMode, NodeSpec, PendingPod

from .metrics import allocation_at
from .mig_workload import (
    MIG_GPU_MIB,
    MIG_MODEL,
    balanced,
    fractions_gpu,
    isolated,
    isolation_mib,
    isolation_share_of_demand,
    mig_gpu,
    mig_nodes,
    mig_workload,
    static_nodes,
)
from .trace import TraceNode, TracePod
from .workload import PodFactory, capacity_milli, inflate, node_spec, shape_counts

MIG_VARIANTS = ("static", "dynamic", "fractions-only")

#: Called before each layout change is applied, with the engine as it is then (tests check idleness).
ChangeHook = Callable[[Engine, LayoutChange], None]
#: Called for each submitted pod with its decision.
PlacedHook = Callable[[TracePod, PendingPod, object], None]


@dataclass
class MigRun:
    variant: str
    policy: str
    seed: int
    model: str
    gpu_mib: int
    gpus: int
    static_mig_gpus: int
    pods: int
    placed: int
    failed: int
    alloc_100: float
    alloc_130: float
    gpus_used: int
    mig_gpus_end: int
    isolation_pods: int
    isolation_placed: int
    isolation_failed: int
    isolation_on_slices: int
    isolation_fit_no_slice: int
    slice_mib_booked: int
    isolation_mib_placed: int
    repartitions: int
    to_mig: int
    to_fractions: int
    seconds: float

    @property
    def repartitions_per_1000_pods(self) -> float:
        return 1000.0 * self.repartitions / self.pods if self.pods else 0.0

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["repartitions_per_1000_pods"] = round(self.repartitions_per_1000_pods, 2)
        out["repartitions_per_hour"] = None  # the arrival replay has no trace time (module docstring)
        return out


def mig_replay(
    *,
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    variant: str,
    policy: str,
    seed: int,
    share: float,
    static_share: float | None = None,
    on_change: ChangeHook | None = None,
    on_pod: PlacedHook | None = None,
    fill: bool = True,
) -> MigRun:
    """One variant's replay of ``pods`` (the original list) on ``nodes`` (module docstring).

    ``static_share`` is the share of GPU nodes the static variant partitions (default: the isolation
    pods' share of the list's requested GPU); ``fill`` False plans without the fill (module docstring).
    """
    engine, specs, workload, partitioned = mig_cluster(
        nodes, pods, variant, policy, seed, share, static_share
    )
    capacity = capacity_milli(mig_nodes(nodes))
    sequence = inflate(workload, seed=seed, capacity=capacity)
    model = MIG_MODELS[MIG_MODEL]
    make = PodFactory()
    arrived = np.zeros(len(sequence))
    allocated = np.zeros(len(sequence))
    arrived_milli = allocated_milli = 0
    counts = dict.fromkeys(
        ("placed", "iso", "iso_placed", "on_slices", "no_slice", "slice_mib", "iso_mib", "to_mig", "to_frac"),
        0,
    )
    recent = RecentMigAsks() if fill else None
    start = time.perf_counter()
    for i, tp in enumerate(sequence):
        pod = make(tp, i)
        decision = engine.place(pod)
        if variant == "dynamic" and not isinstance(decision, Placement):
            for change in repartition(engine, specs, pod, on_change, recent=recent):
                counts["to_mig" if change.mode is GpuMode.MIG else "to_frac"] += 1
            decision = engine.place(pod)
        if on_pod is not None:
            on_pod(tp, pod, decision)
        arrived_milli += tp.gpu_total_milli
        iso = isolated(tp, share)
        if iso:
            counts["iso"] += 1
            if smallest_fitting(model, isolation_mib(tp)) is None:
                counts["no_slice"] += 1
        if isinstance(decision, Placement):
            counts["placed"] += 1
            allocated_milli += tp.gpu_total_milli
            if iso:
                counts["iso_placed"] += 1
                counts["iso_mib"] += isolation_mib(tp) * tp.num_gpu
                if all(c.mig for c in decision.containers):
                    counts["on_slices"] += 1
                    counts["slice_mib"] += sum(d.request_mib for c in decision.containers for d in c.devices)
        arrived[i] = 100.0 * arrived_milli / capacity
        allocated[i] = 100.0 * allocated_milli / capacity
    seconds = time.perf_counter() - start
    uuids = [g.uuid for spec in specs.values() for g in spec.gpus]
    return MigRun(
        variant=variant,
        policy=policy,
        seed=seed,
        model=MIG_MODEL,
        gpu_mib=MIG_GPU_MIB,
        gpus=len(uuids),
        static_mig_gpus=sum(len(specs[n].gpus) for n in partitioned),
        pods=len(sequence),
        placed=counts["placed"],
        failed=len(sequence) - counts["placed"],
        alloc_100=allocation_at(arrived, allocated, 100),
        alloc_130=allocation_at(arrived, allocated, 130),
        gpus_used=sum(not engine.gpu_idle(u) for u in uuids),
        mig_gpus_end=sum(g.mode is GpuMode.MIG for spec in specs.values() for g in spec.gpus),
        isolation_pods=counts["iso"],
        isolation_placed=counts["iso_placed"],
        isolation_failed=counts["iso"] - counts["iso_placed"],
        isolation_on_slices=counts["on_slices"],
        isolation_fit_no_slice=counts["no_slice"],
        slice_mib_booked=counts["slice_mib"],
        isolation_mib_placed=counts["iso_mib"],
        repartitions=counts["to_mig"] + counts["to_frac"],
        to_mig=counts["to_mig"],
        to_fractions=counts["to_frac"],
        seconds=round(seconds, 2),
    )


def mig_cluster(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    variant: str,
    policy: str,
    seed: int,
    share: float,
    static_share: float | None,
) -> tuple[Engine, dict[str, NodeSpec], list[TracePod], set[str]]:
    """The engine with the variant's cluster, the node specs as published, the variant's pods and the
    nodes the static variant partitioned."""
    if variant not in MIG_VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {', '.join(MIG_VARIANTS)}")
    cluster = mig_nodes(nodes)
    workload = mig_workload(pods, share, as_mig=variant != "fractions-only")
    if static_share is None:
        static_share = isolation_share_of_demand(pods, share)
    if not 0 <= static_share <= 1:
        raise ValueError(f"--mig-static-share {static_share}: the share of GPU nodes must be between 0 and 1")
    partitioned = static_nodes(cluster, static_share) if variant == "static" else set()
    prior = shape_counts([p for p in workload if not p.isolation_mib])  # MIG pods use no fraction pool
    engine = Engine(policy=policy, seed=seed, typical=prior)
    specs: dict[str, NodeSpec] = {}
    for node in cluster:
        spec = node_spec(node, {MIG_MODEL: MIG_GPU_MIB})
        specs[node.name] = balanced(spec) if node.name in partitioned else spec
        engine.add_node(specs[node.name])
    return engine, specs, workload, partitioned


def repartition(
    engine: Engine,
    specs: dict[str, NodeSpec],
    pod: PendingPod,
    on_change: ChangeHook | None = None,
    *,
    recent: RecentMigAsks | None = None,
) -> list[LayoutChange]:
    """Plan and apply (at once: SIMULATED) the layout changes that would serve waiting ``pod``; with
    ``recent`` (the MIG pods planned lately, updated here) a GPU laid out is filled, without it not."""
    changes = _plan(engine, specs, pod, recent)
    for change in changes:
        if on_change is not None:
            on_change(engine, change)
        _apply(engine, specs, change)
    return changes


def _plan(
    engine: Engine, specs: dict[str, NodeSpec], pod: PendingPod, recent: RecentMigAsks | None
) -> list[LayoutChange]:
    """The planner's changes for one waiting pod: its wait, and the idle GPUs of nodes it could use."""
    request = pod.gpu.containers[0] if pod.gpu.containers else None
    if request is None:
        return []
    st = engine.state
    if request.mig is None and not st.partitioned:
        return []  # no GPU in another mode: nothing could go back to fractions
    rows = [
        n
        for n in engine.static_fits(pod).tolist()
        if st.cpu_free[n] >= pod.cpu_milli and st.mem_free[n] >= pod.memory_bytes
    ]
    names = frozenset(spec.name for n in rows if (spec := st.nodes[n]) is not None)
    mig: list[MigWait] = []
    fractions: list[FractionWait] = []
    if request.mig is not None:
        profile = smallest_fitting(MIG_MODELS[MIG_MODEL], request.mig.min_mib or 0)
        if profile is None:
            return []
        mig.append(MigWait(pod.uid, {MIG_MODEL: (profile.name,) * request.mig.count}, names))
    else:

        def mib(gpu_mib: int) -> int:
            return gpu_mib if request.exclusive else request.request_mib(gpu_mib)

        fractions.append(FractionWait(pod.uid, mib, request.device_count, names))
    idle = []
    for name in sorted(names):
        by_uuid = {g.uuid: g for g in specs[name].gpus}
        for uuid, model, mode in engine.idle_gpus(name):
            if not mig and mode is GpuMode.FRACTIONS:
                continue
            g = by_uuid[uuid]
            slices = tuple(Slice(s.profile, s.start) for s in g.mig)
            idle.append(IdleGpu(name, uuid, g.index, model, g.memory_mib, mode, slices))
    if recent is None:
        return plan_layouts(mig, fractions, idle, fill_rest=False)
    changes = plan_layouts(mig, fractions, idle, recent=recent.waits())
    recent.add(mig)
    return changes


def _apply(engine: Engine, specs: dict[str, NodeSpec], change: LayoutChange) -> None:
    """Fence the GPU (refused by the engine if anything is booked on it), publish it in its new mode."""
    engine.fence(change.uuid)
    spec = specs[change.node]
    gpus = tuple(
        (mig_gpu(g, change.slices) if change.mode is GpuMode.MIG else fractions_gpu(g))
        if g.uuid == change.uuid
        else g
        for g in spec.gpus
    )
    specs[change.node] = replace(spec, gpus=gpus)
    dropped = engine.update_node(specs[change.node])
    engine.unfence(change.uuid)
    if dropped:
        raise AssertionError(f"re-partitioning {change.uuid} dropped pods {dropped}")


@dataclass(frozen=True, slots=True)
class _Job:
    variant: str
    seed: int


_INPUTS: dict[str, Any] = {}


def _init(inputs: dict[str, Any]) -> None:
    _INPUTS.update(inputs)


def _run(job: _Job) -> MigRun:
    return mig_replay(variant=job.variant, seed=job.seed, **_INPUTS)


def run_mig(
    *,
    nodes: list[TraceNode],
    pods: list[TracePod],
    policy: str,
    seeds: Sequence[int],
    share: float,
    static_share: float | None = None,
    workers: int = 1,
    progress: Callable[[MigRun], None] | None = None,
) -> list[MigRun]:
    """Every (variant, seed), in that fixed order, in ``workers`` processes."""
    jobs = [_Job(v, s) for v in MIG_VARIANTS for s in seeds]
    inputs = {"nodes": nodes, "pods": pods, "policy": policy, "share": share, "static_share": static_share}
    results: dict[_Job, MigRun] = {}
    if workers <= 1:
        _init(inputs)
        for job in jobs:
            results[job] = _run(job)
            if progress:
                progress(results[job])
    else:
        with ProcessPoolExecutor(max_workers=workers, initializer=_init, initargs=(inputs,)) as pool:
            for job, result in zip(jobs, pool.map(_run, jobs), strict=True):
                results[job] = result
                if progress:
                    progress(result)
    return [results[j] for j in jobs]
