"""An agent upgrade with sm-sharing clients connected: MPS keeps serving them, the new agent adopts it
(``gpufrac node-agent --mps`` as processes, the MPS STAND-IN, NRI's real adaptation).

Before, the daemon was the agent's foreground child reading its stdin, so a rolling update of the
DaemonSet (SIGTERM, new pod) restarted MPS and every running sm-sharing process lost its server. Now the
daemon runs in the background; the old agent leaves it serving, the new one adopts it (same pid), keeps
the container's namespace (read back, not re-set: a set is refused while a client is attached), and the
client that was connected before the upgrade is still connected after it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import pytest
from mps_harness import STANDIN_NRI_REQUEST_TIMEOUT_S, MpsEnv, processes_of, until

from gpufrac.local.nriruntime import ContainerCreateFailed, NriRuntime, binary_path
from gpufrac.node.inventory.simulated import simulated_uuid
from gpufrac.node.mps.names import namespace_name

NODE = "gpu-node-handover"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_agent(mps_env: MpsEnv, runtime: NriRuntime, log: Path) -> asyncio.subprocess.Process:
    config = mps_env.root / "agent.yaml"
    # The agent runs as a host process here, with no container cgroup to leave: the move into a cgroup of
    # its own is test_mps_host_cgroup.py's and test_mps_handover_realnode.py's (a real pod).
    config.write_text(
        f"mps_pipe_dir: {mps_env.root / 'pipe'}\nmps_log_dir: {mps_env.root / 'log'}\nmps_own_cgroup: null\n"
    )
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpufrac",
        "node-agent",
        "--config",
        str(config),
        "--node-name",
        NODE,
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
        str(free_port()),
        "--mps",
        "--mps-control-bin",
        str(mps_env.bin),
        "--log-format",
        "text",
        stderr=log.open("ab"),
    )


def daemon_pid(pipe: Path) -> int | None:
    try:
        return int((pipe / "nvidia-cuda-mps-control.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


async def test_an_agent_restart_keeps_mps_and_its_clients_and_the_new_agent_adopts_it(
    mps_env: MpsEnv,
) -> None:
    if not binary_path().exists():
        pytest.skip("the NRI runtime driver is not built (bash testenv/nriruntime/build.sh)")
    pipe = mps_env.root / "pipe"
    log = mps_env.root / "agents.log"
    runtime = NriRuntime(
        socket_path=mps_env.root / "nri.sock", request_timeout_s=STANDIN_NRI_REQUEST_TIMEOUT_S
    )
    await runtime.start()
    agents: list[asyncio.subprocess.Process] = []
    client = None
    try:
        agents.append(await start_agent(mps_env, runtime, log))
        await runtime.wait_plugins(1, timeout_s=20)
        await until(lambda: (pipe / "shared" / "control").exists(), timeout_s=20)
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
                prefix + "gpus.devices": simulated_uuid(NODE, 0),
            },
        )
        container = "a" * 64
        for _ in range(100):
            try:
                created = await runtime.create_container(id=container, pod_id="p1", name="main")
                break
            except ContainerCreateFailed as refused:
                assert "not serving" in str(refused)
                await asyncio.sleep(0.2)
        else:
            raise AssertionError("the sm-sharing container was refused for 20 s")
        mount = created.mount_at("/run/nvidia/mps")
        assert mount is not None
        client, greeting = await mps_env.client(Path(mount["source"]))
        assert greeting == f"connected shared {namespace_name(container)} 50"
        before = daemon_pid(pipe)
        assert before is not None

        # The rolling update: SIGTERM to the old agent, which exits cleanly...
        agents[0].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agents[0].wait(), 30) == 0
        # ...and leaves MPS serving: the daemon and the client are still there, the client connected.
        assert daemon_pid(pipe) == before and before in processes_of(pipe)
        assert client.returncode is None

        agents.append(await start_agent(mps_env, runtime, log))  # the new pod's agent
        await until(lambda: "adopted the MPS control daemon" in log.read_text(), timeout_s=20)
        # Synchronize has handed it the running container (the agent logs each time it is in the path).
        await until(lambda: log.read_text().count("in the runtime's path") >= 2, timeout_s=20)
        # The same daemon, serving the same namespace to the same client, under the new agent.
        assert daemon_pid(pipe) == before
        assert client.returncode is None
        again, greeting = await mps_env.client(Path(mount["source"]))
        assert greeting == f"connected shared {namespace_name(container)} 50"
        again.kill()
        await again.wait()
        assert "stopped" not in (mps_env.root / "log" / "control.log").read_text()  # never quit
    finally:
        for agent in agents:
            if agent.returncode is None:
                agent.send_signal(signal.SIGTERM)
                await asyncio.wait_for(agent.wait(), 30)
        if client is not None and client.returncode is None:
            client.kill()
            await client.wait()
        await runtime.stop()
