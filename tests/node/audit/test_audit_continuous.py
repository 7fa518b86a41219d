"""The audit as the agent runs it: a listener of the usage reporter, every interval, over real CRI gRPC."""

from __future__ import annotations

import asyncio

import pytest

from gpufrac.node.cri.client import environment_in
from gpufrac.node.enforcement_audit import REASON_MISSING_INJECTION, Auditor
from gpufrac.node.metrics import EnforcementCounters, UsageExporter, UsageReporter
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
ANNOTATIONS = {
    "nvidia.com/container.server.gpu-memory.request": "8Gi",
    "nvidia.com/container.server.gpus.devices": GPU0,
}


async def test_a_container_that_appears_later_is_caught_by_the_running_audit(
    runtime, cri, planner, events, allocations, proc_root
):
    counters = EnforcementCounters()
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * 1024**3)
    auditor = Auditor(runtime=cri, planner=planner, events=events, counters=counters, node_name="n1")
    reporter = UsageReporter(
        collector=UsageCollector(backend=gpus, allocations=allocations, proc_root=proc_root),
        exporter=UsageExporter(node="n1", counters=counters),
        counters=counters,
        interval=0.05,
        listeners=[auditor],
    )
    task = asyncio.create_task(reporter.run())
    try:
        await asyncio.sleep(0.15)
        assert events.emitted == []
        # created while the agent's NRI plugin was not connected: no injection at all
        sandbox = runtime.add_pod(namespace="ml", name="late", annotations=ANNOTATIONS)
        runtime.add_container(id="9" * 64, sandbox_id=sandbox, name="server", env={"HOME": "/root"})
        for _ in range(100):
            if runtime.stopped:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert events.reasons() == [REASON_MISSING_INJECTION]
    assert runtime.stopped == [("9" * 64, 10)]
    assert counters.read().violations["missing_injection"] == 1


def test_the_spec_environment_is_read_as_getenv_would():
    info = {"info": '{"runtimeSpec": {"process": {"env": ["A=1", "B=x=y", "A=2", "EMPTY="]}}}'}
    assert environment_in(info) == {"A": "1", "B": "x=y", "EMPTY": ""}
    assert environment_in({}) is None  # the runtime does not expose the spec: nothing to compare
    assert environment_in({"info": "not json"}) is None
