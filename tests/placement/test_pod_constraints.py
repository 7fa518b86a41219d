"""Rules between pods and node-local resources besides GPUs, as the engine applies them (issue #19).

Each test is a situation a user met or would meet: anti-affine replicas that all landed on one node,
spread constraints that were ignored, a batch whose pods must keep the rules between themselves.
"""

from __future__ import annotations

import pytest
from placement_builders import GIB, fraction, node, pod

from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import NodeSelectorRequirement, NodeSpec, PendingPod, SelectorOperator
from gpufrac.placement.pod_constraints import (
    HostPort,
    InclusionPolicy,
    LabelSelector,
    NodeExtras,
    PodAffinityTerm,
    PodConstraints,
    SpreadConstraint,
    WeightedTerm,
    WhenUnsatisfiable,
)

HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
APP = {"app": "infer"}


def cluster(*names_zones: tuple[str, str], policy: str = "binpack", **node_kw: object) -> Engine:
    e = Engine(policy=policy)
    for name, zone in names_zones:
        e.add_node(node(name, labels={HOST: name, ZONE: zone}, **node_kw))  # type: ignore[arg-type]
    return e


def app_selector(labels: dict[str, str] = APP) -> LabelSelector:
    return LabelSelector(match_labels=tuple(sorted(labels.items())))


def anti(key: str = HOST, namespace: str = "ns") -> PodConstraints:
    term = PodAffinityTerm(topology_key=key, selector=app_selector(), namespaces=frozenset({namespace}))
    return PodConstraints(required_anti_affinity=(term,))


def spread(max_skew: int = 1, key: str = HOST, **kw: object) -> PodConstraints:
    return PodConstraints(
        spread=(
            SpreadConstraint(
                max_skew=max_skew,
                topology_key=key,
                when_unsatisfiable=kw.pop("when", WhenUnsatisfiable.DO_NOT_SCHEDULE),  # type: ignore[arg-type]
                selector=app_selector(),
                **kw,  # type: ignore[arg-type]
            ),
        )
    )


def nodes_of(decisions: list) -> list[str | None]:
    return [d.node if isinstance(d, Placement) else None for d in decisions]


def test_three_anti_affine_replicas_on_two_nodes_place_two_and_refuse_the_third_with_the_reason() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    replicas = [pod(fraction(0.2), labels=APP, constraints=anti()) for _ in range(3)]
    decisions = e.schedule(replicas)
    placed = [n for n in nodes_of(decisions) if n]
    assert sorted(placed) == ["a", "b"]
    refused = [d for d in decisions if isinstance(d, Unschedulable)]
    assert len(refused) == 1
    assert "2 node(s) didn't match pod anti-affinity rules" in refused[0].message


def test_anti_affinity_holds_one_pod_at_a_time_too() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    first = e.place(pod(fraction(0.2), labels=APP, constraints=anti()))
    second = e.place(pod(fraction(0.2), labels=APP, constraints=anti()))
    assert isinstance(first, Placement) and isinstance(second, Placement)
    assert first.node != second.node


def test_explain_names_the_rule_that_keeps_a_pod_off_a_node() -> None:
    from gpufrac.placement.decision import Reason

    e = cluster(("a", "z1"), ("b", "z1"))
    first = e.place(pod(fraction(0.2), labels=APP, constraints=anti()))
    assert isinstance(first, Placement)
    other = "b" if first.node == "a" else "a"
    replica = pod(fraction(0.2), labels=APP, constraints=anti())
    assert e.explain(replica, first.node).code is Reason.POD_ANTI_AFFINITY
    assert e.explain(replica, other).ok


def test_placed_pods_anti_affinity_repels_a_new_pod_that_has_no_rule_of_its_own() -> None:
    e = cluster(("a", "z1"), ("b", "z2"))
    guard = e.place(pod(fraction(0.1), labels={"role": "guard"}, constraints=anti(ZONE)))
    assert isinstance(guard, Placement)
    newcomer = e.place(pod(fraction(0.1), labels=APP))
    assert isinstance(newcomer, Placement)
    assert newcomer.node != guard.node  # binpack would have packed it next to the guard


