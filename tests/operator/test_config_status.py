"""The conditions a person reads on a GpuFractioningConfig, from DaemonSet numbers and Node reports."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from gpufrac.contract.keys import DRIVER_MAJOR_LABEL
from gpufrac.operator.resource import AgentSpec, ConfigSpec
from gpufrac.operator.status import DaemonSetView, NodeView, compute_status

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GPU = {"nvidia.com/gpu.present": "true"}


def spec(*, gate: int | None = None) -> ConfigSpec:
    return ConfigSpec(
        name="c", uid="u", generation=2, namespace="ns", agent=AgentSpec(image="i"), min_driver_major=gate
    )


def ds(*, desired: int, ready: int, updated: int | None = None, observed: int = 1) -> DaemonSetView:
    return DaemonSetView(
        generation=1,
        observed_generation=observed,
        desired=desired,
        ready=ready,
        updated=desired if updated is None else updated,
    )


def node(name: str, *, ready: str | None = "True", reason: str = "", driver: str | None = "615") -> NodeView:
    labels = dict(GPU)
    if driver is not None:
        labels[DRIVER_MAJOR_LABEL] = driver
    return NodeView(name=name, labels=labels, ready=ready, reason=reason)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_ready_when_every_agent_and_every_node_is_ready() -> None:
    status = compute_status(
        config=spec(), daemonset=ds(desired=2, ready=2), nodes=[node("n1"), node("n2")], now=T0
    )
    got = conditions(status)
    assert got["Ready"][:2] == ("True", "AllNodesReady")
    assert got["Progressing"][:2] == ("False", "RolloutComplete")
    assert got["Degraded"][:2] == ("False", "AsExpected")
    assert (status["desiredNodes"], status["readyNodes"], status["nodesBelowMinDriver"]) == (2, 2, 0)
    assert status["observedGeneration"] == 2


def test_agents_still_starting_are_progressing_not_degraded() -> None:
    got = conditions(
        compute_status(
            config=spec(), daemonset=ds(desired=2, ready=1), nodes=[node("n1"), node("n2")], now=T0
        )
    )
    assert got["Ready"][:2] == ("False", "AgentsNotReady")
    assert got["Progressing"][:2] == ("True", "RollingOut")
    assert got["Degraded"][0] == "False"


def test_a_template_the_daemonset_controller_has_not_seen_is_not_ready() -> None:
    got = conditions(
        compute_status(
            config=spec(), daemonset=ds(desired=1, ready=1, observed=0), nodes=[node("n1")], now=T0
        )
    )
    assert got["Ready"][0] == "False"
    assert got["Progressing"][0] == "True"


def test_a_node_reporting_not_ready_degrades_with_the_agents_reason() -> None:
    nodes = [node("n1"), node("n2", ready="False", reason="NriPluginNotConnected")]
    got = conditions(compute_status(config=spec(), daemonset=ds(desired=2, ready=2), nodes=nodes, now=T0))
    assert got["Ready"][:2] == ("False", "NodesNotReady")
    assert got["Degraded"][:2] == ("True", "NodesNotReady")
    assert "1 NriPluginNotConnected" in got["Degraded"][2] and "n2" in got["Degraded"][2]


def test_a_node_not_reporting_yet_is_not_ready_but_not_degraded() -> None:
    got = conditions(
        compute_status(
            config=spec(), daemonset=ds(desired=1, ready=1), nodes=[node("n1", ready=None)], now=T0
        )
    )
    assert got["Ready"][:2] == ("False", "NodesNotReady")
    assert "not reporting" in got["Ready"][2]
    assert got["Degraded"][0] == "False"


def test_nodes_below_the_driver_gate_are_counted_and_named() -> None:
    nodes = [node(f"old-{i}", driver="550") for i in range(7)] + [
        node("new", driver="615"),
        node("unknown", driver=None),
    ]
    status = compute_status(config=spec(gate=615), daemonset=ds(desired=9, ready=9), nodes=nodes, now=T0)
    assert status["nodesBelowMinDriver"] == 7
    degraded = conditions(status)["Degraded"]
    assert degraded[:2] == ("True", "NodesBelowMinDriver")
    assert "7 nodes below driver major 615" in degraded[2]
    assert "old-0, old-1, old-2, old-3, old-4 and 2 more" in degraded[2]


def test_nodes_outside_the_selector_do_not_count() -> None:
    stranger = NodeView(name="cpu", labels={DRIVER_MAJOR_LABEL: "400"}, ready="False", reason="NoUsableGpus")
    status = compute_status(
        config=spec(gate=615), daemonset=ds(desired=1, ready=1), nodes=[node("n1"), stranger], now=T0
    )
    assert status["nodesBelowMinDriver"] == 0
    assert conditions(status)["Ready"][0] == "True"


def test_no_matching_node_is_not_ready() -> None:
    got = conditions(compute_status(config=spec(), daemonset=ds(desired=0, ready=0), nodes=[], now=T0))
    assert got["Ready"][:2] == ("False", "NoMatchingNodes")


def test_a_daemonset_that_could_not_be_written_degrades() -> None:
    got = conditions(
        compute_status(
            config=spec(), daemonset=None, nodes=[node("n1")], apply_error="namespace ns not found", now=T0
        )
    )
    assert got["Degraded"][:2] == ("True", "DaemonSetApplyFailed")
    assert "namespace ns not found" in got["Degraded"][2]
    assert got["Ready"][0] == "False"


def test_transition_times_move_only_when_a_status_changes() -> None:
    first = compute_status(config=spec(), daemonset=ds(desired=1, ready=0), nodes=[node("n1")], now=T0)
    later = T0 + timedelta(minutes=5)
    second = compute_status(
        config=spec(), daemonset=ds(desired=1, ready=1), nodes=[node("n1")], previous=first, now=later
    )
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["Degraded"] == "2026-01-01T00:00:00Z"  # stayed False
    assert times["Ready"] == "2026-01-01T00:05:00Z"  # False -> True
    assert (
        compute_status(
            config=spec(),
            daemonset=ds(desired=1, ready=1),
            nodes=[node("n1")],
            previous=second,
            now=later + timedelta(1),
        )
        == second
    )
