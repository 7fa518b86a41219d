"""NRI path end to end: NRI's real runtime-side adaptation (testenv/nriruntime) -> gpufrac's NRI plugin and
handler -> the MPS hooks -> the real supervisor -> the STAND-IN control daemon (a separate process).

What a user would notice: an sm-sharing container's MPS directory is its own namespace's directory with
its thread ceiling, a time-slicing container's is an empty private leaf (no MPS client), StopContainer
drains its processes, RemoveContainer deletes its namespace, and with MPS down the container fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mps_harness import STANDIN_NRI_REQUEST_TIMEOUT_S, MpsEnv, started, until

ROOT = Path(__file__).resolve().parents[3]
if importlib.util.find_spec("gpufrac._generated.nri") is None:  # `make testenv` not run yet
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-nri-protos")], check=True)

from gpufrac.local.nriruntime import ContainerCreateFailed, NriRuntime, binary_path  # noqa: E402
from gpufrac.node.mapping import MappingStore  # noqa: E402
from gpufrac.node.mps.containers import MpsContainerHooks  # noqa: E402
from gpufrac.node.mps.names import namespace_name  # noqa: E402
from gpufrac.node.mps.supervisor import MpsSupervisor  # noqa: E402
from gpufrac.node.nri.handler import GpuInjector  # noqa: E402
from gpufrac.node.nri.plugin import NriPlugin  # noqa: E402

PIPE_IN_CONTAINER = "/run/nvidia/mps"


def annotations(container: str, *, mode: str, portion: float | None = None) -> dict[str, str]:
    prefix = f"nvidia.com/container.{container}."
    out = {
        prefix + "gpu-memory.request": "2Gi",
        prefix + "gpu-memory.limit": "3Gi",
        prefix + "gpu-compute.mode": mode,
        prefix + "gpus.devices": "GPU-0000-2222",
    }
    if portion is not None:
        out[prefix + "gpu-compute.portion"] = str(portion)
    return out


@dataclass
class MpsNode:
    runtime: NriRuntime
    supervisor: MpsSupervisor
    leaves: Path
    tasks: list[asyncio.Task[None]]

    async def pod_with(self, name: str, notes: dict[str, str]) -> str:
        await self.runtime.run_pod(
            id=f"pod-{name}", name=name, namespace="ml", uid=f"uid-{name}", annotations=notes
        )
        return f"pod-{name}"


def connect_agent(runtime: NriRuntime, supervisor: MpsSupervisor, env: MpsEnv) -> asyncio.Task[None]:
    """The node agent's NRI half with the MPS hooks, connecting to ``runtime``; the hooks read client
    PIDs' cgroups where ``MpsEnv.in_container`` writes them."""
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=env.proc_root)
    injector = GpuInjector(
        store=MappingStore(directory=env.root / "state"), pipe_root=env.root / "leaves", hooks=hooks
    )
    plugin = NriPlugin(handler=injector, socket_path=str(runtime.socket_path), backoff_initial_s=0.02)
    return asyncio.create_task(plugin.run())