def test_the_symmetric_rule_ends_when_the_repelling_pod_is_released() -> None:
    e = cluster(("a", "z1"))
    guard = pod(fraction(0.1), labels={"role": "guard"}, constraints=anti())
    assert isinstance(e.place(guard), Placement)
    refused = e.place(pod(fraction(0.1), labels=APP))
    assert isinstance(refused, Unschedulable)
    assert "existing pods anti-affinity" in refused.message
    e.forget(guard.uid)
    assert isinstance(e.place(pod(fraction(0.1), labels=APP)), Placement)


def test_four_pods_with_max_skew_one_spread_two_and_two() -> None:
    e = cluster(("a", "z1"), ("b", "z2"))
    decisions = e.schedule([pod(fraction(0.1), labels=APP, constraints=spread()) for _ in range(4)])
    placed = nodes_of(decisions)
    assert sorted(placed) == ["a", "a", "b", "b"]  # type: ignore[type-var]


def test_spread_refuses_a_node_without_the_topology_label() -> None:
    e = Engine(policy="binpack")
    e.add_node(node("bare"))
    refused = e.place(pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE)))
    assert isinstance(refused, Unschedulable)
    assert "missing required label" in refused.message


def test_min_domains_counts_missing_domains_as_empty() -> None:
    # Two zones exist but minDomains is 3: the global minimum is 0, so each zone takes at most maxSkew.
    e = cluster(("a", "z1"), ("b", "z2"))
    decisions = e.schedule(
        [pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE, min_domains=3)) for _ in range(3)]
    )
    assert sorted(n for n in nodes_of(decisions) if n) == ["a", "b"]
    assert isinstance(decisions[2], Unschedulable)


def test_node_affinity_policy_ignore_counts_domains_the_pod_cannot_use() -> None:
    # Zone z2's node is excluded by the pod's node selector. With Honor (default) z2 is no domain, so
    # both pods fit in z1; with Ignore z2 counts with 0 pods and the second pod would exceed maxSkew.
    def run(policy: InclusionPolicy) -> list:
        e = Engine(policy="binpack")
        e.add_node(node("a", labels={HOST: "a", ZONE: "z1", "pool": "gpu"}))
        e.add_node(node("b", labels={HOST: "b", ZONE: "z2"}))
        pods = [
            pod(
                fraction(0.1),
                labels=APP,
                node_selector={"pool": "gpu"},
                constraints=spread(key=ZONE, node_affinity_policy=policy),
            )
            for _ in range(2)
        ]
        return nodes_of(e.schedule(pods))

    assert run(InclusionPolicy.HONOR) == ["a", "a"]
    assert run(InclusionPolicy.IGNORE) == ["a", None]


def test_required_affinity_lets_the_first_pod_of_a_self_affine_group_in_then_follows_it() -> None:
    e = cluster(("a", "z1"), ("b", "z2"), ("c", "z3"))
    term = PodAffinityTerm(topology_key=ZONE, selector=app_selector(), namespaces=frozenset({"ns"}))
    rule = PodConstraints(required_affinity=(term,))
    first = e.place(pod(fraction(0.1), labels=APP, constraints=rule))
    assert isinstance(first, Placement)
    followers = [e.place(pod(fraction(0.1), labels=APP, constraints=rule)) for _ in range(3)]
    assert {d.node for d in followers if isinstance(d, Placement)} == {first.node}
    stranger = e.place(pod(fraction(0.1), labels={"app": "other"}, constraints=rule))
    assert isinstance(stranger, Placement) and stranger.node == first.node


def test_required_affinity_without_a_match_and_without_self_match_is_unschedulable() -> None:
    e = cluster(("a", "z1"))
    term = PodAffinityTerm(topology_key=ZONE, selector=app_selector(), namespaces=frozenset({"ns"}))
    refused = e.place(
        pod(fraction(0.1), labels={"app": "db"}, constraints=PodConstraints(required_affinity=(term,)))
    )
    assert isinstance(refused, Unschedulable)
    assert "pod affinity rules" in refused.message


