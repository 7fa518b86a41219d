"""``gpufrac node-agent`` reports per-fraction usage: the agent as a process, a container created through
NRI's real runtime side, the simulated GPU and process backends, /proc cgroup files laid out by the test,
and the Node on a real API server."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import uuid
from pathlib import Path

import httpx
import yaml
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node as KubeNode
from nri_harness import Node
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.node.inventory.simulated import simulated_uuid

GIB = 1024**3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def fraction_series(port: int, *, pod: str, container: str, gpu: str) -> dict[str, float]:
    """The fraction's gauges by metric name, as a Prometheus scrape reads them (empty if none yet)."""
    try:
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=2)).text
    except httpx.HTTPError:
        return {}
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("pod") == pod
        and s.labels.get("container") == container
        and s.labels.get("gpu_uuid") == gpu
    }


async def wait_series(port: int, *, want: dict[str, float], timeout: float = 15.0, **labels: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    series: dict[str, float] = {}
    while asyncio.get_running_loop().time() < deadline:
        series = await fraction_series(port, **labels)
        if all(series.get(name) == value for name, value in want.items()):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"series never became {want}: {series}")


async def test_node_agent_reports_a_fractions_usage_and_frees_its_port_on_sigterm(
    make_node, controlplane, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    node: Node = await make_node(agent=False)
    name = f"usage-{uuid.uuid4().hex[:8]}"
    client = controlplane.async_client()
    await client.create(KubeNode(metadata=ObjectMeta(name=name)))
    gpu = simulated_uuid(name, 1)
    proc_root, usage_file = tmp_path / "proc", tmp_path / "usage.json"
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({"usage": {"interval_s": 0.1, "metrics_host": "127.0.0.1"}}))
    port = free_port()
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufrac", "node-agent",
        "--config", str(config),
        "--node-name", name,
        "--kubeconfig", str(controlplane.kubeconfig),
        "--backend", "simulated", "--sim-gpus", "2xH100-80GB",
        "--sim-usage", str(usage_file),
        "--proc-root", str(proc_root),
        "--nri-socket", str(node.socket),
        "--state-dir", str(node.root / "agent"),
        "--health-port", str(free_port()),
        "--metrics-port", str(port),
        "--cri-endpoint", f"unix://{tmp_path}/no-cri.sock",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert await node.runtime.wait_plugins(1, timeout_s=15) == 1
        pod_id = await node.pod(
            {"nvidia.com/container.c.gpu-memory.request": "3Gi", "nvidia.com/container.c.gpus.devices": gpu},
            name="trainer-0",
        )
        container_id = uuid.uuid4().hex + uuid.uuid4().hex  # a runtime's 64-hex id, as cgroups name it
        created = await node.runtime.create_container(
            id=container_id, pod_id=pod_id, name="c", env={"PATH": "/usr/bin"}
        )
        assert created.env["NVIDIA_GPU_MEMORY_REQUEST"] == "3072"
        labels = {"pod": "trainer-0", "container": "c", "gpu": gpu}

        # Allocated but idle: request and limit, and a zero used-memory series.
        await wait_series(
            port,
            want={
                "gpufrac_fraction_memory_request_bytes": 3 * GIB,
                "gpufrac_fraction_memory_limit_bytes": 3 * GIB,
                "gpufrac_fraction_memory_used_bytes": 0,
            },
            **labels,
        )

        # A process of that container appears on the GPU: its cgroup names the container.
        (proc_root / "4242").mkdir(parents=True)
        (proc_root / "4242" / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod_u.slice/cri-containerd-{container_id}.scope\n"
        )
        (proc_root / "4242" / "comm").write_text("python3\n")
        usage_file.write_text(
            json.dumps({"gpus": [{"uuid": gpu, "processes": [{"pid": 4242, "used_bytes": 2 * GIB}]}]})
        )
        await wait_series(
            port,
            want={"gpufrac_fraction_memory_used_bytes": 2 * GIB, "gpufrac_fraction_processes": 1},
            **labels,
        )

        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 15) == 0
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # the metrics port is closed
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await client.delete(KubeNode, name)
        await client.close()
    assert agent.stderr is not None
    log = (await agent.stderr.read()).decode()
    # No CRI socket there and the audit was not asked for: it is off, said once, no crash.
    assert log.count("audit off: no CRI socket") == 1
    assert f"usage: metrics on 127.0.0.1:{port}" in log


async def test_an_audit_asked_for_without_a_cri_socket_keeps_the_agent_reporting(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({"usage": {"interval_s": 0.1, "metrics_host": "127.0.0.1"}}))
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufrac", "node-agent",
        "--config", str(config),
        "--node-name", "n", "--no-publish",
        "--backend", "simulated", "--sim-gpus", "1xL4-24GB",
        "--nri-socket", str(tmp_path / "absent.sock"),
        "--state-dir", str(tmp_path / "state"),
        "--health-port", "0",
        "--metrics-port", "0",
        "--audit", "--cri-endpoint", f"unix://{tmp_path}/no-cri.sock",
        "--log-format", "text",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert agent.stderr is not None
    try:
        port = None
        while port is None:  # the bound port is in the log
            line = (await asyncio.wait_for(agent.stderr.readline(), 15)).decode()
            assert line, "the agent exited before serving metrics"
            if "usage: metrics on 127.0.0.1:" in line:
                port = int(line.split("127.0.0.1:")[1].split(",")[0])

        async def collected_at() -> float:
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=2)).text
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            (at,) = [s.value for s in samples if s.name == "gpufrac_usage_last_collection_timestamp_seconds"]
            return at

        first = await collected_at()
        await asyncio.sleep(0.5)  # several audited cycles, each finding no runtime
        assert await collected_at() > first
        assert agent.returncode is None
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 15) == 0
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    assert "audit: skipped, the runtime did not list containers" in (await agent.stderr.read()).decode()
