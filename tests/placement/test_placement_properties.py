"""Property tests: random clusters and request streams, invariants checked against an independent tally.

Whatever the policy, rules, seed and requests: no GPU is over-committed in memory or compute, two modes
never share a GPU, an exclusive GPU holds one pod, sm-sharing GPUs stay single-tenant when the rule is
on, limits stay under the overcommit cap, host resources are never exceeded; releasing everything returns
every ledger to its start; the same inputs give the same placements.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import node
from test_placement_engine import same, snapshot

from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.placement.demand import PPM, portion_ppm
from gpufrac.placement.engine import Engine
from gpufrac.placement.filters import GpuRules, resource_fit
from gpufrac.placement.fragmentation import Fgd
from gpufrac.placement.model import ModePolicy, PendingPod
from gpufrac.placement.policies import POLICIES
from gpufrac.placement.typical import PriorTypicalPods, TypicalPod

MODES = (ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING)


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 4))
    specs = []
    for i in range(count):
        specs.append(
            node(
                f"n{i}",
                gpus=draw(st.integers(0, 4)),
                mib=draw(st.sampled_from([8000, 15109, 16384, 40960])),
                cpu=draw(st.integers(1, 64)) * 1000,
                memory=draw(st.integers(1, 64)) << 30,
                max_pods=draw(st.integers(1, 12)),
                compute_modes=frozenset(draw(st.sets(st.sampled_from(MODES), min_size=1))),
            )
        )
    return specs


@st.composite
def requests(draw, index: int):
    kind = draw(st.sampled_from(["cpu", "portion", "mib", "whole"]))
    mode = draw(st.sampled_from(MODES))
    count = draw(st.integers(1, 3))
    containers: tuple[ContainerGpuRequest, ...] = ()
    if kind == "portion":
        portion = draw(st.integers(1, 19)) / 20
        limit = draw(st.one_of(st.none(), st.integers(int(portion * 20), 20).map(lambda x: x / 20)))
        containers = (
            ContainerGpuRequest(
                "main",
                GpuMemory(portion=portion),
                None if limit is None else GpuMemory(portion=limit),
                mode,
                count,
            ),
        )
    elif kind == "mib":
        request = draw(st.integers(1, 20000))
        limit = draw(st.one_of(st.none(), st.integers(request, 40000)))
        containers = (
            ContainerGpuRequest(
                "main", GpuMemory(mib=request), None if limit is None else GpuMemory(mib=limit), mode, count
            ),
        )
        if draw(st.booleans()):
            containers += (
                ContainerGpuRequest("side", GpuMemory(mib=draw(st.integers(1, 8000))), None, mode),
            )
    elif kind == "whole":
        containers = (ContainerGpuRequest("main", None, None, mode, count, exclusive=True),)
    return PendingPod(
        namespace=draw(st.sampled_from(["a", "b", "c"])),
        name=f"p{index}",
        uid=f"u{index}",
        gpu=PodGpuRequest(containers),
        cpu_milli=draw(st.integers(0, 8)) * 1000,
        memory_bytes=draw(st.integers(0, 8)) << 30,
        priority=draw(st.integers(0, 2)),
        queue=draw(st.sampled_from(["q1", "q2"])),
        arrival=index,
        mode_policy=draw(st.sampled_from(list(ModePolicy))),
    )


@st.composite
def scenarios(draw):
    cluster = draw(clusters())
    pods = [draw(requests(i)) for i in range(draw(st.integers(1, 25)))]
    batches = draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))
    policy = draw(st.sampled_from(sorted(POLICIES)))
    rules = GpuRules(
        sm_sharing_single_tenant=draw(st.booleans()),
        limit_overcommit=draw(st.one_of(st.none(), st.sampled_from([1.0, 1.5, 2.0]))),
    )
    # Pods already bound by someone else with a compute portion larger than their memory share (the
    # contract allows it), so that the compute-portion rule can bind on its own.
    bound = []
    for spec in cluster:
        for gpu in spec.gpus[: spec.max_pods]:
            if draw(st.booleans()):
                bound.append(
                    (
                        spec.name,
                        gpu.uuid,
                        gpu.index,
                        draw(st.integers(1, 10)) / 10,
                        draw(st.sampled_from("abc")),
                    )
                )
    return cluster, pods, batches, policy, rules, draw(st.integers(0, 3)), bound


def run(cluster, pods, batches, policy, rules, seed, bound):
    e = Engine(policy=policy, seed=seed, rules=rules)
    for spec in cluster:
        e.add_node(spec)
    start = snapshot(e)
    sm = ComputeMode.SM_SHARING
    for i, (name, uuid, index, portion, namespace) in enumerate(bound):
        held = PendingPod(
            namespace,
            f"bound{i}",
            f"b{i}",
            PodGpuRequest((ContainerGpuRequest("main", GpuMemory(mib=64), None, sm),)),
        )
        pods = [*pods, held]
        device = DeviceAssignment(uuid, index, 64, 64, portion)
        e.assume(held, Placement(held.uid, name, (ContainerPlacement("main", sm, False, (device,)),)))
    check(e, cluster, pods, rules)
    decisions = []
    i = 0
    sizes = iter(batches * (len(pods) + 1))
    pending = pods[: len(pods) - len(bound)]
    while i < len(pending):
        size = next(sizes)
        decisions.extend(e.schedule(pending[i : i + size]))
        check(e, cluster, pods, rules)
        i += size
    return e, start, decisions


def check(e: Engine, cluster, pods, rules: GpuRules) -> None:
    specs = {s.name: s for s in cluster}
    by_uid = {p.uid: p for p in pods}
    used_mib = defaultdict(int)
    used_limit = defaultdict(int)
    used_ppm = defaultdict(int)
    modes = defaultdict(set)
    exclusive = defaultdict(int)
    holders = defaultdict(int)
    tenants = defaultdict(set)
    host = defaultdict(lambda: [0, 0, 0])
    for uid in e.bound_uids:
        placement = e.placement_of(uid)
        p = by_uid[uid]
        assert placement is not None
        spec = specs[placement.node]
        host[placement.node][0] += p.cpu_milli
        host[placement.node][1] += p.memory_bytes
        host[placement.node][2] += 1
        gpus = {g.uuid for g in spec.gpus}
        for c in placement.containers:
            assert len(set(c.uuids)) == len(c.uuids), "a container's devices are distinct"
            for d in c.devices:
                assert d.uuid in gpus, "devices are on the placement's node"
                used_mib[d.uuid] += d.request_mib
                used_limit[d.uuid] += d.limit_mib
                holders[d.uuid] += 1
                if d.compute_portion is not None:
                    used_ppm[d.uuid] += portion_ppm(d.compute_portion)
                modes[d.uuid].add("exclusive" if c.exclusive else c.mode)
                exclusive[d.uuid] += c.exclusive
                if c.mode is ComputeMode.SM_SHARING and not c.exclusive:
                    tenants[d.uuid].add(p.namespace)
    for name, spec in specs.items():
        cpu, mem, count = host[name]
        assert cpu <= spec.cpu_milli and mem <= spec.memory_bytes and count <= spec.max_pods
        ledgers = {g.uuid: g for g in e.ledger(name)}
        for gpu in spec.gpus:
            assert used_mib[gpu.uuid] <= gpu.memory_mib, "memory over-committed"
            assert ledgers[gpu.uuid].free_mib == gpu.memory_mib - used_mib[gpu.uuid]
            assert used_ppm[gpu.uuid] <= PPM, "compute over-committed"
            assert len(modes[gpu.uuid]) <= 1, "two modes on one GPU"
            if exclusive[gpu.uuid]:
                assert holders[gpu.uuid] == 1, "an exclusive GPU holds one pod"
            if rules.sm_sharing_single_tenant:
                assert len(tenants[gpu.uuid]) <= 1, "sm-sharing GPU shared by two tenants"
            if rules.limit_overcommit is not None:
                assert used_limit[gpu.uuid] <= int(gpu.memory_mib * rules.limit_overcommit)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_invariants_hold_and_release_restores_start(scenario):
    e, start, decisions = run(*scenario)
    placed = [d for d in decisions if isinstance(d, Placement)]
    assert len(decisions) == len(scenario[1])
    for d in reversed(placed):
        assert e.forget(d.pod_uid)
    for i in range(len(scenario[-1])):
        assert e.forget(f"b{i}")
    assert same(start, snapshot(e))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_same_seed_same_placements(scenario):
    _, _, first = run(*scenario)
    _, _, second = run(*scenario)
    assert first == second


# -- FGD's per-node terms, kept between pods --------------------------------------------------------------

TYPICAL = Counter(
    {
        TypicalPod(cpu_milli=2000, memory=GpuMemory(portion=0.5)): 4,
        TypicalPod(cpu_milli=0, memory=GpuMemory(portion=0.25), mode=ComputeMode.SM_SHARING): 2,
        TypicalPod(cpu_milli=8000, memory=None, count=1, exclusive=True): 3,
        TypicalPod(cpu_milli=16000, memory=None, count=2, exclusive=True): 1,
        TypicalPod(cpu_milli=4000, memory=None, count=0): 2,
        TypicalPod(cpu_milli=1000, memory=GpuMemory(mib=5000), count=2): 1,
        TypicalPod(cpu_milli=1000, memory=GpuMemory(portion=0.3), models=frozenset({"A100"})): 1,
    }
)


def masked_deltas(scorer: Fgd, state, demand, fit) -> np.ndarray:
    delta, mask = scorer.deltas(state, demand, fit)
    return delta if mask is None else np.where(mask, delta, 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    clusters(),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=20),
    st.data(),
    st.sampled_from(["none", "all"]),
)
def test_fgd_scores_from_kept_node_terms_equal_scores_derived_afresh(cluster, draws, data, joint):
    """The scorer keeps each node's terms until the node changes (``fragmentation._BeforeTerms``); a
    scorer that derives everything anew must give the same deltas through places, releases, and nodes
    that add rows and GPU slots."""
    e = Engine(policy="binpack")
    for spec in cluster:
        e.add_node(spec)
    kept = Fgd(PriorTypicalPods(TYPICAL), joint=joint)  # type: ignore[arg-type]
    placed: list[str] = []
    for i, choice in enumerate(draws):
        if i == len(draws) // 3:  # more node rows than the state started with (64), then more GPU slots (8)
            for j in range(64):
                e.add_node(node(f"spare{j}", gpus=1, cpu=4000))
        if i == 2 * len(draws) // 3:
            e.add_node(node("late", gpus=10, mib=40960, model="A100"))
        if placed and choice % 4 == 0:
            e.forget(placed.pop(choice % len(placed)))
        pod = data.draw(requests(i))
        demand = e.demand(pod)
        fit = resource_fit(e.state, demand, e.state.live(), e.rules).feasible()
        if fit.nodes.size:
            fresh = Fgd(PriorTypicalPods(TYPICAL), joint=joint)  # type: ignore[arg-type]
            assert np.array_equal(
                masked_deltas(kept, e.state, demand, fit), masked_deltas(fresh, e.state, demand, fit)
            )
        if isinstance(e.place(pod), Placement):
            placed.append(pod.uid)


def test_fgd_never_keeps_terms_of_a_hypothetical_state():
    """Preemption's what-if states copy the nodes' versions but not their free room, and number their
    rows from 0: terms kept from one would be served for the wrong node or the wrong room."""
    e = Engine(policy="binpack")
    for i in range(3):
        e.add_node(node(f"n{i}", gpus=2))
    half = PodGpuRequest((ContainerGpuRequest("main", GpuMemory(portion=0.5), None),))
    for i in range(5):
        e.place(PendingPod("ns", f"p{i}", f"u{i}", half, cpu_milli=1000))
    probe = PendingPod("ns", "probe", "probe", half, cpu_milli=1000)
    demand = e.demand(probe)
    kept = Fgd(PriorTypicalPods(TYPICAL))
    real = resource_fit(e.state, demand, e.state.live(), e.rules).feasible()
    before = masked_deltas(kept, e.state, demand, real)
    # Node n2 in row 0 and n0 in row 2, with the pods of n0 gone.
    nodes = np.array([e.state.index["n2"], e.state.index["n1"], e.state.index["n0"]])
    victims = np.zeros((3, 4), dtype=np.int64)
    on_n0 = [s for uid, s in e.pods.slot_of.items() if e.placement_of(uid).node == "n0"]
    victims[2, : len(on_n0)] = on_n0
    hyp = e.pods.hypothetical(e.state, nodes, e.pods.of_sets(victims, tenant=None), tenant=None)
    hfit = resource_fit(hyp, demand, np.arange(3), e.rules).feasible()
    fresh = Fgd(PriorTypicalPods(TYPICAL))
    assert np.array_equal(masked_deltas(kept, hyp, demand, hfit), masked_deltas(fresh, hyp, demand, hfit))
    assert np.array_equal(masked_deltas(kept, e.state, demand, real), before)