def test_anti_affinity_namespaces_and_namespace_selector() -> None:
    e = cluster(("a", "z1"))
    e.set_namespace("team-b", {"team": "b"})
    assert isinstance(e.place(pod(fraction(0.1), namespace="team-b", labels=APP)), Placement)
    only_own = PodConstraints(
        required_anti_affinity=(PodAffinityTerm(HOST, app_selector(), frozenset({"team-a"})),)
    )
    assert isinstance(
        e.place(pod(fraction(0.1), namespace="team-a", labels=APP, constraints=only_own)), Placement
    )
    by_label = PodConstraints(
        required_anti_affinity=(
            PodAffinityTerm(HOST, app_selector(), frozenset(), LabelSelector(match_labels=(("team", "b"),))),
        )
    )
    refused = e.place(pod(fraction(0.1), namespace="team-c", labels={}, constraints=by_label))
    assert isinstance(refused, Unschedulable)


def test_mismatch_style_selector_not_in_selects_other_values() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    sel = LabelSelector(
        match_labels=(("app", "infer"),),
        match_expressions=(NodeSelectorRequirement("tenant", SelectorOperator.NOT_IN, ("x",)),),
    )
    rule = PodConstraints(required_anti_affinity=(PodAffinityTerm(HOST, sel, frozenset({"ns"})),))
    other = e.place(pod(fraction(0.1), labels={"app": "infer", "tenant": "y"}))
    mine = e.place(pod(fraction(0.1), labels={"app": "infer", "tenant": "x"}, constraints=rule))
    assert isinstance(other, Placement) and isinstance(mine, Placement)
    assert other.node != mine.node


def test_preferred_anti_affinity_spreads_where_binpack_would_pack() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    term = PodAffinityTerm(HOST, app_selector(), frozenset({"ns"}))
    rule = PodConstraints(preferred_anti_affinity=(WeightedTerm(100, term),))
    first, second = (e.place(pod(fraction(0.1), labels=APP, constraints=rule)) for _ in range(2))
    assert isinstance(first, Placement) and isinstance(second, Placement)
    assert first.node != second.node
    plain = [e.place(pod(fraction(0.1), labels=APP)) for _ in range(2)]
    assert len({d.node for d in plain if isinstance(d, Placement)}) == 1  # binpack packs without it


def test_schedule_anyway_spread_prefers_the_emptier_node_but_never_refuses() -> None:
    e = cluster(("a", "z1"))
    rule = spread(when=WhenUnsatisfiable.SCHEDULE_ANYWAY)
    decisions = e.schedule([pod(fraction(0.1), labels=APP, constraints=rule) for _ in range(3)])
    assert nodes_of(decisions) == ["a", "a", "a"]


def test_preferred_node_affinity_and_prefer_no_schedule_taints_rank_before_the_policy() -> None:
    from gpufrac.placement.model import NodeSelectorTerm, Taint, TaintEffect

    e = Engine(policy="binpack")
    e.add_node(node("a", labels={"disk": "hdd", "id": "a"}))
    e.add_node(node("b", labels={"disk": "ssd", "id": "b"}))
    noisy = (Taint("noisy", "", TaintEffect.PREFER_NO_SCHEDULE),)
    e.add_node(node("c", labels={"disk": "ssd", "id": "c"}, taints=noisy))
    for pinned in ("a", "c"):  # binpack alone now prefers a or c, the fuller nodes
        assert isinstance(e.place(pod(fraction(0.1), node_selector={"id": pinned})), Placement)
    ssd = NodeSelectorTerm((NodeSelectorRequirement("disk", SelectorOperator.IN, ("ssd",)),))
    wants_ssd = PodConstraints(preferred_node=((50, ssd),))
    for _ in range(3):
        decision = e.place(pod(fraction(0.1), constraints=wants_ssd))
        assert isinstance(decision, Placement) and decision.node == "b"  # ssd, and c's taint is avoided


