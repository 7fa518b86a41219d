"""The openb trace expressed as DRA claims (scenario ``claims``): what it changes against annotation pods
(only the rounding of a share to whole MiB), and ``gpufrac simulate`` comparing ours with the stock model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.contract.request import GpuMemory
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.demand import resolve_mib
from gpufrac.placement.engine import Engine
from gpufrac.sim.scenarios import prepare
from gpufrac.sim.synthetic import synthetic_trace
from gpufrac.sim.trace import GPU_MIB, TraceNode, TracePod, save_nodes, save_pods
from gpufrac.sim.workload import PodFactory, gpu_request, node_spec


def tp(name: str, num: int, milli: int) -> TracePod:
    return TracePod(name, 1000, 1024, num, milli)


def test_a_claims_share_rounds_up_where_an_annotation_pods_rounds_down():
    half = GpuMemory(portion=0.5)
    assert half.resolve(15109) == 7554  # T4: 7554.5 MiB
    assert GpuMemory(portion=0.5, round_up=True).resolve(15109) == 7555
    # Whole amounts stay whole despite float noise.
    assert 0.07 * 100 > 7 and GpuMemory(portion=0.07, round_up=True).resolve(100) == 7
    assert resolve_mib(GpuMemory(portion=0.07, round_up=True), np.array([100])).tolist() == [7]
    # The vectorised resolution the engine filters with is the same arithmetic, on every openb GPU size.
    caps = np.array(sorted(set(GPU_MIB.values())), dtype=np.int64)
    for milli in range(1, 1000):
        for round_up in (False, True):
            memory = GpuMemory(portion=milli / 1000, round_up=round_up)
            assert resolve_mib(memory, caps).tolist() == [memory.resolve(int(c)) for c in caps]
            exact = [milli * int(c) / 1000 for c in caps]
            expected = [-(-milli * int(c) // 1000) if round_up else milli * int(c) // 1000 for c in caps]
            assert resolve_mib(memory, caps).tolist() == [max(1, e) for e in expected], (milli, exact)


def test_round_up_is_for_portions_only():
    with pytest.raises(ValueError, match=r"GpuMemory\(mib=512\): round_up applies to a portion"):
        GpuMemory(mib=512, round_up=True)


def test_two_half_gpu_claims_do_not_fit_a_t4_where_two_annotation_pods_do():
    """The expression as claims changes what is placed: 2 x 7555 MiB > 15109 MiB >= 2 x 7554 MiB."""
    t4 = TraceNode("t4-node", 32_000, 65_536, 1, "T4")
    for scenario, fits in (("plain", True), ("claims", False)):
        engine = Engine(policy="kube-dra")
        engine.add_node(node_spec(t4))
        make = PodFactory()
        halves = prepare([tp("a", 1, 500), tp("b", 1, 500)], scenario)
        first, second = (engine.place(make(p, i)) for i, p in enumerate(halves))
        assert isinstance(first, Placement)
        assert isinstance(second, Placement if fits else Unschedulable), scenario


def test_whole_gpu_and_cpu_only_pods_are_the_same_as_claims():
    plain = [tp("whole", 2, 1000), tp("cpu", 0, 0)]
    assert [gpu_request(p) for p in prepare(plain, "claims")] == [gpu_request(p) for p in plain]
    (share,) = gpu_request(prepare([tp("s", 2, 460)], "claims")[0]).containers
    assert share.request == GpuMemory(portion=0.46, round_up=True) and share.device_count == 2


def test_simulate_compares_ours_with_the_stock_model_on_claims(tmp_path):
    nodes, pods = synthetic_trace(seed=11, nodes=10, pods=100)
    save_nodes(tmp_path / "nodes.csv", nodes)
    save_pods(tmp_path / "pods.csv", pods)
    args = ["simulate", "--trace", str(tmp_path / "pods.csv"), "--nodes", str(tmp_path / "nodes.csv")]
    args += ["--seeds", "1", "--policy", "fgd-plus,kube-dra", "--scenario", "claims", "--workers", "1"]
    result = CliRunner().invoke(app, [*args, "--no-plot", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["scenario"] == "claims"
    rows = {row["policy"]: row for row in out["policies"]}
    assert set(rows) == {"fgd-plus", "kube-dra"}
    assert all(row["paper_130"] is None and row["placed"] > 0 for row in rows.values())
    table = CliRunner().invoke(app, [*args, "--no-plot"])
    assert table.exit_code == 0 and "scenario claims" in table.stdout and "kube-dra" in table.stdout
