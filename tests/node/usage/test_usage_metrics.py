"""The Prometheus endpoint as a scraper sees it: real HTTP, parsed exposition text."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.node.metrics import (
    OVER_LIMIT,
    EnforcementCounters,
    MetricsServer,
    UsageExporter,
    UsageReporter,
    registry_for,
)
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

GIB = 1024**3
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
A, B = "a" * 64, "b" * 64


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def series(samples, name: str, **labels) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


@pytest.fixture
def agent(proc, allocations):
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * GIB)
    counters = EnforcementCounters()
    exporter = UsageExporter(node="gpu-node-1", counters=counters)
    reporter = UsageReporter(
        collector=UsageCollector(backend=gpus, allocations=allocations, proc_root=proc.root),
        exporter=exporter,
        counters=counters,
        interval=0.05,
    )
    server = MetricsServer(registry=registry_for(exporter), host="127.0.0.1", port=0)
    try:
        yield gpus, counters, reporter, server.port
    finally:
        server.close()


def test_scrape_shows_each_fraction_with_request_limit_used_and_compute(agent, proc, record, allocations):
    gpus, _, reporter, port = agent
    for placed in [
        record(container_id=A, pod_name="infer", devices=[GPU0], request_mib=10240, limit_mib=20480),
        record(container_id=B, pod_name="idle", devices=[GPU0], request_mib=2048),
    ]:
        allocations.put(placed)
    proc.containerd_v2(pid=7, container_id=A)
    proc.containerd_v2(pid=8, container_id=A)
    gpus.set_process(gpu=GPU0, pid=7, used_bytes=3 * GIB, sm_ratio=0.25)
    gpus.set_process(gpu=GPU0, pid=8, used_bytes=1 * GIB, sm_ratio=0.25)
    reporter.collect_once()

    s = scrape(port)

    infer = {
        "namespace": "team-a",
        "pod": "infer",
        "container": "main",
        "gpu_uuid": GPU0,
        "node": "gpu-node-1",
    }
    assert series(s, "gpufrac_fraction_memory_used_bytes", **infer) == 4 * GIB
    assert series(s, "gpufrac_fraction_memory_request_bytes", **infer) == 10 * GIB
    assert series(s, "gpufrac_fraction_memory_limit_bytes", **infer) == 20 * GIB
    assert series(s, "gpufrac_fraction_sm_utilization_ratio", **infer) == 0.5
    assert series(s, "gpufrac_fraction_compute_entitlement_ratio", **infer) == 1.0
    assert series(s, "gpufrac_fraction_compute_received_ratio", **infer) == 1.0
    assert series(s, "gpufrac_fraction_processes", **infer) == 2
    idle = {**infer, "pod": "idle"}
    assert series(s, "gpufrac_fraction_memory_used_bytes", **idle) == 0
    assert series(s, "gpufrac_fraction_sm_utilization_ratio", **idle) == 0
    assert series(s, "gpufrac_fraction_memory_request_bytes", **idle) == 2 * GIB
    assert series(s, "gpufrac_gpu_memory_allocated_bytes", gpu_uuid=GPU0) == 12 * GIB
    assert series(s, "gpufrac_gpu_memory_used_bytes", gpu_uuid=GPU0) == 4 * GIB
    assert series(s, "gpufrac_gpu_memory_total_bytes", gpu_uuid=GPU0) == 80 * GIB


def test_series_of_a_removed_container_disappear_at_the_next_collection(agent, proc, record, allocations):
    _, _, reporter, port = agent
    allocations.put(record(container_id=A, pod_name="short-lived", devices=[GPU0], request_mib=1))
    reporter.collect_once()
    assert any(ls and ("pod", "short-lived") in ls for (_, ls) in scrape(port))

    allocations.remove(A)
    reporter.collect_once()

    assert not any(("pod", "short-lived") in ls for (_, ls) in scrape(port))


def test_counters_start_at_zero_and_count_what_the_audit_and_mps_supervisor_report(agent):
    _, counters, reporter, port = agent
    reporter.collect_once()
    before = scrape(port)
    for kind in ("missing_injection", "unknown_process", "over_limit"):
        assert series(before, "gpufrac_enforcement_violations_total", kind=kind) == 0
    assert series(before, "gpufrac_mps_restarts_total") == 0

    counters.violation(kind=OVER_LIMIT)
    counters.violation(kind=OVER_LIMIT)
    counters.mps_restarted()
    counters.mps_wedged()

    after = scrape(port)
    assert series(after, "gpufrac_enforcement_violations_total", kind="over_limit") == 2
    assert series(after, "gpufrac_mps_restarts_total") == 1
    assert series(after, "gpufrac_mps_wedges_total") == 1


async def test_reporter_collects_every_interval_and_survives_a_failing_cycle(proc, allocations):
    failures = {"left": 1}

    class FlakyStore:
        def allocations(self):
            if failures["left"]:
                failures["left"] -= 1
                raise OSError("mapping store unreadable")
            return allocations.allocations()

    counters = EnforcementCounters()
    seen = []
    reporter = UsageReporter(
        collector=UsageCollector(backend=SimulatedUsage(), allocations=FlakyStore(), proc_root=proc.root),
        exporter=UsageExporter(node="n", counters=counters),
        counters=counters,
        interval=0.05,
        listeners=[seen.append],
    )
    task = asyncio.create_task(reporter.run())
    try:
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(seen) >= 3
    assert counters.read().collection_errors == 1


def test_mps_restart_events_are_counted_and_still_reach_the_node(agent):
    from gpufrac.node.metrics import CountingMpsEvents
    from gpufrac.node.mps.events import REASON_RESTARTED, REASON_WEDGED

    _, counters, reporter, port = agent
    forwarded = []

    class NodeSink:
        def emit(self, *, type: str, reason: str, message: str) -> None:
            forwarded.append(reason)

    events = CountingMpsEvents(sink=NodeSink(), counters=counters)
    events.emit(type="Warning", reason=REASON_RESTARTED, message="exited; restart 1")
    events.emit(type="Warning", reason=REASON_WEDGED, message="wedged; restart 2")
    reporter.collect_once()

    s = scrape(port)
    assert (series(s, "gpufrac_mps_restarts_total"), series(s, "gpufrac_mps_wedges_total")) == (2, 1)
    assert forwarded == [REASON_RESTARTED, REASON_WEDGED]
