"""CPU-heavier variants of the default list: sampled as the published cpuXXX lists are, and fixed."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import astuple, replace

import pytest

from gpufrac.sim.trace import TracePod
from gpufrac.sim.variants import VARIANTS, cpu_heavier, variant


def _list() -> list[TracePod]:
    cpu_only = [TracePod(f"c{i}", 1000 * (i + 1), 2048, 0, 0) for i in range(10)]
    gpu = [TracePod(f"g{i}", 4000, 8192, 1, 100 * (i + 1)) for i in range(7)]
    # Interleaved, as in the published default list.
    return [p for pair in zip(cpu_only, gpu + [None] * 3, strict=True) for p in pair if p is not None]


def _shape(p: TracePod) -> tuple:
    return astuple(replace(p, name=""))


def test_twice_as_many_cpu_only_pods_every_one_twice_gpu_pods_unchanged_and_in_order():
    base = _list()
    out = cpu_heavier(base, 2.0)
    cpu_only = [p for p in out if p.num_gpu == 0]
    once = Counter(_shape(p) for p in base if p.num_gpu == 0)
    assert Counter(map(_shape, cpu_only)) == once + once
    # As in cpu050/cpu100: CPU-only pods first, then every GPU pod in the base list's order.
    assert out[: len(cpu_only)] == cpu_only
    assert [_shape(p) for p in out[len(cpu_only) :]] == [_shape(p) for p in base if p.num_gpu]
    assert [p.name for p in out] == [f"openb-pod-{i:04d}" for i in range(len(out))]


def test_two_and_a_half_times_draws_the_half_without_replacement_and_is_fixed():
    base = _list()
    out = cpu_heavier(base, 2.5)
    counts = Counter(_shape(p) for p in out if p.num_gpu == 0)
    assert sum(counts.values()) == 25
    assert sorted(counts.values()) == [2] * 5 + [3] * 5  # the extra half: five distinct pods
    assert cpu_heavier(base, 2.5) == out  # one fixed list, like a published file
    assert cpu_heavier(base, 2.5, seed=7) != out


def test_named_variants_and_bad_input():
    assert set(VARIANTS) == {"cpu2x", "cpu2.5x"}
    assert len([p for p in variant("cpu2.5x", _list()) if p.num_gpu == 0]) == 25
    with pytest.raises(ValueError, match=re.escape("unknown variant 'cpu3x'; known: cpu2x, cpu2.5x")):
        variant("cpu3x", _list())
    with pytest.raises(ValueError, match="times must be a finite number >= 0, got -1"):
        cpu_heavier(_list(), -1)


def test_simulate_replays_a_variant_sampled_from_the_default_list(tmp_path):
    import json

    from typer.testing import CliRunner

    from gpufrac.cli import app
    from gpufrac.sim.synthetic import synthetic_trace
    from gpufrac.sim.trace import GPU_NODE_FILE, save_nodes, save_pods

    nodes, pods = synthetic_trace(seed=11, nodes=10, pods=100)
    save_nodes(tmp_path / GPU_NODE_FILE, nodes)
    save_pods(tmp_path / "openb_pod_list_default.csv", pods)  # no cpu2x file: it is sampled from default
    args = ["simulate", "--trace", "cpu2x", "--data-dir", str(tmp_path), "--policy", "fgd", "--seeds", "1"]
    result = CliRunner().invoke(app, [*args, "--workers", "1", "--no-plot", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["trace"] == "cpu2x" and [r["policy"] for r in out["runs"]] == ["fgd"]