async def disconnect(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.fixture
async def mps_node(make_supervisor, mps_env: MpsEnv) -> AsyncIterator[MpsNode]:
    build = subprocess.run(["bash", str(ROOT / "testenv" / "nriruntime" / "build.sh")], capture_output=True)
    if build.returncode != 0 and not binary_path().exists():
        pytest.skip(f"the NRI runtime driver cannot be built here: {build.stderr.decode()[-300:]}")
    # No idle recycle: the test looks at the namespaces right after a drain that leaves no client.
    supervisor = await started(make_supervisor(recycle_when_idle=False))
    runtime = NriRuntime(
        socket_path=mps_env.root / "nri.sock", request_timeout_s=STANDIN_NRI_REQUEST_TIMEOUT_S
    )
    await runtime.start()
    node = MpsNode(
        runtime=runtime,
        supervisor=supervisor,
        leaves=mps_env.root / "leaves",
        tasks=[connect_agent(runtime, supervisor, mps_env)],
    )
    try:
        await runtime.wait_plugins(1, timeout_s=10)
        yield node
    finally:
        for task in node.tasks:
            await disconnect(task)
        await runtime.stop()


async def test_sm_sharing_gets_its_namespace_directory_and_ceiling_time_slicing_does_not(
    mps_node: MpsNode, mps_env: MpsEnv
) -> None:
    sm_pod = await mps_node.pod_with("infer", annotations("main", mode="sm-sharing", portion=0.375))
    ts_pod = await mps_node.pod_with("notebook", annotations("main", mode="time-slicing"))

    sm = await mps_node.runtime.create_container(id="c" * 64, pod_id=sm_pod, name="main")
    ts = await mps_node.runtime.create_container(id="d" * 64, pod_id=ts_pod, name="main")

    ns = namespace_name("c" * 64)
    sm_mount = sm.mount_at(PIPE_IN_CONTAINER)
    ts_mount = ts.mount_at(PIPE_IN_CONTAINER)
    assert sm_mount is not None and sm_mount["source"] == str(mps_node.supervisor.pipe_directory(ns))
    assert sm.env["CUDA_MPS_PIPE_DIRECTORY"] == PIPE_IN_CONTAINER
    assert sm.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "37"
    threads = await mps_node.supervisor.control.namespace_field(
        server="shared", name=ns, field="active_thread_percentage"
    )
    assert threads == "37"
    assert ts_mount is not None and ts_mount["source"] == str(mps_node.leaves / ("d" * 64))
    assert sorted(await mps_node.supervisor.control.list_namespaces(server="shared")) == sorted(
        ["default", ns]
    )

    # Processes see what the mounts give them: the sm-sharing one its namespace, the other no MPS at all.
    client, greeting = await mps_env.client(Path(sm_mount["source"]))
    assert greeting == f"connected shared {ns} 37"
    mps_env.in_container(client.pid, "c" * 64)
    lonely = await asyncio.create_subprocess_exec(
        str(mps_env.bin),
        "--mps-client",
        env={"CUDA_MPS_PIPE_DIRECTORY": ts_mount["source"]},
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await lonely.communicate()
    assert lonely.returncode == 1 and b"no MPS control socket" in err

    # StopContainer drains the container's MPS clients; RemoveContainer deletes its namespace.
    await mps_node.runtime.stop_container("c" * 64)
    assert await asyncio.wait_for(client.wait(), 5) == 3
    await mps_node.runtime.remove_container("c" * 64)
    assert await mps_node.supervisor.control.list_namespaces(server="shared") == ["default"]
    assert not mps_node.supervisor.namespace_dir(ns).exists()


async def test_sm_sharing_container_fails_while_mps_is_down(mps_node: MpsNode) -> None:
    await mps_node.supervisor.stop()
    pod = await mps_node.pod_with("late", annotations("main", mode="sm-sharing", portion=0.5))
    with pytest.raises(ContainerCreateFailed, match="MPS is not available"):
        await mps_node.runtime.create_container(id="e" * 64, pod_id=pod, name="main")


async def test_an_agent_restart_recreates_running_containers_namespaces_in_place(
    mps_node: MpsNode, mps_env: MpsEnv, make_supervisor
) -> None:
    pod = await mps_node.pod_with("serve", annotations("main", mode="sm-sharing", portion=0.2))
    gone = await mps_node.pod_with("gone", annotations("main", mode="sm-sharing", portion=0.2))
    await mps_node.runtime.create_container(id="f" * 64, pod_id=pod, name="main")
    await mps_node.runtime.create_container(id="9" * 64, pod_id=gone, name="main")
    ns = namespace_name("f" * 64)
    directory = mps_node.supervisor.namespace_dir(ns)
    inode = directory.stat().st_ino

    # The agent goes away (MPS with it); a container is removed while no agent runs; a new agent starts.
    await disconnect(mps_node.tasks.pop())
    await mps_node.supervisor.stop()
    await mps_node.runtime.remove_container("9" * 64)
    supervisor = await started(make_supervisor())
    mps_node.tasks.append(connect_agent(mps_node.runtime, supervisor, mps_env))
    await mps_node.runtime.wait_plugins(1, timeout_s=10)

    await until(lambda: supervisor.pipe_directory(ns) is not None)  # created and its limits set
    assert sorted(await supervisor.control.list_namespaces(server="shared")) == sorted(["default", ns])
    assert directory.stat().st_ino == inode  # what the running container has mounted
    client, greeting = await mps_env.client(directory)
    assert greeting == f"connected shared {ns} 20"
    client.kill()
    await client.wait()
