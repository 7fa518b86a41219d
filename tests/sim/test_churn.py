"""The churn replay: departures free room, and reclaim shortens the wait of a queue below its share."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.sim.churn import churn_replay, deserved_shares
from gpufrac.sim.trace import TraceNode, TracePod, load_pods


def trace_pod(name: str, qos: str, milli: int, created: int, deleted: int) -> TracePod:
    return TracePod(name, 1000, 1024, 1, milli, qos=qos, created=created, deleted=deleted)


# One node of two GPUs. BE: two whole GPUs for 100 s from t=0. LS: half a GPU for 400 s from t=10.
# GPU-time: BE 2 x 1000 x 100, LS 500 x 400: each deserves half the cluster.
NODES = [TraceNode("n0", 64_000, 262_144, 2, "T4")]
PODS = [
    trace_pod("be-0", "BE", 1000, 0, 100),
    trace_pod("be-1", "BE", 1000, 0, 100),
    trace_pod("ls-0", "LS", 500, 10, 410),
]


def by_queue(result):
    return {q.queue: q for q in result.queues}


def test_shares_come_from_each_qos_class_gpu_time() -> None:
    assert deserved_shares(PODS) == {"BE": 0.5, "LS": 0.5}


def test_without_reclaim_the_queue_below_its_share_waits_for_a_departure() -> None:
    result = churn_replay(nodes=NODES, pods=PODS, policy="binpack", seed=0, reclaim=False)
    queues = by_queue(result)
    assert queues["LS"].pending_p50_s == 90.0  # started when the BE pods left at t=100
    assert result.preemptions == 0 and result.started == 3


def test_with_reclaim_it_starts_at_once_and_the_queue_above_its_share_loses_one_pod() -> None:
    result = churn_replay(nodes=NODES, pods=PODS, policy="binpack", seed=0, reclaim=True)
    queues = by_queue(result)
    assert queues["LS"].pending_p50_s == 0.0
    assert queues["BE"].preempted == 1 and queues["LS"].preempted == 0
    assert result.started == 3  # the victim ran again later, with the time it had left


def test_a_pod_list_without_times_is_refused_with_the_reason() -> None:
    untimed = [TracePod("p", 1000, 1024, 1, 500)]
    with pytest.raises(ValueError, match="no creation_time/deletion_time"):
        churn_replay(nodes=NODES, pods=untimed, policy="binpack", seed=0, reclaim=False)


def test_the_openb_pod_lists_carry_creation_and_deletion_times(tmp_path) -> None:
    csv = tmp_path / "pods.csv"
    csv.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
        "scheduled_time\nopenb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061\n"
    )
    (pod,) = load_pods(csv)
    assert (pod.created, pod.deleted, pod.qos) == (427061, 12902960, "LS")


def test_simulate_churn_reports_each_reclaim_rule_per_queue(tmp_path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
        + "".join(
            f"{p.name},{p.cpu_milli},{p.memory_mib},{p.num_gpu},{p.gpu_milli},,{p.qos},Running,{p.created},{p.deleted}\n"
            for p in PODS
        )
    )
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\n")
    args = ["simulate", "--trace", str(pods), "--nodes", str(nodes), "--policy", "binpack", "--seeds", "0"]
    png = tmp_path / "churn.png"
    result = CliRunner().invoke(app, [*args, "--churn", "--json", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["plot"] == str(png) and png.stat().st_size > 0
    runs = out["runs"]
    # Three runs: reclaim off, against deserved quotas (before #36), against fair shares.
    # Allocation against fair share over time: with reclaim, LS holds a quarter of the GPU memory
    # (half a GPU of two) from t=10, where without it holds nothing until t=100.
    at_50 = [next(shares for t, shares in r["timeline"] if t >= 50) for r in runs]
    assert [s["LS"] for s in at_50] == [0.0, pytest.approx(0.25, abs=1e-3), pytest.approx(0.25, abs=1e-3)]
    assert [(r["reclaim_rule"], r["preemptions"]) for r in runs] == [
        ("", 0),
        ("deserved", 1),
        ("fair-share", 1),
    ]
    ls = [next(q for q in r["queues"] if q["queue"] == "LS") for r in runs]
    assert [q["pending_p50_s"] for q in ls] == [90.0, 0.0, 0.0]
    # LS's fair share from t=10 is its demand, a quarter of the memory: without reclaim it holds none of
    # it for 90 s, and its half GPU would have fitted within it all that time.
    assert [q["starved_s"] for q in ls] == [90.0, 0.0, 0.0]
    table = CliRunner().invoke(app, [*args, "--churn", "--no-plot", "--churn-reclaim", "deserved,fair-share"])
    assert table.exit_code == 0, table.output
    assert "reclaim per run" in table.output and "Jain" in table.output
    bad = CliRunner().invoke(app, [*args, "--churn", "--churn-reclaim", "old"])
    assert bad.exit_code == 2 and "a comma list of off, fair-share, deserved" in bad.output
    bad = CliRunner().invoke(app, [*args, "--churn", "--churn-cluster", "0"])
    assert bad.exit_code == 2 and "cluster=0.0 must be a fraction in (0, 1]" in bad.output


# One node of two T4s, one queue. At t=0 a fixed half and a movable 0.3 share a GPU (0.2 free) and a
# 0.6 takes the other (0.4 free). At t=10 a half arrives: 0.6 GPU of memory is free, in two pieces.
FRAGMENTED = [
    trace_pod("half", "LS", 500, 0, 1000),
    trace_pod("small", "LS", 300, 0, 1000),
    trace_pod("big", "LS", 600, 0, 1000),
    trace_pod("late", "LS", 500, 10, 500),
]


def test_consolidation_moves_the_small_pod_and_the_late_one_starts_at_once() -> None:
    common = {"nodes": NODES, "pods": FRAGMENTED, "policy": "binpack", "seed": 0, "reclaim": False}
    without = churn_replay(**common)
    assert without.moves == 0 and without.pending_p99_s > 900  # the late pod waits for t=1000
    # Every pod movable: only the 0.3 has a home elsewhere (the 0.4 left on the other GPU).
    moved = churn_replay(**common, consolidation=True, movable_share=1.0)
    assert moved.moves == 1 and moved.queues[0].moved == 1
    assert moved.pending_p99_s == 0.0 and moved.started == 4
    # No pod movable: the same wait as without consolidation.
    kept = churn_replay(**common, consolidation=True, movable_share=0.0)
    assert kept.moves == 0 and kept.pending_p99_s == without.pending_p99_s
    with pytest.raises(ValueError, match="per_minute=0 must be at least 1"):
        churn_replay(**common, consolidation=True, max_moves_per_minute=0)


def test_simulate_consolidation_goes_with_churn_only(tmp_path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--consolidation"])
    assert result.exit_code == 2 and "--consolidation goes with --churn" in result.output
