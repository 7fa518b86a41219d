"""Each filter on small hand-checked clusters: the reason a node is rejected, and the counted message."""

from __future__ import annotations

import pytest
from placement_builders import GIB, fraction, mib, node, pod, whole

from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement, Reason, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.filters import GpuRules
from gpufrac.placement.model import (
    ModePolicy,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    SelectorOperator,
    Taint,
    TaintEffect,
    Toleration,
    TolerationOperator,
)

SM = ComputeMode.SM_SHARING
TS = ComputeMode.TIME_SLICING


def engine(*nodes, **kw) -> Engine:
    e = Engine(policy=kw.pop("policy", "binpack"), **kw)
    for n in nodes:
        e.add_node(n)
    return e


def code(e: Engine, p, name: str = "a") -> Reason:
    return e.explain(p, name).code


def test_ready_and_schedulable():
    e = engine(node("a", ready=False), node("b", schedulable=False), node("c"))
    p = pod(fraction(0.5))
    assert code(e, p, "a") is Reason.NOT_READY
    assert code(e, p, "b") is Reason.UNSCHEDULABLE
    assert code(e, p, "c") is Reason.FITS
    placed = e.place(p)
    assert isinstance(placed, Placement) and placed.node == "c"


def test_a_node_with_another_node_stack_is_refused_before_its_readiness_is_read():
    """Its readiness condition is the other stack's: the sentence says why, not "not ready"."""
    e = engine(node("a", node_stack_conflict=True, ready=False), node("b", node_stack_conflict=True))
    p = pod(fraction(0.5))
    assert code(e, p, "a") is Reason.NODE_STACK_CONFLICT
    decision = e.place(p)
    assert isinstance(decision, Unschedulable)
    assert decision.message == "0/2 nodes are available: 2 node(s) run another GPU-fractioning node stack."


def test_taints_and_tolerations():
    taint = Taint("gpufrac.io/managed", "true", TaintEffect.NO_SCHEDULE)
    e = engine(
        node("a", taints=(taint,)),
        node("b", taints=(Taint("soft", "", TaintEffect.PREFER_NO_SCHEDULE),)),
        node("c", taints=(Taint("evict", "x", TaintEffect.NO_EXECUTE),)),
    )
    bare = pod()
    assert code(e, bare, "a") is Reason.UNTOLERATED_TAINT
    assert code(e, bare, "b") is Reason.FITS  # PreferNoSchedule never filters
    assert code(e, bare, "c") is Reason.UNTOLERATED_TAINT
    equal = pod(tolerations=(Toleration("gpufrac.io/managed", TolerationOperator.EQUAL, "true"),))
    assert code(e, equal, "a") is Reason.FITS
    wrong_value = pod(tolerations=(Toleration("gpufrac.io/managed", TolerationOperator.EQUAL, "no"),))
    assert code(e, wrong_value, "a") is Reason.UNTOLERATED_TAINT
    wrong_effect = pod(
        tolerations=(Toleration("evict", TolerationOperator.EXISTS, effect=TaintEffect.NO_SCHEDULE),)
    )
    assert code(e, wrong_effect, "c") is Reason.UNTOLERATED_TAINT
    everything = pod(tolerations=(Toleration("", TolerationOperator.EXISTS),))
    assert code(e, everything, "a") is Reason.FITS and code(e, everything, "c") is Reason.FITS


def test_node_selector():
    e = engine(node("a", labels={"zone": "x"}), node("b", labels={"zone": "y"}))
    p = pod(node_selector={"zone": "x"})
    assert code(e, p, "a") is Reason.FITS
    assert code(e, p, "b") is Reason.NODE_SELECTOR


@pytest.mark.parametrize(
    ("operator", "values", "fits"),
    [
        (SelectorOperator.IN, ("4", "8"), {"a"}),
        (SelectorOperator.NOT_IN, ("4",), {"b", "c"}),  # a missing label is "not in"
        (SelectorOperator.EXISTS, (), {"a", "b"}),
        (SelectorOperator.DOES_NOT_EXIST, (), {"c"}),
        (SelectorOperator.GT, ("4",), {"b"}),
        (SelectorOperator.LT, ("12",), {"a"}),
        (SelectorOperator.GT, ("x",), set()),  # not an integer: never matches
    ],
)
def test_required_node_affinity_operators(operator, values, fits):
    e = engine(node("a", labels={"size": "4"}), node("b", labels={"size": "16"}), node("c"))
    term = NodeSelectorTerm((NodeSelectorRequirement("size", operator, values),))
    p = pod(affinity=(term,))
    got = {n for n in ("a", "b", "c") if code(e, p, n) is Reason.FITS}
    assert got == fits
    assert all(code(e, p, n) is Reason.NODE_AFFINITY for n in {"a", "b", "c"} - fits)


