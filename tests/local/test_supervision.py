"""``gpufrac up`` keeps its components running and its ports private, judged on a real embedded cluster.

Each component is SIGKILLed as an OOM kill or a crash would end it; the supervisor must bring it back,
and a pod created afterwards must be placed and run with the node agent's injection (so the restarted
webhook admitted it, the restarted scheduler bound it and a restarted node agent injected it). Which
addresses the components listen on is read from the kernel (/proc/net/tcp), not from their settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lightkube.codecs import load_all_yaml
from lightkube.resources.core_v1 import Pod

from gpufrac.local.cluster import ClusterShape, LocalCluster, Timings
from gpufrac.local.demo import EXAMPLES
from gpufrac.local.kubelet import CONTAINERS_ANNOTATION
from gpufrac.local.simnodes import NodeShape
from gpufrac.local.supervisor import Backoff

pytestmark = pytest.mark.kube

_LISTEN = "0A"
_LOOPBACK_V4 = "0100007F"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    local = LocalCluster(
        shape=ClusterShape(nodes=2, node=NodeShape(gpus=2, model="H100-80GB")),
        timings=Timings(restart=Backoff(initial_s=0.2)),
    )
    async with local:
        yield local


def _listening(pid: int) -> list[tuple[str, int]]:
    """(hex local address, port) of every TCP socket ``pid`` listens on, from the kernel's tables."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, port = fields[1].split(":")
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.append((address, int(port, 16)))
    return found


async def test_every_component_listens_on_loopback_only(cluster: LocalCluster) -> None:
    names = sorted(cluster.components)
    agents = [f"node-agent-{node}" for node in cluster.shape.node_names]
    validators = [f"node-agent-validator-{node}" for node in cluster.shape.node_names]
    assert names == sorted(["admission", "kube-controller-manager", "scheduler", *agents, *validators])
    for name in names:
        sockets = _listening(cluster.components[name].pid)
        assert sockets, f"{name} listens on nothing"
        assert {address for address, _ in sockets} == {_LOOPBACK_V4}, (name, sockets)
    # The node agents' metrics (what `gpufrac top` reads) are among them.
    first = cluster.shape.node_names[0]
    agent = cluster.components[f"node-agent-{first}"]
    metrics_port = int(cluster.metrics_urls[first].rsplit(":", 1)[1].split("/")[0])
    assert (_LOOPBACK_V4, metrics_port) in _listening(agent.pid)


