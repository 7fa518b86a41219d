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


def test_simulate_churn_reports_both_runs_per_queue(tmp_path) -> None:
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
    # Allocation against fair share over time: with reclaim, LS holds a quarter of the GPU memory
    # (half a GPU of two) from t=10, where without it holds nothing until t=100.
    at_50 = [next(shares for t, shares in r["timeline"] if t >= 50) for r in runs]
    assert [s["LS"] for s in at_50] == [0.0, pytest.approx(0.25, abs=1e-3)]
    assert [(r["reclaim"], r["preemptions"]) for r in runs] == [(False, 0), (True, 1)]
    ls = [next(q for q in r["queues"] if q["queue"] == "LS") for r in runs]
    assert [q["pending_p50_s"] for q in ls] == [90.0, 0.0]
    bad = CliRunner().invoke(app, [*args, "--churn", "--churn-cluster", "0"])
    assert bad.exit_code == 2 and "cluster=0.0 must be a fraction in (0, 1]" in bad.output