def test_affinity_terms_are_ored_and_expressions_anded():
    e = engine(
        node("a", labels={"k": "1", "z": "x"}), node("b", labels={"k": "1"}), node("c", labels={"z": "x"})
    )
    both = NodeSelectorTerm(
        (
            NodeSelectorRequirement("k", SelectorOperator.EXISTS),
            NodeSelectorRequirement("z", SelectorOperator.IN, ("x",)),
        )
    )
    only_c = NodeSelectorTerm((NodeSelectorRequirement("k", SelectorOperator.DOES_NOT_EXIST),))
    p = pod(affinity=(both, only_c))
    assert {n for n in "abc" if code(e, p, n) is Reason.FITS} == {"a", "c"}
    empty_term = pod(affinity=(NodeSelectorTerm(()),))
    assert code(e, empty_term, "a") is Reason.NODE_AFFINITY


def test_host_resources_and_pod_count():
    e = engine(node("a", cpu=4000, memory=8 * GIB, max_pods=2))
    assert code(e, pod(cpu_milli=4001)) is Reason.INSUFFICIENT_CPU
    assert code(e, pod(memory_bytes=8 * GIB + 1)) is Reason.INSUFFICIENT_MEMORY
    assert isinstance(e.place(pod(cpu_milli=4000, memory_bytes=8 * GIB)), Placement)  # exact fit
    assert isinstance(e.place(pod()), Placement)
    assert code(e, pod()) is Reason.TOO_MANY_PODS


def test_gpu_memory_fit_is_exact_and_portion_floors():
    e = engine(node("a", gpus=1, mib=15109))
    first = e.place(pod(fraction(0.5)))
    assert isinstance(first, Placement)
    assert first.containers[0].devices[0].request_mib == 7554  # floor(0.5 * 15109)
    assert isinstance(e.place(pod(mib(7555))), Placement)  # 15109 - 7554 = 7555 left: exact fit
    assert code(e, pod(mib(1))) is Reason.INSUFFICIENT_GPU_MEMORY
    assert e.ledger("a")[0].free_mib == 0


def test_modes_never_mix():
    e = engine(node("a", gpus=1))
    assert isinstance(e.place(pod(fraction(0.25, mode=SM))), Placement)
    assert code(e, pod(fraction(0.25, mode=TS))) is Reason.MODE_CONFLICT
    assert code(e, pod(fraction(0.25, mode=SM))) is Reason.FITS


def test_preferred_mode_falls_back_without_mixing():
    e = engine(node("a", gpus=1))
    e.place(pod(fraction(0.25, mode=SM)))
    required = pod(fraction(0.25, mode=TS))
    assert isinstance(e.place(required), Unschedulable)
    preferred = pod(fraction(0.25, mode=TS), mode_policy=ModePolicy.PREFERRED)
    got = e.place(preferred)
    assert isinstance(got, Placement)
    assert got.containers[0].mode is SM  # it runs in the GPU's mode
    assert e.ledger("a")[0].pods == 2


def test_sm_sharing_is_single_tenant_by_default():
    e = engine(node("a", gpus=1))
    e.place(pod(fraction(0.25, mode=SM), namespace="team-a"))
    other = pod(fraction(0.25, mode=SM), namespace="team-b")
    assert code(e, other) is Reason.TENANT_CONFLICT
    assert code(e, pod(fraction(0.25, mode=SM), namespace="team-a")) is Reason.FITS
    # Time-slicing GPUs hold any tenants.
    e2 = engine(node("a", gpus=1))
    e2.place(pod(fraction(0.25), namespace="team-a"))
    assert code(e2, pod(fraction(0.25), namespace="team-b")) is Reason.FITS
    shared = engine(node("a", gpus=1), rules=GpuRules(sm_sharing_single_tenant=False))
    shared.place(pod(fraction(0.25, mode=SM), namespace="team-a"))
    assert isinstance(shared.place(other), Placement)
    assert shared.ledger("a")[0].tenants == ("team-a", "team-b")


def test_compute_portions_stay_within_one_gpu():
    e = engine(node("a", gpus=1, mib=16000))
    # A bound pod whose compute portion (0.7) exceeds its memory share, as the contract allows.
    bound = pod(mib(1000, mode=SM))
    e.assume(
        bound,
        Placement(
            bound.uid,
            "a",
            (ContainerPlacement("main", SM, False, (DeviceAssignment("a-g0", 0, 1000, 1000, 0.7),)),),
        ),
    )
    assert e.ledger("a")[0].compute_ppm == 700_000
    assert code(e, pod(fraction(0.3, mode=SM))) is Reason.FITS
    assert code(e, pod(fraction(0.31, mode=SM))) is Reason.INSUFFICIENT_COMPUTE
    placed = e.place(pod(fraction(0.3, mode=SM)))
    assert isinstance(placed, Placement) and placed.containers[0].devices[0].compute_portion == 0.3