def test_host_ports_conflict_on_the_same_protocol_and_port() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    web = NodeExtras(host_ports=(HostPort(8080),))
    first, second = (e.place(pod(fraction(0.1), extras=web)) for _ in range(2))
    assert isinstance(first, Placement) and isinstance(second, Placement) and first.node != second.node
    udp = e.place(pod(fraction(0.1), extras=NodeExtras(host_ports=(HostPort(8080, "UDP"),))))
    assert isinstance(udp, Placement)
    refused = e.place(pod(fraction(0.1), extras=NodeExtras(host_ports=(HostPort(8080, "TCP", "10.0.0.1"),))))
    assert isinstance(refused, Unschedulable)
    assert "free ports" in refused.message


def test_extended_resources_and_ephemeral_storage_are_counted() -> None:
    e = Engine(policy="binpack")
    e.add_node(node("a", extended={"example.com/fpga": 2}, ephemeral_bytes=10 * GIB))
    fpga = NodeExtras(extended=(("example.com/fpga", 1),))
    assert all(isinstance(e.place(pod(fraction(0.1), extras=fpga)), Placement) for _ in range(2))
    refused = e.place(pod(fraction(0.1), extras=fpga))
    assert isinstance(refused, Unschedulable) and "insufficient extended resource" in refused.message
    disk = NodeExtras(ephemeral_bytes=6 * GIB)
    assert isinstance(e.place(pod(fraction(0.1), extras=disk)), Placement)
    refused = e.place(pod(fraction(0.1), extras=disk))
    assert isinstance(refused, Unschedulable) and "ephemeral-storage" in refused.message


def test_room_held_for_a_nominated_pod_goes_to_it_not_to_a_lower_priority_pod() -> None:
    e = Engine(policy="binpack")
    e.add_node(node("a", cpu=4000))
    e.add_node(node("b", cpu=4000))
    big = pod(fraction(0.1), cpu_milli=3000, priority=10, nominated_node="a")
    e.nominate(big, "a")
    low = e.place(pod(fraction(0.1), cpu_milli=3000, priority=5))
    assert isinstance(low, Placement) and low.node == "b"
    refused = e.place(pod(fraction(0.1), cpu_milli=3000, priority=5))
    assert isinstance(refused, Unschedulable)
    higher = e.place(pod(fraction(0.1), cpu_milli=3000, priority=20))
    assert isinstance(higher, Placement) and higher.node == "a"


def test_dropping_the_nomination_gives_the_room_back() -> None:
    e = Engine(policy="binpack")
    e.add_node(node("a", cpu=4000))
    held = pod(fraction(0.1), cpu_milli=3000, priority=10, nominated_node="a")
    e.nominate(held, "a")
    assert isinstance(e.place(pod(fraction(0.1), cpu_milli=3000)), Unschedulable)
    e.drop_nomination(held.uid)
    assert isinstance(e.place(pod(fraction(0.1), cpu_milli=3000)), Placement)


def test_the_nominated_pod_goes_to_its_nominated_node() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    nominated = pod(fraction(0.1), nominated_node="b")
    e.nominate(nominated, "b")
    assert isinstance(e.place(pod(fraction(0.1))), Placement)  # binpack now prefers that node
    decision = e.place(nominated)
    assert isinstance(decision, Placement) and decision.node == "b"


def test_gang_rollback_releases_the_book_too() -> None:
    e = cluster(("a", "z1"))
    gang = [pod(fraction(0.1), labels=APP, constraints=anti()) for _ in range(2)]
    decisions = e.schedule(gang, gang=True)
    assert all(isinstance(d, Unschedulable) for d in decisions)
    assert isinstance(e.place(pod(fraction(0.1), labels=APP, constraints=anti())), Placement)


# -- nodes nothing is placed on (the scheduler's unmanaged nodes) ---------------------------------------


def outside(name: str, zone: str, **kw: object) -> NodeSpec:
    """A node the engine knows as a topology domain only: labels and taints, no resources."""
    return NodeSpec(name=name, cpu_milli=0, memory_bytes=0, labels={HOST: name, ZONE: zone}, **kw)  # type: ignore[arg-type]


