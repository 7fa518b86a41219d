"""bench/kube_scheduler_e2e.py's inputs, checked without running the bench (issue #39): the configuration
it gives kube-scheduler is one the binary accepts, with the client limits and leader election the bench
says; the pods of both sides are ones the API server accepts and gpufrac reads as the bench says; the
figures it takes from kube-scheduler's metrics are differences between two scrapes; with DRA claims, the
claims and their pods are valid and the claims audit counts GPUs and finds unallocated or over-full ones."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from lightkube import Client, codecs
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.local.simnodes import sim_node
from gpufrac.scheduler.objects import gpu_request

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports scheduler_e2e by name, as a script does
    return importlib.import_module("kube_scheduler_e2e")


KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    "current-context": "c",
}


def test_kube_scheduler_accepts_the_bench_configuration(bench: ModuleType, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(KUBECONFIG))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(bench.kube_scheduler_config(kubeconfig)))
    written = tmp_path / "written.yaml"
    # --write-config-to decodes strictly (an unknown field fails), defaults, writes and exits.
    answer = subprocess.run(
        [str(bench.KUBE_SCHEDULER), f"--config={config}", f"--write-config-to={written}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answer.returncode == 0, answer.stderr
    effective = yaml.safe_load(written.read_text())
    assert effective["clientConnection"]["qps"] == bench.CLIENT_QPS == 5000
    assert effective["clientConnection"]["burst"] == bench.CLIENT_BURST == 5000
    assert effective["leaderElection"]["leaderElect"] is False
    assert [p["schedulerName"] for p in effective["profiles"]] == [bench.KUBE_SCHEDULER_NAME]


@pytest.mark.kube
def test_both_sides_pods_are_valid_and_read_as_the_bench_says(
    bench: ModuleType, kube: Client, namespace: str
) -> None:
    whole = bench.whole_gpu_pod(7, namespace=namespace, scheduler=bench.KUBE_SCHEDULER_NAME)
    half = bench.half_gpu_pod(7, namespace=namespace, scheduler=keys.DEFAULT_SCHEDULER_NAME)
    for pod in (whole, half):
        kube.create(pod, dry_run=True)  # the API server's validation, nothing stored
        taint = sim_node(name="n").spec.taints[0]
        assert any(t.key == taint.key and t.effect == taint.effect for t in pod.spec.tolerations)
    (one,) = gpu_request(whole).containers
    assert one.exclusive and one.device_count == 1
    (part,) = gpu_request(half).containers
    assert not part.exclusive and part.request is not None and part.request.portion == 0.5
    assert {s.name: (s.ours, s.theirs) for s in bench.SCENARIOS.values()} == {
        "whole": (bench.whole_gpu_pod, bench.whole_gpu_pod),
        "fraction": (bench.half_gpu_pod, bench.whole_gpu_pod),
        "claims": (importlib.import_module("dra_claims").claim_pod,) * 2,
    }
    assert isinstance(whole, Pod)
    # --rules: a share of the same pods carry anti-affinity or a zone spread, still valid, still asking
    ruled = bench.with_rules(bench.whole_gpu_pod, share=0.5)
    pods = [ruled(i, namespace=namespace, scheduler=bench.KUBE_SCHEDULER_NAME) for i in range(12)]
    with_rules = [p for p in pods if p.spec.affinity or p.spec.topologySpreadConstraints]
    assert with_rules and len(with_rules) < len(pods)
    for pod in with_rules[:2]:
        kube.create(pod, dry_run=True)
        assert gpu_request(pod).containers[0].device_count == 1


def test_peer_metrics_are_what_the_burst_added(bench: ModuleType) -> None:
    def samples(algorithm: float, pods: int, posts: int, post_s: float) -> dict:
        return {
            ("scheduler_scheduling_algorithm_duration_seconds_sum", ()): algorithm,
            ("scheduler_scheduling_algorithm_duration_seconds_count", ()): pods,
            ("scheduler_schedule_attempts_total", (("profile", "p"), ("result", "scheduled"))): pods,
            ("scheduler_schedule_attempts_total", (("profile", "p"), ("result", "error"))): 3,
            ("rest_client_request_duration_seconds_count", (("host", "h"), ("verb", "POST"))): posts,
            ("rest_client_request_duration_seconds_sum", (("host", "h"), ("verb", "POST"))): post_s,
            ("rest_client_request_duration_seconds_count", (("host", "h"), ("verb", "GET"))): 1000,
        }

    got = bench.peer_metrics(samples(1.0, 10, 5, 0.5), samples(3.0, 1010, 2005, 40.5), seconds=4.0)
    assert got["scheduled"] == 1000
    assert got["algorithm_ms_per_pod"] == 2.0
    assert got["algorithm_busy"] == 0.5
    assert got["posts"] == 2000 and got["post_ms_mean"] == 20.0
    assert got["client_throttle_s"] == 0
    assert got["attempt_ms_mean"] is None  # never observed: no figure rather than a zero


def test_loop_lag_is_what_the_burst_added_and_names_a_busy_loop(bench: ModuleType) -> None:
    """The loop-lag figures are differences of two scrapes of the histogram; a side whose loop ran its
    timer late is said to be limited by its loop, one that read answers as they came by the API server."""
    before = {"count": 100, "sum": 0.5, "le=0.05": 100, "le=0.1": 100}
    after = {"count": 300, "sum": 8.5, "le=0.05": 220, "le=0.1": 280}
    between = sys.modules["scheduler_e2e"].loop_lag_between  # imported by the bench, as a script does
    lag = between(before, after)
    assert lag == {"samples": 200, "mean_ms": 40.0, "over_50ms": 0.4, "over_100ms": 0.1}
    assert between(before, before)["mean_ms"] is None  # no sample, no figure

    side = {
        "seconds": 10.0,
        "pods": 1000,
        "scheduler_cpu_ms_per_pod": 3.0,
        "control_plane_cpu_ms_per_pod": 5.0,
        "machine_cpu_busy": 0.6,
    }
    assert bench.limited_by(side | {"scheduler_loop_lag": lag}).startswith("its own event loop")
    quiet = {"samples": 200, "mean_ms": 1.5, "over_50ms": 0.0, "over_100ms": 0.0}
    said = bench.limited_by(side | {"scheduler_loop_lag": quiet})
    assert said.startswith("waiting on the API server") and "answers read as they came" in said
    assert bench.limited_by(side).startswith("waiting on the API server")  # no lag figures: as before


def test_the_claims_audit_counts_gpus_and_finds_what_is_wrong(bench: ModuleType) -> None:
    claims_module = importlib.import_module("dra_claims")

    def claim(name: str, *results: tuple[str, str, str]) -> dict:
        allocated = [{"pool": p, "device": d, "consumedCapacity": {"memory": m}} for p, d, m in results]
        status = {"allocation": {"devices": {"results": allocated}}} if allocated else {}
        return {"metadata": {"name": name}, "status": status}

    capacity = {("n1", "gpu-a"): 81920, ("n1", "gpu-b"): 81920, ("n2", "gpu-a"): 81920}
    packed = [claim("c1", ("n1", "gpu-a", "40Gi")), claim("c2", ("n1", "gpu-a", "40Gi"))]
    got = claims_module.audit_claims(packed, capacity)
    assert got["audit_ok"] and got["claims_allocated"] == 2
    assert (got["gpus_used"], got["nodes_used"], got["gpu_memory_allocated_pct"]) == (1, 1, 100.0)
    spread = [claim("c1", ("n1", "gpu-a", "40Gi")), claim("c2", ("n2", "gpu-a", "40Gi"))]
    assert claims_module.audit_claims(spread, capacity)["gpus_used"] == 2
    over = [*packed, claim("c3", ("n1", "gpu-a", "10Gi")), claim("c4")]
    got = claims_module.audit_claims(over, capacity)
    assert not got["audit_ok"] and got["claims_allocated"] == 3
    assert got["audit_problems"] == ["1 claims not allocated", "n1/gpu-a: 92160 MiB of 81920"]


@pytest.mark.kube
def test_the_claims_and_their_pods_are_valid(bench: ModuleType, kube: Client, namespace: str) -> None:
    claims_module = importlib.import_module("dra_claims")
    bodies = [
        claims_module.claim_body(i, namespace=namespace) for i in range(len(claims_module.CLAIM_MEMORY))
    ]
    for body in bodies:
        kube.create(codecs.from_dict(body), dry_run=True)
    asked = [b["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] for b in bodies]
    assert asked == list(claims_module.CLAIM_MEMORY)
    pod = claims_module.claim_pod(3, namespace=namespace, scheduler=bench.KUBE_SCHEDULER_NAME)
    kube.create(pod, dry_run=True)
    assert pod.spec.resourceClaims[0].resourceClaimName == claims_module.claim_name(3) == "c00003"
    assert bench.SCENARIOS["claims"].claims and bench.SCENARIOS["claims"].ours is claims_module.claim_pod


@pytest.mark.kube
def test_a_tiny_claims_run_allocates_every_claim_on_both_sides() -> None:
    tiny = ["--scenarios", "claims", "--nodes", "3", "--gpus", "2", "--pods", "6", "--rounds", "1"]
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "kube_scheduler_e2e.py"),
            *tiny,
            "--concurrency",
            "4",
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    claims = json.loads(done.stdout.strip().splitlines()[-1])["scenarios"]["claims"]
    assert claims["all_bound"] and claims["audit_ok"]  # every claim allocated, no GPU over its memory
    (one,) = claims["rounds"]
    for side in ("gpufrac", "kube_scheduler"):
        # 110Gi of claims need at least two 80Gi GPUs; the audit counted the GPUs the allocations name.
        assert 2 <= one[side]["gpus_used"] <= 6
        assert round(one[side]["claims_per_gpu"] * one[side]["gpus_used"]) == 6
