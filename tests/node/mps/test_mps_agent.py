"""``gpufrac node-agent --mps`` as a process, with the STAND-IN control daemon and NRI's real adaptation:
the agent starts MPS, gives an sm-sharing container its namespace, counts a daemon restart in its usage
metrics, and on SIGTERM without handover leaves no MPS process (with handover, the default, it leaves MPS
serving for the next agent: test_mps_handover.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mps_harness import STANDIN_NRI_REQUEST_TIMEOUT_S, MpsEnv, processes_of, until

from gpufrac.local.nriruntime import ContainerCreateFailed, NriRuntime, binary_path
from gpufrac.node.inventory.simulated import simulated_uuid
from gpufrac.node.mps.names import namespace_name

ROOT = Path(__file__).resolve().parents[3]


async def test_node_agent_with_mps_serves_namespaces_and_stops_mps_on_sigterm(mps_env: MpsEnv) -> None:
    build = subprocess.run(["bash", str(ROOT / "testenv" / "nriruntime" / "build.sh")], capture_output=True)
    if build.returncode != 0 and not binary_path().exists():
        pytest.skip("the NRI runtime driver cannot be built here")
    pipe = mps_env.root / "pipe"
    config = mps_env.root / "agent.yaml"
    config.write_text(f"mps_pipe_dir: {pipe}\nmps_log_dir: {mps_env.root / 'log'}\n")
    runtime = NriRuntime(
        socket_path=mps_env.root / "nri.sock", request_timeout_s=STANDIN_NRI_REQUEST_TIMEOUT_S
    )
    await runtime.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = int(s.getsockname()[1])
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "node-agent",
        "--config",
        str(config),
        "--node-name",
        "gpu-node-mps",
        "--no-publish",
        "--backend",
        "simulated",
        "--sim-gpus",
        "1xH100-80GB",
        "--nri-socket",
        str(runtime.socket_path),
        "--state-dir",
        str(mps_env.root / "agent"),
        "--health-port",
        "0",
        "--metrics-port",
        str(metrics_port),
        "--mps",
        "--mps-control-bin",
        str(mps_env.bin),
        "--no-mps-handover",
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await runtime.wait_plugins(1, timeout_s=20)
        await until(lambda: (pipe / "shared" / "control").exists(), timeout_s=20)  # v3: the shared server
        prefix = "nvidia.com/container.main."
        await runtime.run_pod(
            id="p1",
            name="infer",
            namespace="ml",
            uid="u1",
            annotations={
                prefix + "gpu-memory.request": "8Gi",
                prefix + "gpu-compute.mode": "sm-sharing",
                prefix + "gpu-compute.portion": "0.5",
                prefix + "gpus.devices": simulated_uuid("gpu-node-mps", 0),  # the node's (simulated) GPU
            },
        )
        # The shared server's socket appears before the daemon is READY (namespaces reconciled): until
        # then an sm-sharing container fails closed, and the kubelet retries it, as here.
        for _ in range(100):
            try:
                created = await runtime.create_container(id="a" * 64, pod_id="p1", name="main")
                break
            except ContainerCreateFailed as refused:
                assert "not serving" in str(refused)
                await asyncio.sleep(0.2)
        else:
            raise AssertionError("the sm-sharing container was refused for 20 s")
        mount = created.mount_at("/run/nvidia/mps")
        assert mount is not None and mount["source"] == str(pipe / "shared" / namespace_name("a" * 64))
        client, greeting = await mps_env.client(Path(mount["source"]))
        assert greeting == f"connected shared {namespace_name('a' * 64)} 50"

        async def restarts_metric() -> str:
            try:
                async with httpx.AsyncClient() as http:
                    text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)).text
            except httpx.HTTPError:
                return ""
            return next(
                (line for line in text.splitlines() if line.startswith("gpufrac_mps_restarts_total")), ""
            )

        # The daemon exits (SIGTERM: it takes its servers along); the supervisor restarts it and the
        # agent's usage metrics count the restart (CountingMpsEvents on the shared counters).
        os.kill(int((pipe / "nvidia-cuda-mps-control.pid").read_text().split()[0]), signal.SIGTERM)
        for _ in range(200):
            if (await restarts_metric()).endswith(" 1.0"):
                break
            await asyncio.sleep(0.1)
        assert (await restarts_metric()) == 'gpufrac_mps_restarts_total{node="gpu-node-mps"} 1.0'

        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 30) == 0
        assert await asyncio.wait_for(client.wait(), 10) == 2  # its server went away with MPS
        assert processes_of(pipe) == []
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await runtime.stop()