def test_an_unmanaged_zone_without_matching_pods_holds_the_spread_minimum_and_refuses_the_pod() -> None:
    # kube-scheduler counts zone z2 (an unmanaged node) as a domain with 0 pods: a second pod in z1
    # would make the skew 2.
    e = cluster(("a", "z1"), ("b", "z1"))
    e.add_topology_node(outside("u", "z2"))
    first = e.place(pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE)))
    assert isinstance(first, Placement)
    refused = e.place(pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE)))
    assert isinstance(refused, Unschedulable)
    assert refused.message == (
        "0/2 nodes are available: 2 node(s) didn't match pod topology spread constraints."
    )
    # A matching pod bound there (by another scheduler) lifts the minimum to 1.
    e.add_topology_pod(pod(labels=APP), "u")
    assert isinstance(e.place(pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE))), Placement)


def test_an_unmanaged_node_whose_taint_the_pod_does_not_tolerate_is_no_domain_under_honor() -> None:
    from gpufrac.placement.model import Taint, TaintEffect

    e = cluster(("a", "z1"))
    e.add_topology_node(outside("u", "z2", taints=(Taint("dedicated", "x", TaintEffect.NO_SCHEDULE),)))
    honour = spread(key=ZONE, node_taints_policy=InclusionPolicy.HONOR)
    for _ in range(2):  # z2 is no domain for a pod that does not tolerate its taint
        assert isinstance(e.place(pod(fraction(0.1), labels=APP, constraints=honour)), Placement)
    assert isinstance(e.place(pod(fraction(0.1), labels=APP, constraints=spread(key=ZONE))), Unschedulable)


def test_a_pod_on_an_unmanaged_node_in_the_same_zone_blocks_a_zone_anti_affine_pod() -> None:
    e = cluster(("a", "z1"), ("b", "z2"))
    e.add_topology_node(outside("u", "z1"))
    e.add_topology_pod(pod(labels=APP), "u")
    for _ in range(2):  # binpack would pack both onto one node; z1 is taken by the pod on u
        decision = e.place(pod(fraction(0.1), labels={"app": "other"}, constraints=anti(ZONE)))
        assert isinstance(decision, Placement) and decision.node == "b"
    alone = cluster(("a", "z1"))
    alone.add_topology_node(outside("u", "z1"))
    alone.add_topology_pod(pod(labels=APP), "u")
    refused = alone.place(pod(fraction(0.1), labels={"app": "other"}, constraints=anti(ZONE)))
    assert isinstance(refused, Unschedulable) and "pod anti-affinity rules" in refused.message


def test_the_required_anti_affinity_of_a_pod_on_an_unmanaged_node_repels_the_pods_it_selects() -> None:
    e = cluster(("a", "z1"))
    e.add_topology_node(outside("u", "z1"))
    guard = pod(labels={"role": "guard"}, constraints=anti(ZONE))
    e.add_topology_pod(guard, "u")
    refused = e.place(pod(fraction(0.1), labels=APP))
    assert isinstance(refused, Unschedulable) and "existing pods anti-affinity" in refused.message
    assert e.remove_topology_pod(guard.uid) is True  # its anti-affinity goes: pods may fit now
    assert e.remove_topology_pod(guard.uid) is None  # no longer counted
    assert isinstance(e.place(pod(fraction(0.1), labels=APP)), Placement)


def test_removing_an_unmanaged_node_stops_counting_its_pods() -> None:
    e = cluster(("a", "z1"))
    e.add_topology_node(outside("u", "z1"))
    counted = pod(labels=APP)
    e.add_topology_pod(counted, "u")
    assert isinstance(e.place(pod(fraction(0.1), constraints=anti(ZONE))), Unschedulable)
    assert e.remove_topology_node("u") == [counted.uid]
    assert isinstance(e.place(pod(fraction(0.1), constraints=anti(ZONE))), Placement)


