"""The usage duty as the node agent runs it: start, serve, audit, and a clean stop on cancellation."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.metrics import EnforcementCounters
from gpufrac.node.reporting import UsageSettings, run_reporting
from gpufrac.node.usage.simulated import SimulatedUsage

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"


async def test_reporting_serves_audits_and_releases_its_port_when_cancelled(
    runtime, planner, events, allocations, proc_root
):
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * 1024**3)
    allocations.put(
        AllocationRecord(
            container_id="5" * 64,
            pod_namespace="ml",
            pod_name="idle-0",
            pod_uid="u",
            container_name="main",
            devices=(GPU0,),
            request_mib=1024,
            limit_mib=1024,
            mode="time-slicing",
            portion=None,
        )
    )
    sandbox = runtime.add_pod(
        namespace="ml",
        name="bare",
        annotations={
            "nvidia.com/container.main.gpu-memory.request": "1Gi",
            "nvidia.com/container.main.gpus.devices": GPU0,
        },
    )
    runtime.add_container(id="6" * 64, sandbox_id=sandbox, name="main", env={})
    settings = UsageSettings(
        interval_s=0.05,
        metrics_host="127.0.0.1",
        metrics_port=0,
        proc_root=proc_root,
        cri_endpoint=runtime.endpoint,
    )
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_reporting(
            settings=settings,
            node_name="n1",
            backend=gpus,
            allocations=allocations,
            managed_gpus=None,
            planner=planner,
            events=events,
            counters=EnforcementCounters(),
            started=started,
        )
    )
    port = await asyncio.wait_for(started, timeout=5)
    for _ in range(100):
        if runtime.stopped:
            break
        await asyncio.sleep(0.02)
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    )

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert 'pod="idle-0"' in text and "gpufrac_fraction_memory_used_bytes" in text
    assert runtime.stopped == [("6" * 64, 10)]
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