async def _until(condition, *, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


async def test_killed_components_come_back_and_a_pod_created_afterwards_runs(cluster: LocalCluster) -> None:
    assert cluster.client is not None
    victims = [
        "scheduler",
        "admission",
        *(f"node-agent-{node}" for node in cluster.shape.node_names),
        *(f"node-agent-validator-{node}" for node in cluster.shape.node_names),
    ]
    old = {name: cluster.components[name].pid for name in victims}
    for name in victims:
        os.kill(old[name], signal.SIGKILL)
    for name in victims:
        component = cluster.components[name]
        await _until(lambda c=component, n=name: c.alive and c.pid != old[n])
        await cluster.wait_ready(name)
        assert [e.code for e in component.exits] == [-signal.SIGKILL]
    assert (cluster.logs / "scheduler.log").read_text().count("scheduler killed by SIGKILL after") == 1

    (pod,) = load_all_yaml((EXAMPLES / "demo" / "packed.yaml").read_text())
    pod.metadata.name = "after-restarts"
    await cluster.client.create(pod, namespace="default")
    # Placed and run: a restarted agent may report its node not ready for a moment (the pod is then
    # reported unschedulable), and the scheduler retries as soon as the Node changes back.
    async with asyncio.timeout(60):
        while not (
            (created := await cluster.client.get(Pod, "after-restarts", namespace="default")).spec.nodeName
            and CONTAINERS_ANNOTATION in (created.metadata.annotations or {})
        ):
            await asyncio.sleep(0.2)
    assert created.spec.nodeName in cluster.shape.node_names
    injected = json.loads(created.metadata.annotations[CONTAINERS_ANNOTATION])
    env = injected["app"]["env"]
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == str(16 * 1024)
    assert env["NVIDIA_VISIBLE_DEVICES"]
    assert not cluster.kubelet_failures


async def test_gpufrac_up_ends_with_the_code_of_a_control_plane_that_died(tmp_path: Path) -> None:
    """Nothing is restarted without the control plane: `gpufrac up` must notice and say so, not hang."""
    from gpufrac.local.command import _until_stopped
    from gpufrac.local.controlplane import ControlPlane

    class _Cluster:  # what _until_stopped reads of a LocalCluster: its control plane
        def __init__(self, controlplane: ControlPlane) -> None:
            self.controlplane = controlplane

    controlplane = ControlPlane(data_dir=tmp_path / "cp")
    await asyncio.to_thread(controlplane.start)
    try:
        os.kill(controlplane.pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            code = await _until_stopped(_Cluster(controlplane), asyncio.Event())  # type: ignore[arg-type]
        assert code == -signal.SIGKILL
    finally:
        await asyncio.to_thread(controlplane.stop)


def _gpu_pod(name: str) -> Pod:
    (pod,) = load_all_yaml((EXAMPLES / "demo" / "packed.yaml").read_text())
    pod.metadata.name = name
    return pod


async def _never_bare(cluster: LocalCluster, names: list[str], done, *, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Poll until ``done(received)`` (pod name -> what its container ``app`` received, as the simulated
    kubelet records it); at every poll, every container the nodes' NRI runtimes hold for these pods must
    have its injection (the runtime's own list, not the kubelet's record), and so must every record."""
    assert cluster.client is not None
    async with asyncio.timeout(timeout_s):
        while True:
            received: dict[str, dict] = {}
            uids = {}
            for name in names:
                pod = await cluster.client.get(Pod, name, namespace="default")
                uids[pod.metadata.uid] = name
                raw = (pod.metadata.annotations or {}).get(CONTAINERS_ANNOTATION)
                if raw:
                    received[name] = json.loads(raw)["app"]
            for runtime in cluster.runtimes.values():
                for container in (await runtime.list())["containers"]:
                    if container.get("pod_sandbox_id") in uids:
                        env = dict(e.partition("=")[::2] for e in container.get("env", []))
                        assert env.get("NVIDIA_GPU_MEMORY_REQUEST") == str(16 * 1024), (
                            f"{uids[container['pod_sandbox_id']]} was created WITHOUT its injection: {env}"
                        )
            for name, got in received.items():
                assert "error" in got or got["env"].get("NVIDIA_GPU_MEMORY_REQUEST") == str(16 * 1024), (
                    name,
                    got,
                )
            if done(received):
                return
            await asyncio.sleep(0.1)


def _all_refused(names: list[str]):  # type: ignore[no-untyped-def]
    return lambda got: set(got) == set(names) and all("error" in g for g in got.values())


def _all_injected(names: list[str]):  # type: ignore[no-untyped-def]
    return lambda got: set(got) == set(names) and all("error" not in g for g in got.values())


async def test_hung_agents_let_no_gpu_container_be_created_bare_and_the_pods_run_after(
    cluster: LocalCluster,
) -> None:
    """Every node agent SIGSTOPped: NRI's default validator still counts each present until its request
    timeout drops it, and before this release the containers were created with an empty environment.
    The agents' validators refuse them; the simulated kubelet retries, and once the agents answer again
    the pods run with their injection."""
    assert cluster.client is not None
    agents = [cluster.components[f"node-agent-{node}"].pid for node in cluster.shape.node_names]
    names = ["hung-a", "hung-b"]
    for pid in agents:
        os.kill(pid, signal.SIGSTOP)
    try:
        for name in names:
            await cluster.client.create(_gpu_pod(name), namespace="default")
        await _never_bare(cluster, names, _all_refused(names))
    finally:
        for pid in agents:
            os.kill(pid, signal.SIGCONT)
    await _never_bare(cluster, names, _all_injected(names))
    for name in names:
        await cluster.client.delete(Pod, name, namespace="default", grace_period=0)


async def test_pods_created_while_the_agents_restart_never_run_bare(cluster: LocalCluster) -> None:
    """SIGKILL every agent and create GPU pods at once: the supervisor's restart window (as a DaemonSet's)."""
    assert cluster.client is not None
    names = ["restart-a", "restart-b"]
    for node in cluster.shape.node_names:
        os.kill(cluster.components[f"node-agent-{node}"].pid, signal.SIGKILL)
    for name in names:
        await cluster.client.create(_gpu_pod(name), namespace="default")
    await _never_bare(cluster, names, _all_injected(names))
    for name in names:
        await cluster.client.delete(Pod, name, namespace="default", grace_period=0)
