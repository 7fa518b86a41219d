"""End to end: a synthetic trace replayed through the engine, and ``gpufrac simulate`` as a user runs it."""

from __future__ import annotations

import json

import numpy as np
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
