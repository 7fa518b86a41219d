"""A replay with departures and queues: pending time, preemptions and moves, with and without reclaim
and consolidation.

The paper's protocol (``replay``) only submits pods until the cluster is full. Here pods arrive at
their ``creation_time`` and leave ``deletion_time - creation_time`` seconds after they start, so the
cluster churns. Tenants come from the trace's own data: each QoS class of the pod list (``LS``,
``BE``, ``Burstable``, ...) is a queue, and a queue deserves the share of the cluster's GPU memory that
its pods' GPU-time is of the whole trace's (GPU thousandths x seconds), so no share is invented.

A pod that no node of the replayed cluster could hold even empty (more GPUs, GPU memory, host CPU or
host memory than any node has, or a GPU model none has) is not replayed: it would wait forever under
any rule, and as pending demand it would raise its queue's fair share by a claim nothing can serve, so
the queue would look starved and far below its share. This happens when ``cluster`` samples a few
nodes of a trace whose cluster could hold the pod: at ``cluster=0.01`` of the default trace, LS's
eight-GPU pods asking for 120 cores and 640,000 MiB of host memory fit none of the 12 sampled nodes.
They used to be replayed (only a GPU model no node has kept a pod out of the starved time): they stayed
pending as demand, and most of LS's "starved" time and of its gap to its fair share were theirs, not
reclaim's (docs/benchmarks.md, #36). Such pods are counted per queue (``QueueResult.unfit``); the
deserved shares still come from the whole trace. The check is the engine's own:
``preemption.simulate`` on the empty cluster, once per pod shape.

A pod that fits nowhere waits; pending pods are tried again, oldest first, after every departure (at
most ``retry_limit`` attempts per departure, so a long queue does not make the replay quadratic). With
``reclaim`` a pod that fits nowhere first asks ``gpufrac.placement.preemption`` for victims from queues
above their share (the scheduler's rules); a victim goes back to pending with the running time it had
left, as a controller would recreate it. Pending time is a pod's first start minus its creation time,
per queue; a victim's second wait counts as a preemption of its queue, not as pending time.

With ``consolidation`` a pod that still fits nowhere asks ``gpufrac.placement.consolidation`` for moves
(the scheduler's rules and its bound: at most ``max_moves_per_minute``, a token bucket on trace time).
The trace says nothing about which pods a controller would recreate, so movability is a stated,
seeded share of the pods (``movable_share``, drawn once per pod from ``seed``; the same pods are movable
in every run of one seed). A plan is applied at once: the moved pods leave, the pod starts, each moved
pod starts again on the new home the plan found for it and keeps its departure time (a restart's own
start-up time is not modelled; the simulator has no containers).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpufrac.placement.consolidation import Consolidation, MoveBudget, plan_consolidation
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import Queue, QueueResource
from gpufrac.placement.preemption import Kind, find_victims, simulate
from gpufrac.placement.queue_shares import Amount, QueueAmount, QueueShares, request_amount
from gpufrac.placement.usage_history import ALL, OVER_QUOTA, UsageHistory, held

from .fairness import FairnessMeter
from .trace import TraceNode, TracePod
from .workload import PodFactory, node_spec, shape_counts

NO_QOS = "none"
TIMELINE_POINTS = 400
#: Reclaim rules: judged against each queue's fair share, then its deserved quota (KAI's two strategies,
#: since #36), or against the static deserved quota alone (the rule before #36).
FAIR_SHARE_RULE = "fair-share"
DESERVED_RULE = "deserved"
#: The fair-share rule with time-based fair share (``TIME_K``, half-life ``TIME_HALF_LIFE_S``), counting
#: the use above each queue's deserved quota (the scheduler's default) or all use (KAI's rule).
TIME_RULE = "fair-share+time"
TIME_ALL_RULE = "fair-share+time-all"
RECLAIM_RULES = (FAIR_SHARE_RULE, DESERVED_RULE, TIME_RULE, TIME_ALL_RULE)
TIME_K = 0.5
TIME_HALF_LIFE_S = 6 * 3600.0
#: A reclaim's victims count as wasted when the pod they were evicted for did not start, or was itself
#: evicted before it had run this long (seconds of trace time): their room served it less than this.
WASTE_WINDOW_S = 600


@dataclass
class QueueResult:
    queue: str
    deserved_share: float
    pods: int
    started: int
    never_started: int
    pending_p50_s: float
    pending_p99_s: float
    preempted: int
    moved: int = 0
    fair_ratio_mean: float = float("nan")
    """Allocated / fair share, time-weighted over the time its fair share was above zero
    (``gpufrac.sim.fairness``); p10 and p90 likewise."""
    fair_ratio_p10: float = float("nan")
    fair_ratio_p90: float = float("nan")
    starved_s: float = 0.0
    """Seconds it had a pending pod that would have fitted within its fair share."""
    unfit: int = 0
    """Pods left out of the replay: no node of the replayed cluster could hold them even empty (module
    docstring); not in ``pods``."""


@dataclass
class ChurnResult:
    policy: str
    reclaim: bool
    load: float
    nodes: int
    pods: int
    started: int
    preemptions: int
    pending_p50_s: float
    pending_p99_s: float
    consolidation: bool = False
    moves: int = 0
    """Pods moved by consolidation (0 without it)."""
    movable_share: float = 0.0
    queues: list[QueueResult] = field(default_factory=list)
    timeline: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(seconds, queue -> share of the cluster's GPU memory its running pods hold), thinned to about
    ``TIMELINE_POINTS`` samples: allocation against fair share over time."""
    fair_timeline: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(seconds, queue -> its fair share, as a share of the cluster's GPU memory), at the same samples."""
    reclaim_rule: str = ""
    """``FAIR_SHARE_RULE`` or ``DESERVED_RULE`` with reclaim on; empty without."""
    hours: float = 0.0
    """Trace time from the first arrival to the last event, in hours."""
    evictions_per_hour: float = 0.0
    wasted_evictions: int = 0
    """Victims whose room did not serve the pod they were evicted for: it did not start, or was itself
    evicted within ``WASTE_WINDOW_S`` of starting."""
    below_share_evictions: int = 0
    """Victims whose queue held less than its fair share once the plan was carried out."""
    jain_index: float = float("nan")
    """Jain's index over queues of allocated / fair share, time-weighted (``gpufrac.sim.fairness``)."""
    unfit: int = 0
    """Pods no node of the replayed cluster could hold even empty, left out (module docstring)."""


def queue_of(pod: TracePod) -> str:
    return pod.qos or NO_QOS


def deserved_shares(pods: Sequence[TracePod]) -> dict[str, float]:
    """Each QoS class's share of the trace's GPU-time (thousandths of a GPU x seconds)."""
    use: dict[str, float] = defaultdict(float)
    for p in pods:
        assert p.created is not None and p.deleted is not None
        use[queue_of(p)] += p.gpu_total_milli * max(0, p.deleted - p.created)
    total = sum(use.values()) or 1.0
    return {q: v / total for q, v in sorted(use.items())}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def churn_replay(
    *,
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    policy: str,
    seed: int,
    reclaim: bool,
    gpu_mib: dict[str, int] | None = None,
    retry_limit: int = 64,
    load: float = 1.0,
    cluster: float = 1.0,
    consolidation: bool = False,
    movable_share: float = 0.5,
    max_moves_per_minute: int = 4,
    reclaim_rule: str = FAIR_SHARE_RULE,
) -> ChurnResult:
    """Replay ``pods`` with their arrival and departure times (see the module docstring). ``load``
    divides the arrival times (2.0: pods arrive twice as fast, each running as long as in the trace),
    the knob that makes a trace recorded on a roomier cluster contend; ``cluster`` keeps that fraction
    of the nodes (a seeded sample), the other such knob.

    ``reclaim_rule`` (with ``reclaim``): ``FAIR_SHARE_RULE`` reclaims against the queues' fair shares
    (the pending pods' demand counted), then their deserved quotas; ``DESERVED_RULE`` against deserved
    quotas alone, the rule before #36. The replay carries a plan out at once, so the other half of that
    change (victims still leaving and nominated pods counted) has nothing to act on here.
    ``TIME_RULE`` is ``FAIR_SHARE_RULE`` with time-based fair share (k ``TIME_K``, half-life
    ``TIME_HALF_LIFE_S`` of trace time, use above the deserved quota counted), the history sampled at
    every event; ``TIME_ALL_RULE`` the same counting all use."""
    if reclaim_rule not in RECLAIM_RULES:
        raise ValueError(f"reclaim_rule={reclaim_rule!r}: one of {', '.join(RECLAIM_RULES)}")
    if load <= 0:
        raise ValueError(f"load={load} must be positive")
    if not 0 <= movable_share <= 1:
        raise ValueError(f"movable_share={movable_share} must be a fraction in [0, 1]")
    if not 0 < cluster <= 1:
        raise ValueError(f"cluster={cluster} must be a fraction in (0, 1]")
    if cluster < 1:
        rng = np.random.default_rng(seed)
        keep = max(1, round(len(nodes) * cluster))
        nodes = [nodes[i] for i in sorted(rng.choice(len(nodes), size=keep, replace=False).tolist())]
    timed = [p for p in pods if p.created is not None and p.deleted is not None]
    if not timed:
        raise ValueError("the pod list has no creation_time/deletion_time columns: no churn to replay")
    shares = deserved_shares(timed)
    engine = Engine(
        policy=policy,
        seed=seed,
        typical=shape_counts(timed),
        queues=[Queue(q, deserved_share=s) for q, s in shares.items()],
    )
    for node in nodes:
        engine.add_node(node_spec(node, gpu_mib))
    make = PodFactory()
    order = sorted(range(len(timed)), key=lambda i: (timed[i].created, i))  # type: ignore[arg-type, return-value]
    # Drawn for every pod whatever ``consolidation`` says, so runs of one seed share their movable pods.
    movable = np.random.default_rng([seed, 1]).random(len(timed)) < movable_share
    pending_pods = [
        dataclasses.replace(make(timed[i], i), queue=queue_of(timed[i]), movable=bool(movable[i]))
        for i in range(len(timed))
    ]
    # Whether some node of the cluster, empty, would take the pod: the engine is still empty here.
    fits_empty: dict[tuple[object, ...], bool] = {}
    fits = []
    for p in pending_pods:
        shape = (
            p.gpu,
            p.cpu_milli,
            p.memory_bytes,
            p.namespace,
            p.queue,
            p.priority,
            p.affinity,
            p.tolerations,
            tuple(sorted((p.node_selector or {}).items())),
        )
        if shape not in fits_empty:
            fits_empty[shape] = simulate(engine, p, []) is not None
        fits.append(fits_empty[shape])
    left = {i: max(0, int(timed[i].deleted) - int(timed[i].created)) for i in range(len(timed))}  # type: ignore[arg-type]
    arrive = [int(int(p.created) / load) for p in timed]  # type: ignore[arg-type]
    events: list[tuple[int, int, int, int]] = []  # (time, kind 0=depart 1=arrive, pod, version)
    for i in order:
        if fits[i]:
            heapq.heappush(events, (arrive[i], 1, i, 0))
    version = [0] * len(timed)
    started_at: dict[int, int] = {}
    waits: dict[int, float] = {}
    waiting: dict[int, None] = {}  # insertion-ordered: oldest first
    preempted: dict[str, int] = defaultdict(int)
    moved: dict[str, int] = defaultdict(int)
    budget = MoveBudget(max_moves_per_minute, now=0.0) if consolidation else None
    largest = int(engine.state.cap.max()) if engine.state.cap.size else 0
    asks = [request_amount(p.gpu, largest) for p in pending_pods]
    pending_amount: dict[str, Amount] = {}
    pending_asks: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # queue -> MiB -> pods
    taker: dict[int, tuple[int, int]] = {}  # pod started by a reclaim -> (start, its victims)
    wasted = below_share = 0

    def starvable(i: int) -> bool:
        """Whether pod ``i`` waiting can starve its queue: it asks GPU memory (every replayed pod fits
        some node of the cluster when it is empty)."""
        return asks[i].mib > 0

    def wait(i: int) -> None:
        if i in waiting:
            return
        waiting[i] = None
        q = pending_pods[i].queue
        pending_amount[q] = pending_amount.get(q, Amount()) + asks[i]
        if starvable(i):
            pending_asks[q][asks[i].mib] += 1

    def unwait(i: int) -> None:
        if i not in waiting:
            return
        del waiting[i]
        q = pending_pods[i].queue
        pending_amount[q] = Amount(pending_amount[q].mib - asks[i].mib, pending_amount[q].gpus - asks[i].gpus)
        if starvable(i):
            count = pending_asks[q]
            count[asks[i].mib] -= 1
            if not count[asks[i].mib]:
                del count[asks[i].mib]

    def books(also: int | None = None) -> QueueShares:
        """The queues as they are, every pending pod's request (and ``also``'s) their demand."""
        demand = [QueueAmount(q, a) for q, a in pending_amount.items()]
        if also is not None and also not in waiting:
            demand.append(QueueAmount(pending_pods[also].queue, asks[also]))
        return engine.queue_shares(waiting=demand)

    def start(i: int, now: int) -> None:
        started_at[i] = now
        waits.setdefault(i, now - arrive[i])
        unwait(i)
        heapq.heappush(events, (now + left[i], 0, i, version[i]))

    def consolidate(i: int, now: int) -> bool:
        assert budget is not None
        if budget.wait_s(1, now=now) > 0:
            return False  # not one move left this minute: no plan could be carried out
        plan = plan_consolidation(engine, pending_pods[i])
        if not isinstance(plan, Consolidation) or not budget.take(len(plan.moves), now=now):
            return False
        for move in plan.moves:
            engine.forget(move.uid)
        # The plan's own placements: the state they were found in is the state they are applied to.
        engine.assume(pending_pods[i], plan.placement)
        for move in plan.moves:
            engine.assume(pending_pods[int(move.uid)], move.target)
            moved[queue_of(timed[int(move.uid)])] += 1
        start(i, now)
        return True

    def attempt(i: int, now: int) -> bool:
        decision = engine.place(pending_pods[i])
        if isinstance(decision, Placement):
            start(i, now)
            return True
        if not reclaim:
            return consolidation and consolidate(i, now)
        nonlocal wasted, below_share
        book = books(also=i)
        plan = find_victims(
            engine,
            pending_pods[i],
            kind=Kind.RECLAIM,
            shares=book.by_deserved() if reclaim_rule == DESERVED_RULE else book,
        )
        if plan is None:
            return consolidation and consolidate(i, now)
        for uid in plan.victims:
            v = int(uid)
            engine.forget(uid)
            version[v] += 1
            left[v] -= now - started_at.pop(v)
            preempted[queue_of(timed[v])] += 1
            wait(v)
            took = taker.pop(v, None)
            if took is not None and now - took[0] < WASTE_WINDOW_S:
                wasted += took[1]
        decision = engine.place(pending_pods[i])
        if not isinstance(decision, Placement):
            wasted += len(plan.victims)
            return False
        start(i, now)
        taker[i] = (now, len(plan.victims))
        after = books()
        below_share += sum(
            after.allocated(pending_pods[int(uid)].queue) < after.fair_share(pending_pods[int(uid)].queue)
            for uid in plan.victims
        )
        return True

    cluster_mib = max(1, int(engine.state.cap_total.sum()))
    timed_rule = reclaim and reclaim_rule in (TIME_RULE, TIME_ALL_RULE)
    history = UsageHistory(TIME_HALF_LIFE_S) if timed_rule else None
    counted = ALL if reclaim_rule == TIME_ALL_RULE else OVER_QUOTA
    capacity = {QueueResource.GPU_MEMORY: cluster_mib, QueueResource.GPUS: int(engine.state.gpu_count.sum())}
    span = max(1, max(arrive) + max(left.values()))
    step = max(1, span // TIMELINE_POINTS)
    timeline: list[tuple[int, dict[str, float]]] = []
    fair_timeline: list[tuple[int, dict[str, float]]] = []
    meter = FairnessMeter(list(shares))
    first = min((arrive[i] for i in range(len(timed)) if fits[i]), default=0)
    last = first

    def sample(now: int) -> None:
        """The books since the last event held until ``now``: weighed, and sampled for the timeline."""
        nonlocal last
        if history is not None:
            history.record(now, held(engine.queues, capacity, counted), capacity)
            engine.set_usage_history(history.scores(), TIME_K)
        if now <= last:
            return
        book = books()
        meter.hold(book, {q: min(c) for q, c in pending_asks.items() if c}, now - last)
        last = now
        if timeline and now - timeline[-1][0] < step:
            return
        timeline.append((now, {q: round(book.allocated(q) / cluster_mib, 5) for q in shares}))
        fair_timeline.append((now, {q: round(book.fair_share(q) / cluster_mib, 5) for q in shares}))

    while events:
        now, kind, i, ver = heapq.heappop(events)
        sample(now)
        if kind == 1:
            if not attempt(i, now):
                wait(i)
            continue
        if ver != version[i] or i not in started_at:
            continue  # the run that would have ended here was preempted
        engine.forget(pending_pods[i].uid)
        del started_at[i]
        taker.pop(i, None)
        for j in list(waiting)[:retry_limit]:
            attempt(j, now)

    queues = []
    for q, share in shares.items():
        everyone = [i for i in range(len(timed)) if queue_of(timed[i]) == q]
        members = [i for i in everyone if fits[i]]
        done = [waits[i] for i in members if i in waits]
        fair = meter.queue(q)
        queues.append(
            QueueResult(
                queue=q,
                deserved_share=round(share, 4),
                pods=len(members),
                started=len(done),
                never_started=len(members) - len(done),
                pending_p50_s=round(_percentile(done, 50), 1),
                pending_p99_s=round(_percentile(done, 99), 1),
                preempted=preempted[q],
                moved=moved[q],
                fair_ratio_mean=round(fair.ratio_mean, 3),
                fair_ratio_p10=round(fair.ratio_p10, 3),
                fair_ratio_p90=round(fair.ratio_p90, 3),
                starved_s=round(fair.starved_s, 1),
                unfit=len(everyone) - len(members),
            )
        )
    everything = list(waits.values())
    hours = max(1, last - first) / 3600
    return ChurnResult(
        policy=policy,
        reclaim=reclaim,
        load=load,
        nodes=len(nodes),
        pods=sum(fits),
        started=len(everything),
        preemptions=sum(preempted.values()),
        pending_p50_s=round(_percentile(everything, 50), 1),
        pending_p99_s=round(_percentile(everything, 99), 1),
        consolidation=consolidation,
        moves=sum(moved.values()),
        movable_share=movable_share if consolidation else 0.0,
        queues=queues,
        timeline=timeline,
        fair_timeline=fair_timeline,
        reclaim_rule=reclaim_rule if reclaim else "",
        hours=round(hours, 3),
        evictions_per_hour=round(sum(preempted.values()) / hours, 3),
        wasted_evictions=wasted,
        below_share_evictions=below_share,
        jain_index=round(meter.jain_index, 4),
        unfit=len(timed) - sum(fits),
    )