def test_limit_overcommit_cap():
    e = engine(node("a", gpus=1, mib=16000), rules=GpuRules(limit_overcommit=1.5))
    assert isinstance(e.place(pod(mib(4000, limit=12000))), Placement)
    assert code(e, pod(mib(4000, limit=12000))) is Reason.FITS  # 24000 = 1.5 x 16000
    e.place(pod(mib(4000, limit=12000)))
    assert code(e, pod(mib(1000, limit=1000))) is Reason.LIMIT_OVERCOMMIT
    no_cap = engine(node("a", gpus=1, mib=16000))
    for _ in range(3):
        assert isinstance(no_cap.place(pod(mib(4000, limit=16000))), Placement)


def test_n_distinct_gpus_on_one_node():
    e = engine(node("one", gpus=1), node("two", gpus=2))
    p = pod(fraction(0.6, count=2))
    assert code(e, p, "one") is Reason.TOO_FEW_GPUS
    got = e.place(p)
    assert isinstance(got, Placement) and got.node == "two"
    assert len(set(got.containers[0].uuids)) == 2
    assert code(e, pod(fraction(0.6, count=2)), "two") is Reason.INSUFFICIENT_GPU_MEMORY


def test_exclusive_takes_only_empty_gpus():
    e = engine(node("a", gpus=3))
    e.place(pod(fraction(0.1)))
    got = e.place(pod(whole(2)))
    assert isinstance(got, Placement)
    assert [d.request_mib for d in got.containers[0].devices] == [16384, 16384]
    assert code(e, pod(whole(1))) is Reason.NO_WHOLE_GPU
    assert code(e, pod(fraction(0.9))) is Reason.FITS  # the shared GPU has 0.9 left
    assert code(e, pod(fraction(0.05))) is Reason.FITS


def test_node_capability_for_compute_modes():
    e = engine(node("ts-only", compute_modes=frozenset({TS})), node("both"))
    assert code(e, pod(fraction(0.2, mode=SM)), "ts-only") is Reason.MODE_UNSUPPORTED
    assert code(e, pod(fraction(0.2, mode=TS)), "ts-only") is Reason.FITS
    assert code(e, pod(whole(1)), "ts-only") is Reason.FITS  # a whole GPU needs no sharing mode


def test_no_gpus():
    e = engine(node("cpu", gpus=0, model=""))
    assert code(e, pod(fraction(0.2)), "cpu") is Reason.NO_GPUS
    assert code(e, pod(), "cpu") is Reason.FITS


def test_unschedulable_message_counts_reasons_over_nodes():
    nodes = [node(f"m{i}", gpus=1) for i in range(8)] + [node(f"s{i}", gpus=1) for i in range(4)]
    e = engine(*nodes)
    for i in range(8):
        _bind_on(e, f"m{i}", 0.9, TS)
    for i in range(4):
        _bind_on(e, f"s{i}", 0.1, SM)
    got = e.place(pod(fraction(0.5, mode=TS)))
    assert isinstance(got, Unschedulable)
    assert got.message == "0/12 nodes are available: 8 insufficient GPU memory, 4 compute-mode conflict."
    assert got.counts == (("insufficient GPU memory", 8), ("compute-mode conflict", 4))


def _bind_on(e: Engine, name: str, portion: float, mode: ComputeMode) -> None:
    """A pod already bound to ``name``'s one 16 GiB GPU, holding ``portion`` of it in ``mode``."""
    held_mib = round(16384 * portion)
    share = portion if mode is SM else None
    placed = ContainerPlacement(
        "main", mode, False, (DeviceAssignment(f"{name}-g0", 0, held_mib, held_mib, share),)
    )
    bound = pod(fraction(portion, mode=mode), name=f"bound-{name}")
    e.assume(bound, Placement(bound.uid, name, (placed,)))


def test_assume_books_the_placement_given_and_refuses_a_gpu_of_another_node():
    e = engine(node("a", gpus=2))
    req = ContainerGpuRequest("main", GpuMemory(portion=0.25), GpuMemory(portion=0.5), SM)
    bound = pod(PodGpuRequest((req,)), namespace="t")
    placed = ContainerPlacement("main", SM, False, (DeviceAssignment("a-g1", 1, 4096, 8192, 0.25),))
    got = e.assume(bound, Placement(bound.uid, "a", (placed,)))
    assert got.containers[0].devices[0].uuid == "a-g1"
    ledger = e.ledger("a")[1]
    assert (ledger.free_mib, ledger.limit_sum_mib, ledger.compute_ppm, ledger.tenants) == (
        12288,
        8192,
        250_000,
        ("t",),
    )
    elsewhere = Placement(
        "x", "a", (ContainerPlacement("main", SM, False, (DeviceAssignment("b-g0", 0, 1, 1, None),)),)
    )
    with pytest.raises(ValueError, match="not on node a"):
        e.assume(pod(PodGpuRequest((req,))), elsewhere)
