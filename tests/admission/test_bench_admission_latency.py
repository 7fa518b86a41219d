"""bench/admission_latency.py (issue #39): the figures it takes from the API server's histograms are what
a phase added, and a tiny run on the real API server measures each side as the bench says: the webhook
called twice per create only where its configurations select the namespace, the contract-key CEL
evaluated without a call on a plain update, the chart's policies' matchConditions only where they select."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports scheduler_e2e by name, as a script does
    return importlib.import_module("admission_latency")


def _histogram(metric: str, buckets: dict[str, float], total: float, **labels: str) -> dict:
    keyed = tuple(sorted(labels.items()))
    samples = {
        (f"{metric}_bucket", tuple(sorted({**labels, "le": le}.items()))): n for le, n in buckets.items()
    }
    count = buckets["+Inf"]
    return samples | {(f"{metric}_count", keyed): count, (f"{metric}_sum", keyed): total}


def test_a_histogram_gives_what_the_phase_added(bench: ModuleType) -> None:
    metric = bench.WEBHOOK_METRIC
    before = _histogram(
        metric, {"0.005": 10, "0.025": 10, "0.1": 10, "+Inf": 10}, 0.02, name="mutate.gpufrac.io"
    )
    # 100 more calls: 95 within 5 ms, 4 within 25 ms, 1 within 100 ms, 0.3 s in all
    after = _histogram(
        metric, {"0.005": 105, "0.025": 109, "0.1": 110, "+Inf": 110}, 0.32, name="mutate.gpufrac.io"
    )
    other = _histogram(metric, {"0.005": 7, "+Inf": 7}, 1.0, name="validate.gpufrac.io")
    got = bench.histogram(before, after | other, metric, name="mutate.gpufrac.io")
    assert got == {"count": 100, "mean_ms": 3.0, "within_5ms": 0.95, "p99_at_most_ms": 25.0}
    assert bench.histogram(before, before, metric, name="mutate.gpufrac.io") is None  # nothing added


@pytest.mark.kube
def test_a_tiny_run_measures_each_side_as_it_says(tmp_path: Path) -> None:
    tiny = ["--rounds", "1", "--serial", "4", "--pods", "6", "--concurrency", "3", "--updates", "4"]
    done = subprocess.run(
        [sys.executable, str(BENCH / "admission_latency.py"), *tiny],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (one,) = result["every_round"]
    for side in ("none", "webhook", "policies"):
        assert one[side]["serial"]["n"] == 4 and one[side]["burst"]["n"] == 6
        assert one[side]["update_plain"]["n"] == one[side]["update_binder"]["n"] == 4
    calls = {
        side: {
            phase: {
                k: v["count"] for k, v in one[side][phase]["api_server"].items() if k.startswith("webhook")
            }
            for phase in ("serial", "update_plain", "update_binder")
        }
        for side in ("none", "webhook", "policies")
    }
    # No gpufrac in the path of the first side; two calls per create on the others, none for a plain update
    # (the CEL match keeps it away), one validation per binder write.
    assert calls["none"] == {"serial": {}, "update_plain": {}, "update_binder": {}}
    for side in ("webhook", "policies"):
        assert calls[side]["serial"] == {"webhook mutate.gpufrac.io": 4, "webhook validate.gpufrac.io": 4}
        assert calls[side]["update_plain"] == {}
        assert calls[side]["update_binder"] == {"webhook validate.gpufrac.io": 4}
        assert one[side]["update_plain"]["api_server"]["match_conditions webhook"]["count"] >= 4
        spans = one[side]["serial"]["webhook_spans"]
        assert spans["request_ms /mutate"]["n"] == spans["request_ms /validate"]["n"] == 4
        assert spans["answer_ms /mutate"]["n"] == spans["answer_ms /validate"]["n"] == 4
    # The policies' plugin runs for every pod write; only on the third side do their matchConditions run.
    assert one["none"]["update_binder"]["api_server"]["policy_plugin"]["count"] >= 4
    assert "match_conditions policy" not in one["webhook"]["update_plain"]["api_server"]
    assert one["policies"]["update_plain"]["api_server"]["match_conditions policy"]["count"] >= 4
    assert result["goal"].startswith("webhook adds < 5.0 ms p99") and result["why"]


def test_a_direct_run_times_the_webhook_alone() -> None:
    """``--direct``: every call answered 200 (the bench raises otherwise), each timed, and the webhook's
    spans count the same calls, the warm-up's included."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "admission_latency.py"), "--direct", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["round_trip"]) == {"/mutate", "/validate"}
    assert all(0 < t["p50_ms"] <= t["p99_ms"] for t in result["round_trip"].values())
    spans = result["webhook_spans"]
    assert spans["answer_ms /mutate"]["n"] == spans["answer_ms /validate"]["n"] == 11
    assert spans["decide_ms /mutate"]["n"] == 11


def test_a_scrape_keeps_every_sample_of_the_families_it_reads_and_nothing_else(bench: ModuleType) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    exposition = "\n".join(
        [
            "# HELP apiserver_request_total Counter of apiserver requests.",
            "# TYPE apiserver_request_total counter",
            'apiserver_request_total{code="201",verb="POST"} 12',
            f"# HELP {bench.WEBHOOK_METRIC} Admission webhook latency.",
            f"# TYPE {bench.WEBHOOK_METRIC} histogram",
            f'{bench.WEBHOOK_METRIC}_bucket{{name="mutate.gpufrac.io",le="0.005"}} 3',
            f'{bench.WEBHOOK_METRIC}_bucket{{name="mutate.gpufrac.io",le="+Inf"}} 4',
            f'{bench.WEBHOOK_METRIC}_sum{{name="mutate.gpufrac.io"}} 0.03',
            f'{bench.WEBHOOK_METRIC}_count{{name="mutate.gpufrac.io"}} 4',
            "# a comment line",
            "process_cpu_seconds_total 7.5",
            f"# TYPE {bench.PLUGIN_METRIC} histogram",
            f'{bench.PLUGIN_METRIC}_count{{name="ValidatingAdmissionPolicy"}} 9',
            "",
        ]
    )

    def samples(text: str) -> dict:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    everything = samples(exposition)
    kept = samples(bench.only_families(exposition, bench.SCRAPED))
    assert kept == {k: v for k, v in everything.items() if k[0].startswith(bench.SCRAPED)}
    assert len(kept) == 5 and ("process_cpu_seconds_total", ()) not in kept
