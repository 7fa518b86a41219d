"""The published protocol's workload, the translation of trace rows, and the metrics, by hand."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from gpufrac.contract.keys import GPU_MODEL_LABEL
from gpufrac.contract.request import GpuMemory
from gpufrac.placement.model import SelectorOperator
from gpufrac.sim import trace as trace_module
from gpufrac.sim.experiment import parse_policies, parse_seeds
from gpufrac.sim.metrics import allocation_at, curve, unallocated_gpus
from gpufrac.sim.scenarios import prepare
from gpufrac.sim.trace import TraceNode, TracePod, default_data_dir, load_pods, pod_file, save_pods
from gpufrac.sim.workload import affinity, gpu_request, inflate, node_spec, typical_pods


def tp(name: str, num: int, milli: int, cpu: int = 1000, spec: tuple[str, ...] = ()) -> TracePod:
    return TracePod(name, cpu, 1024, num, milli, spec)


def test_inflate_appends_draws_until_the_next_would_pass_the_target():
    pods = [tp("a", 1, 500), tp("b", 1, 1000), tp("c", 0, 0), tp("d", 2, 1000)]
    seq = inflate(pods, seed=42, capacity=10_000)
    total = sum(p.gpu_total_milli for p in seq)
    assert total <= 13_000
    assert Counter(p.name for p in seq[:4]) == Counter("abcd")  # each original pod once, shuffled
    assert seq == inflate(pods, seed=42, capacity=10_000)
    assert seq != inflate(pods, seed=43, capacity=10_000)
    # The draw that stopped it would have passed 1.3x: replaying the generator shows it.
    rng = np.random.default_rng(42)
    rng.permutation(len(pods))
    for _ in range(len(seq) - 4):
        rng.integers(len(pods))
    stopper = pods[int(rng.integers(len(pods)))]
    assert total + stopper.gpu_total_milli > 13_000


def test_inflate_removes_random_pods_from_a_list_above_target():
    pods = [tp(f"p{i}", 1, 1000) for i in range(20)]
    seq = inflate(pods, seed=1, capacity=10_000)
    assert sum(p.gpu_total_milli for p in seq) == 13_000
    assert len(set(p.name for p in seq)) == 13


def test_translation_of_rows():
    share = gpu_request(tp("s", 1, 460)).containers[0]
    assert share.request == GpuMemory(portion=0.46) and not share.exclusive and share.device_count == 1
    multi = gpu_request(tp("m", 8, 1000)).containers[0]
    assert multi.exclusive and multi.device_count == 8
    assert not gpu_request(tp("c", 0, 0)).wants_gpu
    (term,) = affinity(tp("x", 1, 1000, spec=("V100M16", "V100M32")))
    (req,) = term.match_expressions
    assert (req.key, req.operator, req.values) == (
        GPU_MODEL_LABEL,
        SelectorOperator.IN,
        ("V100M16", "V100M32"),
    )
    spec = node_spec(TraceNode("n", 32000, 1024, 2, "T4"))
    assert [g.memory_mib for g in spec.gpus] == [15109, 15109] and spec.labels[GPU_MODEL_LABEL] == "T4"
    assert spec.memory_bytes == 1024 << 20


def test_typical_pods_cover_95_percent_then_renormalise():
    pods = [tp(f"a{i}", 1, 500) for i in range(60)] + [tp(f"b{i}", 1, 1000) for i in range(36)]
    pods += [tp(f"c{i}", 0, 0, cpu=2000) for i in range(3)] + [tp("d", 8, 1000)]
    typical = typical_pods(pods)
    assert len(typical.pods) == 2  # 60% + 36% = 96% >= 95%
    assert typical.weights == pytest.approx([60 / 96, 36 / 96])


def test_allocation_at_uses_events_whose_arrival_rounds_to_x():
    arrived = np.array([99.2, 99.6, 100.4, 100.6, 129.4, 129.5, 130.0])
    allocated = np.array([90.0, 91.004, 92.0, 93.0, 94.0, 95.0, 96.0])
    assert allocation_at(arrived, allocated, 100) == pytest.approx((91.0 + 92.0) / 2)
    assert allocation_at(arrived, allocated, 130) == pytest.approx(95.5)
    assert np.isnan(allocation_at(arrived, allocated, 50))
    c = curve(arrived, allocated)
    assert len(c) == 131 and c[100] == pytest.approx(91.5) and np.isnan(c[10])
    assert unallocated_gpus(95.0, 6212) == pytest.approx(310.6)


def test_mixed_scenario_is_deterministic_and_uses_both_modes():
    pods = [
        TracePod(f"p{i}", 1000, 1024, n, m, qos=q)
        for i, (n, m, q) in enumerate(
            [(1, 500, "LS"), (1, 500, "BE"), (2, 1000, "LS"), (4, 1000, "BE"), (1, 1000, "LS")]
        )
    ]
    mixed = prepare(pods, "mixed")
    assert mixed == prepare(pods, "mixed")
    assert [p.mode.value for p in mixed] == [
        "sm-sharing",
        "time-slicing",
        "sm-sharing",
        "time-slicing",
        "time-slicing",
    ]
    assert [p.gpu_milli for p in mixed] == [500, 500, 500, 1000, 1000]  # every 2nd multi-GPU pod halves
    assert len({p.namespace for p in mixed}) == 5
    with pytest.raises(ValueError):
        prepare(pods, "nope")


def test_parsers():
    assert parse_seeds("42-45") == [42, 43, 44, 45]
    assert parse_seeds("1,3, 5") == [1, 3, 5]
    assert parse_policies("all")[:2] == ["binpack", "spread"]
    with pytest.raises(ValueError):
        parse_policies("binpack,nope")


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFRAC_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    assert pod_file("default") == tmp_path / "openb_pod_list_default.csv"
    monkeypatch.delenv("GPUFRAC_DATA_DIR")
    monkeypatch.delenv("GPUFRAC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(trace_module, "checkout_data_dir", lambda: None)  # as installed: no clone around
    assert default_data_dir() == tmp_path / "cache" / "gpufrac" / "openb"
    csv_path = tmp_path / "mine.csv"
    save_pods(csv_path, [tp("a", 1, 250, spec=("T4", "A10"))])
    assert pod_file(str(csv_path)) == csv_path
    assert load_pods(csv_path) == [tp("a", 1, 250, spec=("T4", "A10"))]