def test_a_pod_on_an_unmanaged_node_wakes_waiting_pods_only_when_its_coming_or_going_may_help() -> None:
    # Pods on unmanaged nodes come and go often; the scheduler wakes its parked pods only when one's
    # arrival (a required affinity or a spread counts it) or leaving (an anti-affinity or a spread
    # counts it) may let one in.
    e = cluster(("a", "z1"))
    e.add_topology_node(outside("u", "z1"))
    plain, web, db = pod(labels={"app": "batch"}), pod(labels=APP), pod(labels={"app": "db"})
    for p in (plain, web):
        assert e.add_topology_pod(p, "u") is False  # no rule counts them yet
    assert isinstance(e.place(pod(fraction(0.1), constraints=anti(ZONE))), Unschedulable)  # web counts
    with_db = PodAffinityTerm(ZONE, app_selector({"app": "db"}), frozenset({"ns"}))
    needs_db = pod(fraction(0.1), constraints=PodConstraints(required_affinity=(with_db,)))
    assert isinstance(e.place(needs_db), Unschedulable)  # no db pod anywhere
    assert e.add_topology_pod(db, "u") is True  # its arrival may let needs_db in
    assert isinstance(
        e.place(pod(fraction(0.1), constraints=PodConstraints(required_affinity=(with_db,)))), Placement
    )
    cache = pod(labels={"app": "cache"})
    e.add_topology_pod(cache, "u")
    spread_cache = PodConstraints(
        spread=(SpreadConstraint(1, ZONE, WhenUnsatisfiable.DO_NOT_SCHEDULE, app_selector({"app": "cache"})),)
    )
    e.place(pod(fraction(0.1), labels={"app": "cache"}, constraints=spread_cache))
    assert e.remove_topology_pod(plain.uid) is False
    assert e.remove_topology_pod(db.uid) is False  # only a required affinity counted it
    assert e.remove_topology_pod(web.uid) is True
    assert e.remove_topology_pod(cache.uid) is True  # z1, a's zone too, holds one cache pod fewer


def test_a_node_is_either_placed_on_or_topology_only() -> None:
    e = cluster(("a", "z1"))
    with pytest.raises(ValueError, match="node a is a node pods are placed on"):
        e.add_topology_node(outside("a", "z1"))
    e.add_topology_node(outside("u", "z1"))
    with pytest.raises(ValueError, match="node u is a topology-only node"):
        e.add_node(node("u"))
    with pytest.raises(ValueError, match="node v is not a known topology-only node"):
        e.add_topology_pod(pod(labels=APP), "v")


def test_counts_on_unmanaged_nodes_survive_the_cluster_growing_around_them() -> None:
    # The state doubles its node slots (64 -> 128) and the topology-only slots double too (8 -> 16):
    # every count is moved to the new layout, so the pods on u still count.
    e = Engine(policy="binpack")
    e.add_topology_node(outside("u", "z9"))
    e.add_topology_pod(pod(labels=APP), "u")
    assert isinstance(e.place(pod(fraction(0.1), constraints=anti(ZONE))), Unschedulable)  # no node yet
    for i in range(70):
        e.add_node(node(f"n{i}", labels={HOST: f"n{i}", ZONE: "z9" if i < 69 else "z1"}))
    for i in range(10):
        e.add_topology_node(outside(f"v{i}", "z8"))
    decision = e.place(pod(fraction(0.1), constraints=anti(ZONE)))
    assert isinstance(decision, Placement) and decision.node == "n69"
    assert isinstance(e.place(pod(fraction(0.1), constraints=anti(ZONE))), Placement)  # n69 again (z1)


# -- placed pods' terms, scored back ---------------------------------------------------------------------


def test_a_placed_pods_preferred_anti_affinity_pushes_a_new_pod_to_another_node() -> None:
    e = cluster(("a", "z1"), ("b", "z1"))
    term = PodAffinityTerm(HOST, app_selector(), frozenset({"ns"}))
    loner = pod(
        fraction(0.1),
        labels={"role": "loner"},
        constraints=PodConstraints(preferred_anti_affinity=(WeightedTerm(100, term),)),
    )
    placed = e.place(loner)
    assert isinstance(placed, Placement)
    for _ in range(2):  # binpack alone packs next to the loner; its preference keeps app=infer away
        newcomer = e.place(pod(fraction(0.1), labels=APP))
        assert isinstance(newcomer, Placement) and newcomer.node != placed.node


