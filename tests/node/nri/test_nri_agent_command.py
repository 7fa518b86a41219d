"""``gpufrac node-agent`` as a process: probes, injection through the runtime, clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from nri_harness import Node

from gpufrac.local.nriruntime import ContainerCreateFailed
from gpufrac.node.inventory.simulated import simulated_uuid

GPU = simulated_uuid("gpu-node-000", 0)  # the first of the agent's simulated GPUs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def probe(port: int, path: str) -> tuple[int, str]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}{path}", timeout=2)
        return response.status_code, response.text


async def wait_probe(port: int, path: str, status: int, *, timeout: float = 15.0) -> str:
    deadline = asyncio.get_running_loop().time() + timeout
    last: object = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            code, text = await probe(port, path)
            if code == status:
                return text
            last = (code, text)
        except httpx.HTTPError as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never answered {status}: {last}")


async def test_node_agent_process_injects_and_stops_cleanly(make_node) -> None:  # type: ignore[no-untyped-def]
    node: Node = await make_node(agent=False)
    port = free_port()
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "node-agent",
        "--node-name",
        "gpu-node-000",
        "--no-publish",
        "--backend",
        "simulated",
        "--sim-gpus",
        "2xH100-80GB",
        "--nri-socket",
        str(node.socket),
        "--state-dir",
        str(node.root / "agent"),
        "--health-port",
        str(port),
        "--metrics-port",
        "0",
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_probe(port, "/healthz", 200)
        assert await node.runtime.wait_plugins(1, timeout_s=15) == 1
        assert "NRI plugin synchronized" in await wait_probe(port, "/readyz", 200)

        pod = await node.pod(
            {"nvidia.com/container.c.gpu-memory.request": "3Gi", "nvidia.com/container.c.gpus.devices": GPU}
        )
        created = await node.create(pod, "c")
        assert created.env["NVIDIA_GPU_MEMORY_LIMIT"] == "3072"
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 10) == 0
        # The mapping record is on disk once the agent has stopped (writes are flushed on the way out).
        record = json.loads((node.root / "agent" / "containers" / f"{created.id}.json").read_text())
        assert record["schema"] == 1 and record["limit_mib"] == 3072
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
    assert agent.stderr is not None
    lines = [
        json.loads(line) for line in (await agent.stderr.read()).decode().splitlines() if line.startswith("{")
    ]
    assert any(line["msg"] == "node agent stopped" for line in lines)
    assert all({"ts", "level", "component", "msg"} <= line.keys() for line in lines)


async def test_the_configuration_file_reaches_the_injection(make_node) -> None:  # type: ignore[no-untyped-def]
    """``foreign_gpus: refuse`` in ``--config`` makes the running agent refuse a container that got a GPU
    outside gpufrac (the settings were once read and never handed to the injector)."""
    node: Node = await make_node(agent=False)
    port = free_port()
    config = node.root / "agent.yaml"
    config.write_text("foreign_gpus: refuse\nforeign_gpus_exempt_namespaces: [gpu-operator]\n")
    agent = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "gpufrac", "node-agent", "--config", str(config)],
        *["--node-name", "gpu-node-000", "--no-publish", "--backend", "simulated"],
        *["--sim-gpus", "2xH100-80GB", "--nri-socket", str(node.socket)],
        *["--state-dir", str(node.root / "agent"), "--health-port", str(port), "--metrics-port", "0"],
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_probe(port, "/readyz", 200)
        foreign = await node.pod(name="trainer")
        with pytest.raises(ContainerCreateFailed, match="on a node whose GPUs gpufrac shares"):
            await node.create(foreign, "train", env={"NVIDIA_VISIBLE_DEVICES": GPU})
        exempt = await node.pod(name="dcgm", namespace="gpu-operator")
        await node.create(exempt, "exporter", env={"NVIDIA_VISIBLE_DEVICES": GPU})
    finally:
        agent.kill()
        await agent.wait()


async def test_readyz_says_what_is_missing_without_a_runtime(tmp_path: Path) -> None:
    port = free_port()
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "node-agent",
        "--node-name",
        "n",
        "--no-publish",
        "--backend",
        "simulated",
        "--sim-gpus",
        "1xL4-24GB",
        "--nri-socket",
        str(tmp_path / "absent.sock"),
        "--state-dir",
        str(tmp_path / "state"),
        "--health-port",
        str(port),
        "--metrics-port",
        "0",
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        text = await wait_probe(port, "/readyz", 503)
        assert "NRI plugin not connected" in text and "absent.sock" in text
        assert (await probe(port, "/healthz"))[0] == 200
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 10) == 0
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def test_bad_configuration_exits_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "node-agent",
        "--node-name",
        "n",
        "--backend",
        "simulated",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"needs exactly one of sim_gpus or sim_config" in err


async def test_node_agent_publishes_its_node_and_withdraws_readiness_on_sigterm(
    make_node, controlplane, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Node as KubeNode

    node: Node = await make_node(agent=False)
    name = f"agent-{uuid.uuid4().hex[:8]}"
    client = controlplane.async_client()
    await client.create(KubeNode(metadata=ObjectMeta(name=name)))

    async def ready_condition():  # type: ignore[no-untyped-def]
        kube_node = await client.get(KubeNode, name)
        conditions = kube_node.status.conditions or [] if kube_node.status else []
        return next((c for c in conditions if c.type == "gpu-fractioning.nvidia.com/Ready"), None)

    async def wait_reason(reason: str) -> None:
        deadline = asyncio.get_running_loop().time() + 15
        while asyncio.get_running_loop().time() < deadline:
            condition = await ready_condition()
            if condition is not None and condition.reason == reason:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"condition never became {reason}: {await ready_condition()}")

    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufrac", "node-agent",
        "--node-name", name,
        "--kubeconfig", str(controlplane.kubeconfig),
        "--backend", "simulated", "--sim-gpus", "2xL4-24GB",
        "--nri-socket", str(node.socket),
        "--state-dir", str(node.root / "agent"),
        "--health-port", str(free_port()),
        "--metrics-port", "0",
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await wait_reason("GpuFractioningReady")
        kube_node = await client.get(KubeNode, name)
        assert kube_node.metadata is not None and kube_node.metadata.annotations is not None
        assert [g["model"] for g in json.loads(kube_node.metadata.annotations["gpufrac.io/gpus"])] == [
            "L4-24GB"
        ] * 2
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 15) == 0
        await wait_reason("NodeAgentStopped")
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await client.delete(KubeNode, name)
        await client.close()
