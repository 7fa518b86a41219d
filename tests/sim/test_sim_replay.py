"""End to end: a synthetic trace replayed through the engine, and ``gpufrac simulate`` as a user runs it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.sim.experiment import run_experiment
from gpufrac.sim.replay import replay
from gpufrac.sim.synthetic import synthetic_trace
from gpufrac.sim.trace import save_nodes, save_pods


def test_replay_on_a_synthetic_trace():
    nodes, pods = synthetic_trace(seed=3, nodes=40, pods=100)
    result = replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=42)
    assert result.placed + result.failed == result.pods
    assert result.placed > 0 and result.failed > 0  # 1.3x arrival: some pods cannot fit
    assert 50 < result.alloc_100 <= 100 and 50 < result.alloc_130 <= 100
    assert len(result.curve) == 131 and 0 <= result.frag_rate_end <= 100
    # The curve never allocates more than arrived.
    arrived = np.arange(131)
    assert all(np.isnan(v) or v <= x + 0.5 for x, v in zip(arrived, result.curve, strict=True))
    again = replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=42)
    assert np.array_equal(again.curve, result.curve, equal_nan=True) and again.placed == result.placed


def test_every_policy_and_both_scenarios_run():
    nodes, pods = synthetic_trace(seed=5, nodes=12, pods=120, mixed_modes=True)
    for scenario in ("plain", "mixed"):
        results = run_experiment(
            trace="syn",
            nodes=nodes,
            pods=pods,
            policies=["binpack", "spread", "kai", "fgd", "fgd-align"],
            seeds=[1],
            scenario=scenario,
        )
        assert [r.policy for r in results] == ["binpack", "spread", "kai", "fgd", "fgd-align"]
        assert all(r.placed > 0 for r in results)


def test_online_fgd_learns_without_a_prior():
    nodes, pods = synthetic_trace(seed=8, nodes=12, pods=150)
    online = replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=1, online=True)
    assert online.placed > 0


def test_simulate_command_table_json_and_plot(tmp_path):
    nodes, pods = synthetic_trace(seed=11, nodes=10, pods=100)
    save_nodes(tmp_path / "nodes.csv", nodes)
    save_pods(tmp_path / "pods.csv", pods)
    png = tmp_path / "curves.png"
    args = ["simulate", "--trace", str(tmp_path / "pods.csv"), "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--seeds", "1-2", "--policy", "binpack,fgd-align", "--workers", "1", "--plot", str(png)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["trace"] == "pods" and out["plot"] == str(png)
    assert {(r["policy"], r["seed"]) for r in out["runs"]} == {
        ("binpack", 1),
        ("binpack", 2),
        ("fgd-align", 1),
        ("fgd-align", 2),
    }
    for run in out["runs"]:
        assert {
            "alloc_100",
            "alloc_130",
            "unallocated_gpus_130",
            "placed",
            "failed",
            "placements_per_s",
        } <= set(run)
    assert png.stat().st_size > 10_000
    table = CliRunner().invoke(app, [*args, "--no-plot"])
    assert table.exit_code == 0 and "fgd-align" in table.stdout and "@130%" in table.stdout


def test_simulate_command_errors(tmp_path):
    result = CliRunner().invoke(app, ["simulate", "--trace", "nope", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "not found" in result.output
    result = CliRunner().invoke(app, ["simulate", "--policy", "bogus"])
    assert result.exit_code == 2 and "unknown policy" in result.output


def test_offline_bound_is_reported_as_a_bound_above_the_online_policies(tmp_path):
    nodes, pods = synthetic_trace(seed=11, nodes=10, pods=100)
    results = run_experiment(trace="syn", nodes=nodes, pods=pods, policies=["fgd"], seeds=[1, 2], bound=True)
    online, bound = results[:2], results[2:]
    assert [r.bound for r in results] == [False, False, True, True]
    assert all(np.isnan(b.alloc_100) for b in bound)  # no bound is claimed at 100 %
    # Known in advance and placed largest first, the same sampled workload fits better than online.
    assert all(b.alloc_130 > o.alloc_130 for b, o in zip(bound, online, strict=True))
    assert replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=1).alloc_130 == online[0].alloc_130

    save_nodes(tmp_path / "nodes.csv", nodes)
    save_pods(tmp_path / "pods.csv", pods)
    args = ["simulate", "--trace", str(tmp_path / "pods.csv"), "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--seeds", "1", "--policy", "fgd", "--workers", "1", "--no-plot", "--offline-bound"]
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "bound: offline" in table.stdout and "not a policy" in table.stdout
    out = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout.strip().splitlines()[-1])
    rows = {row["policy"]: row for row in out["policies"]}
    assert rows["offline-bound"]["bound"] is True and rows["fgd"]["bound"] is False
    assert rows["offline-bound"]["alloc_100"] is None and rows["offline-bound"]["paper_130"] is None


def test_a_window_hands_received_pods_as_one_batch():
    nodes, pods = synthetic_trace(seed=11, nodes=10, pods=100)
    one = replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=3)
    # fgd keeps arrival order inside a batch, so a window changes nothing but how pods are handed over.
    batched = replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=3, window=8)
    assert batched.placed == one.placed and batched.window == 8
    assert np.array_equal(batched.curve, one.curve, equal_nan=True)
    with pytest.raises(ValueError, match="window must be at least 1 pod, got 0"):
        replay(trace="syn", nodes=nodes, pods=pods, policy="fgd", seed=3, window=0)