def test_a_placed_pods_preferred_and_required_affinity_pull_a_new_pod_to_its_domain() -> None:
    # spread would put the newcomer on the emptier zone; the placed pod's terms pull it to theirs.
    for rule in (
        lambda t: PodConstraints(preferred_affinity=(WeightedTerm(10, t),)),
        lambda t: PodConstraints(required_affinity=(t,)),  # hardPodAffinityWeight 1
    ):
        e = cluster(("a", "z1"), ("b", "z2"), policy="spread")
        term = PodAffinityTerm(ZONE, app_selector(), frozenset({"ns"}))
        anchor = e.place(pod(fraction(0.3), labels=APP, constraints=rule(term)))
        assert isinstance(anchor, Placement)
        newcomer = e.place(pod(fraction(0.1), labels=APP))
        assert isinstance(newcomer, Placement) and newcomer.node == anchor.node


def test_an_unmanaged_nodes_pod_with_a_preferred_anti_affinity_is_scored_back_too() -> None:
    e = cluster(("a", "z1"), ("b", "z2"))
    e.add_topology_node(outside("u", "z1"))
    term = PodAffinityTerm(ZONE, app_selector(), frozenset({"ns"}))
    e.add_topology_pod(pod(constraints=PodConstraints(preferred_anti_affinity=(WeightedTerm(1, term),))), "u")
    placed = [e.place(pod(fraction(0.1), labels=APP)) for _ in range(2)]
    assert [d.node for d in placed if isinstance(d, Placement)] == ["b", "b"]


# -- the book's incremental counts ---------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpufrac.placement.topology import PodBook  # noqa: E402


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(("web", "db")),
            st.sampled_from((None, HOST, ZONE)),
            st.booleans(),
            st.sampled_from((None, None, "u0", "u9")),  # placed on a managed node, or counted on one
            st.booleans(),  # more unmanaged nodes arrive first (their slots' capacity doubles)
        ),
        min_size=1,
        max_size=25,
    )
)
def test_counts_kept_while_placing_and_releasing_equal_counts_rebuilt_from_scratch(steps) -> None:
    """Trackers and held terms are updated on every place, release and count on an unmanaged node, and
    moved when the layout grows; a book rebuilt from the pods held at the end must count the same,
    whatever the order (an update missed, doubled or left at an old slot shows here)."""
    e = cluster(("a", "z1"), ("b", "z2"), ("c", "z1"), policy="spread")
    unmanaged = [outside("u0", "z2")]
    e.add_topology_node(unmanaged[0])
    held: list[tuple[PendingPod, str | None]] = []
    first = ("web", HOST, False, None, False)  # at least one rule, so one tracker
    for app, anti_key, release, where, grow in [first, *steps]:
        if grow:
            for _ in range(8):
                unmanaged.append(outside(f"u{len(unmanaged)}", "z3"))
                e.add_topology_node(unmanaged[-1])
        term = PodAffinityTerm(anti_key or HOST, app_selector({"app": app}), frozenset({"ns"}))
        rule = (
            PodConstraints(required_anti_affinity=(term,), preferred_affinity=(WeightedTerm(3, term),))
            if anti_key
            else PodConstraints()
        )
        p = pod(fraction(0.05), labels={"app": app}, constraints=rule)
        if where is not None and where in {n.name for n in unmanaged}:
            e.add_topology_pod(p, where)
            held.append((p, where))
        elif where is None and isinstance(e.place(p), Placement):
            held.append((p, None))
        if release and held:
            gone, on = held.pop(0)
            assert e.remove_topology_pod(gone.uid) is not None if on else e.forget(gone.uid)
    fresh = PodBook(e.state)
    for spec in unmanaged:
        fresh.set_outside_node(spec)
    for p, on in held:
        if on:
            fresh.add_outside(p, on)
        else:
            fresh.add(p, e.state.index[e.placement_of(p.uid).node])  # type: ignore[union-attr]
    keys = list(e.book._trackers)
    assert keys, "no tracker was built; nothing was compared"
    for key in keys:
        assert (e.book._tracker(key) == fresh._tracker(key)).all(), key
    fresh._sync_layout()
    for mine, theirs in ((e.book._anti, fresh._anti), (e.book._scored, fresh._scored)):
        assert set(mine.holders) == set(theirs.holders)
        for key, holders in mine.holders.items():
            assert (holders == theirs.holders[key]).all(), key
