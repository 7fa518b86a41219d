"""MPS survives the replacement of the node agent's POD, on the real node (containerd, runc, a kubelet).

test_mps_handover.py shows the daemon outliving the agent *process*. A rolling update of the DaemonSet
replaces the agent's *pod*, and when a container without a PID namespace of its own (the agent runs with
``hostPID``) stops, containerd's runc shim kills every process left in its cgroup (``runc kill --all``):
a daemon that did not leave the agent's cgroup dies with it. Here the agent runs as a privileged hostPID
pod of the real node, as the DaemonSet runs it, the pod is deleted as the rolling update does, and the
daemon, which the agent moved into a cgroup of its own, keeps serving its client; the next agent pod
adopts it.

What is real: the kubelet, containerd, runc, the kernel's cgroups (v1 on these machines), the node agent
(``gpufrac node-agent --mps``, connected to containerd's NRI socket). SIMULATED: the GPUs
(``--backend simulated``) and MPS (the STAND-IN control daemon, tests/node/mps/mps_standin.py: the
machine has no NVIDIA driver). The agent's image is the test node's busybox, which runs the agent from
the host through ``chroot`` into the host's ``/`` (a hostPath volume), so no image build is needed: the
process is the agent's program, in the pod's container and cgroups. The MPS client runs on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from lightkube.models.core_v1 import (
    Container,
    HostPathVolumeSource,
    PodSpec,
    SecurityContext,
    Volume,
    VolumeMount,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from mps_harness import MpsEnv, processes_of, remove_cgroup, until

from gpufrac.local import ociimage
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.realnode import missing_requirements
from gpufrac.local.simnodes import NodeShape
from gpufrac.node.mps.hostcgroup import cgroups_of

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

NODE = "mps-gpu-000"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    """Kubernetes and the real node, none of gpufrac's processes: the agent is the test's pod."""
    shape = ClusterShape(
        nodes=1, prefix="mps-gpu-", node=NodeShape(gpus=1, model="H100-80GB"), runtime="containerd"
    )
    assert shape.node_names == [NODE]
    async with LocalCluster(shape=shape, with_gpufrac=False) as local:
        yield local


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent_pod(name: str, *, mps_env: MpsEnv, cluster: LocalCluster, cgroup: str) -> Pod:
    """The node agent as the DaemonSet runs it (privileged, hostPID), its program from the host."""
    node = cluster.real_node
    assert node is not None
    config = mps_env.root / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "mps_pipe_dir": str(mps_env.root / "pipe"),
                "mps_log_dir": str(mps_env.root / "log"),
                "mps_own_cgroup": cgroup,
            }
        )
    )
    # The agent's stderr goes to a file of the test's: it outlives the pod (the kubelet's log does not).
    argv = [
        "/bin/busybox", "chroot", "/host",
        "/bin/sh", "-c", f'exec "$0" "$@" 2>>{_log_file(mps_env, name)}',
        sys.executable, "-m", "gpufrac", "node-agent",
        "--config", str(config),
        "--node-name", NODE,
        "--no-publish",
        "--backend", "simulated",
        "--sim-gpus", "1xH100-80GB",
        "--nri-socket", str(node.nri_socket),
        "--state-dir", str(mps_env.root / "agent"),
        "--health-port", "0",
        "--metrics-port", str(_free_port()),
        "--mps",
        "--mps-control-bin", str(mps_env.bin),
        "--log-format", "text",
    ]  # fmt: skip
    agent = Container(
        name="agent",
        image=ociimage.WORKLOAD.ref,
        imagePullPolicy="Never",
        command=argv,
        securityContext=SecurityContext(privileged=True),
        volumeMounts=[VolumeMount(name="host", mountPath="/host")],
    )
    spec = PodSpec(
        nodeName=NODE,
        hostPID=True,
        hostNetwork=True,
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=30,
        containers=[agent],
        volumes=[Volume(name="host", hostPath=HostPathVolumeSource(path="/", type="Directory"))],
    )
    return Pod(metadata=ObjectMeta(name=name, namespace="default"), spec=spec)


def _log_file(mps_env: MpsEnv, pod: str) -> Path:
    return mps_env.root / f"{pod}.log"


def _log(mps_env: MpsEnv, pod: str) -> str:
    """What the agent of ``pod`` logged."""
    path = _log_file(mps_env, pod)
    return path.read_text(errors="replace") if path.exists() else ""


def _daemon_pid(pipe: Path) -> int | None:
    try:
        return int((pipe / "nvidia-cuda-mps-control.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _until_logged(
    cluster: LocalCluster, mps_env: MpsEnv, pod: str, text: str, *, timeout_s: float = 120.0
) -> str:
    """Waits until the agent of ``pod`` logs ``text``; returns its log, or fails with its pod's status and
    log."""
    assert cluster.client is not None
    deadline = time.monotonic() + timeout_s
    while text not in (log := _log(mps_env, pod)):
        if time.monotonic() > deadline:
            status = (await cluster.client.get(Pod, pod, namespace="default")).status
            raise AssertionError(f"{pod} did not log {text!r} within {timeout_s:.0f}s: {status}\n{log}")
        await asyncio.sleep(0.2)
    return log


async def _pod_gone(cluster: LocalCluster, name: str, *, timeout_s: float = 90.0) -> None:
    assert cluster.client is not None
    deadline = time.monotonic() + timeout_s
    while [p async for p in cluster.client.list(Pod, namespace="default") if p.metadata.name == name]:
        assert time.monotonic() < deadline, f"pod {name} not gone within {timeout_s:.0f}s"
        await asyncio.sleep(0.5)


async def test_deleting_the_agents_pod_leaves_mps_serving_its_client_and_the_next_pod_adopts_it(
    cluster: LocalCluster, mps_env: MpsEnv
) -> None:
    assert cluster.client is not None
    client = cluster.client
    pipe = mps_env.root / "pipe"
    cgroup = f"gpufrac-mps-test-{uuid.uuid4().hex[:8]}"
    mps_client = None
    try:
        # -- the first agent pod starts MPS and moves the daemon out of its cgroup.
        await client.create(_agent_pod("agent-a", mps_env=mps_env, cluster=cluster, cgroup=cgroup))
        log = await _until_logged(cluster, mps_env, "agent-a", "MPS control daemon ready")
        assert "moved the MPS control daemon" in log, log
        daemon = _daemon_pid(pipe)
        assert daemon is not None
        for pid in processes_of(pipe):  # the daemon and its servers: out of the agent's cgroup, in every
            where = cgroups_of(pid)  # hierarchy
            assert where and all(path == f"/{cgroup}" for path in where.values()), (pid, where)
        servers = set(processes_of(pipe)) - {daemon}
        assert servers, "the daemon runs no server"
        mps_client, greeting = await mps_env.client(pipe / "shared")
        assert greeting.startswith("connected shared"), greeting

        # -- the rolling update: the pod is deleted; its container stops and runc kills its cgroup.
        await client.delete(Pod, "agent-a", namespace="default")
        await _pod_gone(cluster, "agent-a")
        assert "leaving the MPS control daemon" in _log(mps_env, "agent-a")  # it detached on SIGTERM
        assert _alive(daemon), "the MPS control daemon died with the agent's pod"
        assert all(_alive(pid) for pid in servers), "an MPS server died with the agent's pod"
        assert mps_client.returncode is None, "the MPS client lost its server"

        # -- the next pod's agent adopts the same daemon; the old client is still served, a new one too.
        await client.create(_agent_pod("agent-b", mps_env=mps_env, cluster=cluster, cgroup=cgroup))
        await _until_logged(cluster, mps_env, "agent-b", f"adopted the MPS control daemon {daemon}")
        assert _daemon_pid(pipe) == daemon and _alive(daemon)
        assert mps_client.returncode is None
        again, greeting = await mps_env.client(pipe / "shared")
        assert greeting.startswith("connected shared"), greeting
        again.kill()
        await again.wait()
        assert "stopped" not in (mps_env.root / "log" / "control.log").read_text()  # never quit
    finally:
        with contextlib.suppress(Exception):
            await client.delete(Pod, "agent-a", namespace="default", grace_period=0)
        with contextlib.suppress(Exception):
            await client.delete(Pod, "agent-b", namespace="default", grace_period=0)
        with contextlib.suppress(Exception):
            await _pod_gone(cluster, "agent-a")
            await _pod_gone(cluster, "agent-b")
        if mps_client is not None and mps_client.returncode is None:
            mps_client.kill()
            await mps_client.wait()
        for pid in processes_of(pipe):  # the daemon and its servers outlive every agent: end them here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await until(lambda: not processes_of(pipe), timeout_s=30)
        await remove_cgroup(cgroup)
