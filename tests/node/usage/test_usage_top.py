"""``gpufrac top --once`` against a live metrics endpoint, as an operator runs it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.node.metrics import (
    EnforcementCounters,
    MetricsServer,
    UsageExporter,
    UsageReporter,
    registry_for,
)
from gpufrac.node.top import metrics_url
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

GIB = 1024**3
GPU0 = "GPU-5e6f7a8b-0000-4000-8000-000000000000"


@pytest.fixture
def agent_url(proc, record, allocations):
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * GIB)
    for placed in [
        record(container_id="a" * 64, pod_name="llm-0", devices=[GPU0], request_mib=10240, limit_mib=20480),
        record(container_id="b" * 64, pod_name="quiet", devices=[GPU0], request_mib=4096),
    ]:
        allocations.put(placed)
    proc.containerd_v2(pid=9, container_id="a" * 64)
    gpus.set_process(gpu=GPU0, pid=9, used_bytes=12 * GIB, sm_ratio=0.42)
    counters = EnforcementCounters()
    exporter = UsageExporter(node="gpu-node-7", counters=counters)
    UsageReporter(
        collector=UsageCollector(backend=gpus, allocations=allocations, proc_root=proc.root),
        exporter=exporter,
        counters=counters,
    ).collect_once()
    server = MetricsServer(registry=registry_for(exporter), host="127.0.0.1", port=0)
    try:
        yield f"http://127.0.0.1:{server.port}/metrics"
    finally:
        server.close()


def rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in output.splitlines() if "│" in line]


def test_top_once_shows_each_fraction_with_request_limit_used_and_sm(agent_url):
    result = CliRunner().invoke(app, ["top", "--once", agent_url])

    assert result.exit_code == 0, result.output
    table = rows(result.output)
    llm = next(r for r in table if r[2] == "team-a/llm-0/main")
    quiet = next(r for r in table if r[2] == "team-a/quiet/main")
    assert llm[3:10] == ["time-slicing", "10.0Gi", "20.0Gi", "12.0Gi", "42", "100", "100"]
    assert quiet[3:10] == ["time-slicing", "4.0Gi", "4.0Gi", "0Mi", "0", "50", "0"]
    gpu = next(r for r in table if r[0] == "gpu-node-7")
    assert gpu[1].startswith("0 GPU-5e6f7a8b") and gpu[4] == "14.0Gi" and gpu[6] == "12.0Gi"


def test_an_unreachable_agent_is_shown_and_the_others_still_render(agent_url):
    result = CliRunner().invoke(app, ["top", "--once", agent_url, "127.0.0.1:1"])

    assert result.exit_code == 0, result.output
    assert "team-a/llm-0/main" in result.output
    assert "unreachable" in result.output


def test_top_fails_when_no_agent_answers():
    result = CliRunner().invoke(app, ["top", "--once", "127.0.0.1:1"])
    assert result.exit_code == 1
    assert "unreachable" in result.output


def test_addresses_become_metrics_urls():
    assert metrics_url("10.0.0.7:9400") == "http://10.0.0.7:9400/metrics"
    assert metrics_url("https://agent.example/custom") == "https://agent.example/custom"
