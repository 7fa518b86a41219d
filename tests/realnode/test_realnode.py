"""The real node: our scheduler places a pod, a real kubelet runs it through containerd and runc, and
what the container's process got is read from the kernel (``/proc/<pid>/environ``), not from our records.

One embedded cluster with ``runtime="containerd"`` (``gpufrac.local.realnode``) serves the module. These
tests need root and cgroups; where the machine has them they must run (CI here has both), so they skip
only when ``missing_requirements`` names what is missing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import codecs
from lightkube.models.core_v1 import Container, EnvVar, PodSpec, Toleration
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from gpufrac.admission.review import DEFAULT_SCHEDULER_USER
from gpufrac.contract import keys
from gpufrac.contract.render import read_binding
from gpufrac.kube.binding import bind_pod
from gpufrac.local import ociimage
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.demo import DEMO_PODS, gpu_names, real_outcome, submit_and_wait
from gpufrac.local.realnode import (
    POD_SUBNET,
    SIMULATED_CDI_ENV_PREFIX,
    SLEEP_COMMAND,
    RealNodeError,
    missing_requirements,
    process_environ,
    process_mounts,
)
from gpufrac.local.simnodes import NodeShape, gpu_uuid
from gpufrac.node.inject import (
    CONTAINER_PIPE_DIR,
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
    ENFORCEMENT_ENV,
    NVIDIA_GPU_MEMORY_LIMIT,
    NVIDIA_VISIBLE_DEVICES,
    plan_container,
)
from gpufrac.node.memlimit.driver import MIB, NVML_ERROR_NOT_SUPPORTED, MemoryLimits
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits
from gpufrac.node.metrics import FRACTION_MEMORY_LIMIT

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

NODE = "real-gpu-000"
SCHEDULER = keys.DEFAULT_SCHEDULER_NAME
#: What a user writes to widen the limit; the node agent must remove it.
USER_LIMIT = "999999"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    shape = ClusterShape(
        nodes=1, prefix="real-gpu-", node=NodeShape(gpus=8, model="H100-80GB"), runtime="containerd"
    )
    assert shape.node_names == [NODE]
    async with LocalCluster(shape=shape) as local:
        yield local


def _pod(name: str, *, annotations: dict[str, str] | None = None, gpu: bool = True) -> Pod:
    """A host-network busybox pod that sleeps until stopped (SIGTERM ends it at once)."""
    app = Container(
        name="app",
        image=ociimage.WORKLOAD.ref,
        imagePullPolicy="Never",
        command=list(SLEEP_COMMAND),
        env=[EnvVar(name=NVIDIA_GPU_MEMORY_LIMIT, value=USER_LIMIT), EnvVar(name="USER_VAR", value="kept")],
    )
    spec = PodSpec(
        containers=[app],
        hostNetwork=True,
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=1,
    )
    if gpu:
        spec.schedulerName = SCHEDULER
    else:
        # Not a GPU pod: bound directly, tolerating the managed taint as a DaemonSet pod would.
        spec.nodeName = NODE
        spec.tolerations = [Toleration(**keys.managed_toleration())]
    return Pod(metadata=ObjectMeta(name=name, annotations=annotations or {}), spec=spec)


FRACTION = {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5"}


async def _wait_pod(
    cluster: LocalCluster, name: str, done: Callable[[Pod], bool], *, what: str, timeout_s: float = 60.0
) -> Pod:
    assert cluster.client is not None
    deadline = time.monotonic() + timeout_s
    while True:
        pod = await cluster.client.get(Pod, name, namespace="default")
        if done(pod):
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} did not {what} within {timeout_s:.0f}s: {pod.status}")
        await asyncio.sleep(0.2)


def _running(pod: Pod) -> bool:
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    return bool(statuses) and all(s.state is not None and s.state.running is not None for s in statuses)


def _container_id(pod: Pod) -> str:
    assert pod.status is not None and pod.status.containerStatuses
    (status,) = pod.status.containerStatuses
    assert status.containerID
    return status.containerID


async def _delete(cluster: LocalCluster, *names: str) -> None:
    assert cluster.client is not None
    for name in names:
        await cluster.client.delete(Pod, name, namespace="default", grace_period=0)


def _expected_env(pod: Pod) -> dict[str, Any]:
    assert pod.metadata is not None
    plan, _ = plan_container(annotations=pod.metadata.annotations or {}, container="app", pipe_source="")
    assert plan is not None
    return plan.env_map


async def test_a_fractional_pod_runs_in_runc_with_the_plan_in_its_process_environment(
    cluster: LocalCluster,
) -> None:
    assert cluster.client is not None and cluster.real_node is not None
    await cluster.client.create(_pod("fraction", annotations=FRACTION), namespace="default")
    pod = await _wait_pod(cluster, "fraction", _running, what="run")
    assert pod.spec is not None and pod.spec.nodeName == NODE

    pid = cluster.real_node.container_pid(_container_id(pod))
    environ = process_environ(pid)
    expected = _expected_env(pod)
    # Every variable gpufrac owns is exactly what the contract plans: the scheduler's devices, the
    # resolved MiB, the MPS directory -- and the user's own NVIDIA_GPU_MEMORY_LIMIT is gone.
    assert {k: environ.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}
    assert environ[NVIDIA_GPU_MEMORY_LIMIT] != USER_LIMIT
    assert environ["USER_VAR"] == "kept"
    assert CONTAINER_PIPE_DIR in [m["destination"] for m in process_mounts(pid)]
    await _delete(cluster, "fraction")


async def test_without_the_node_agent_a_fractional_pod_waits_and_a_plain_pod_runs(
    cluster: LocalCluster,
) -> None:
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    await node.stop_agent()

    async def agent_down() -> bool:
        assert cluster.client is not None
        got = await cluster.client.get(Node, NODE)
        conditions = {c.type: c.status for c in (got.status.conditions or [])} if got.status else {}
        return conditions.get(keys.NODE_READY_CONDITION) == "False"

    deadline = time.monotonic() + 30
    while not await agent_down():
        assert time.monotonic() < deadline, "the stopped agent did not mark the node not ready"
        await asyncio.sleep(0.2)

    await cluster.client.create(_pod("waits", annotations=FRACTION), namespace="default")
    # The scheduler says why it does not place the pod (the node's GPU fractioning is not ready).
    waiting = await _wait_pod(
        cluster,
        "waits",
        lambda p: any(
            c.type == "PodScheduled" and c.status == "False"
            for c in ((p.status.conditions or []) if p.status else [])
        ),
        what="be reported unschedulable",
    )
    assert waiting.spec is not None and not waiting.spec.nodeName

    await cluster.client.create(_pod("plain", gpu=False), namespace="default")
    plain = await _wait_pod(cluster, "plain", _running, what="run")
    # Nothing was injected into it: the user's variables are all it has.
    plain_env = process_environ(node.container_pid(_container_id(plain)))
    assert plain_env[NVIDIA_GPU_MEMORY_LIMIT] == USER_LIMIT and NVIDIA_VISIBLE_DEVICES not in plain_env

    # The agent returns: nobody touches the pod, and it runs with its limits.
    await node.start_agent()
    started = await _wait_pod(cluster, "waits", _running, what="run once the agent returned")
    environ = process_environ(node.container_pid(_container_id(started)))
    expected = _expected_env(started)
    assert {k: environ.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}
    await _delete(cluster, "waits", "plain")


def _restarted(pod: Pod) -> bool:
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    return any(s.restartCount and s.state is not None and s.state.running is not None for s in statuses)


def _waiting(pod: Pod) -> tuple[str, str]:
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    for status in statuses:
        if status.state is not None and status.state.waiting is not None:
            return status.state.waiting.reason or "", status.state.waiting.message or ""
    return "", ""


async def test_a_gpu_container_restarting_while_the_agent_is_away_is_refused_by_containerd(
    cluster: LocalCluster,
) -> None:
    """The scheduler cannot help here (the pod is bound already): the webhook's NRI required-plugins
    annotation makes containerd's own NRI validator refuse the container instead of starting it bare."""
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    await cluster.client.create(_pod("restarts", annotations=FRACTION), namespace="default")
    pod = await _wait_pod(cluster, "restarts", _running, what="run")

    await node.stop_agent()
    os.kill(node.container_pid(_container_id(pod)), signal.SIGKILL)  # the workload crashes
    # Either containerd refuses the new container, or it runs again -- without our plugin.
    settled = await _wait_pod(
        cluster,
        "restarts",
        lambda p: _restarted(p) or _waiting(p)[0] == "CreateContainerError",
        what="be refused by containerd or restart",
    )
    assert not _restarted(settled), "the GPU container restarted without the node agent: no limits"
    assert f'required plugin "{keys.NRI_PLUGIN_NAME}" not present' in _waiting(settled)[1]

    # The agent returns: the kubelet's next try creates the container, with its limits.
    await node.start_agent()
    started = await _wait_pod(cluster, "restarts", _running, what="run once the agent returned", timeout_s=90)
    environ = process_environ(node.container_pid(_container_id(started)))
    expected = _expected_env(started)
    assert {k: environ.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}
    await _delete(cluster, "restarts")


async def test_a_fractional_pod_bound_around_the_scheduler_never_runs_and_says_why(
    cluster: LocalCluster,
) -> None:
    """``spec.nodeName`` set by hand: no devices were assigned, so the node agent refuses the container
    with the contract's message naming the request it cannot enforce (it must not run unlimited on a GPU
    node)."""
    assert cluster.client is not None
    bypass = _pod("bypass", annotations=FRACTION, gpu=False)  # bound directly, like a non-GPU pod
    await cluster.client.create(bypass, namespace="default")
    refused = await _wait_pod(
        cluster,
        "bypass",
        lambda p: _running(p) or _waiting(p)[0] == "CreateContainerError",
        what="be refused or run",
    )
    assert not _running(refused), "a fractional pod without devices runs on the GPU node"
    reason = _waiting(refused)[1]
    assert 'gpu-fraction="0.25" is invalid' in reason and "no container has devices assigned" in reason, (
        reason
    )
    await _delete(cluster, "bypass")


async def test_the_demo_pods_run_on_the_real_node_with_their_plan_inside(cluster: LocalCluster) -> None:
    """`gpufrac demo --runtime containerd`: the reference pods run as runc containers, and the table is
    read from inside their processes."""
    assert cluster.client is not None and cluster.real_node is not None
    pods = [await submit_and_wait(cluster.client, m, real_node=cluster.real_node) for m in DEMO_PODS]
    names = await gpu_names(cluster.client)
    outcomes = {o.name: o for o in (real_outcome(p, names, cluster.real_node) for p in pods)}
    assert {n: o.state for n, o in outcomes.items()} == {
        "inference": "Running",
        "notebook": "Running",
        "packed": "Running",
        "mode-conflict": "Unschedulable",
        "too-big": "Unschedulable",
    }
    for pod in pods:
        assert pod.metadata is not None and pod.metadata.name is not None
        got = outcomes[pod.metadata.name]
        if got.state == "Running":
            assert got.injected["app"]["env"] == _expected_env(pod)
            assert got.injected["app"]["mps_mount"]["destination"] == CONTAINER_PIPE_DIR
    assert outcomes["inference"].injected["app"]["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    await _delete(cluster, *(p.metadata.name for p in pods if p.metadata and p.metadata.name))


async def test_a_containerd_restart_leaves_running_containers_alone_and_the_plugin_reconnects(
    cluster: LocalCluster,
) -> None:
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    await cluster.client.create(_pod("before", annotations=FRACTION), namespace="default")
    before = await _wait_pod(cluster, "before", _running, what="run")
    pid = node.container_pid(_container_id(before))
    environ = process_environ(pid)

    await node.restart_containerd()

    # The container was not touched: the same process, with the same environment.
    assert node.container_pid(_container_id(before)) == pid and process_environ(pid) == environ
    # The agent is back in containerd's path: a new GPU container is created (containerd's validator
    # would refuse it otherwise) and gets its plan.
    await cluster.client.create(_pod("after", annotations=FRACTION), namespace="default")
    after = await _wait_pod(cluster, "after", _running, what="run after the restart", timeout_s=90)
    after_env = process_environ(node.container_pid(_container_id(after)))
    expected = _expected_env(after)
    assert {k: after_env.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}
    fetched = await cluster.client.get(Pod, "before", namespace="default")
    assert fetched.status is not None and fetched.status.containerStatuses is not None
    assert fetched.status.containerStatuses[0].restartCount == 0
    await _delete(cluster, "before", "after")


def _enforced_env(node: Any, pod: Pod) -> bool:
    """Whether the running container's process has exactly its plan in its environment (the kernel's)."""
    env = process_environ(node.container_pid(_container_id(pod)))
    expected = _expected_env(pod)
    return {k: env.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}


async def _never_bare(
    cluster: LocalCluster,
    names: list[str],
    done: Callable[[dict[str, Pod]], bool],
    *,
    what: str,
    timeout_s: float = 60.0,
    refusals: dict[str, set[str]] | None = None,
) -> dict[str, Pod]:
    """Poll the pods every 0.1 s until ``done``; at every poll, each running container must have its
    plan in its process's environment, read from /proc (a bare one fails the test on the spot). The
    refusal messages seen on the way are collected in ``refusals`` (pod name -> messages)."""
    assert cluster.client is not None and cluster.real_node is not None
    deadline = time.monotonic() + timeout_s
    while True:
        pods = {n: await cluster.client.get(Pod, n, namespace="default") for n in names}
        for name, pod in pods.items():
            if _running(pod):
                try:
                    enforced = _enforced_env(cluster.real_node, pod)
                except RealNodeError:
                    continue  # its process went between the two reads; judged at the next poll
                assert enforced, f"pod {name} runs WITHOUT its injection: {pod.status}"
            reason, message = _waiting(pod)
            if refusals is not None and reason == "CreateContainerError":
                refusals.setdefault(name, set()).add(message)
        if done(pods):
            return pods
        if time.monotonic() > deadline:
            states = {n: (p.spec.nodeName if p.spec else None, _waiting(p)) for n, p in pods.items()}
            raise AssertionError(f"pods {names} did not {what} within {timeout_s:.0f}s: {states}")
        await asyncio.sleep(0.1)


def _all(check: Callable[[Pod], bool]) -> Callable[[dict[str, Pod]], bool]:
    return lambda pods: all(check(p) for p in pods.values())


def _refused(pod: Pod) -> bool:
    return _waiting(pod)[0] == "CreateContainerError"


#: The two refusals a GPU container meets while the agent is out: the agent's validator, when NRI
#: consulted the agent and went on without its adjustment (a create that met the hang or the dead
#: connection first), or NRI's default validator once NRI has dropped the agent (another call met it
#: first: the StopContainer of an earlier pod, a container's garbage collection).
REFUSALS = (
    'the node agent ("gpufrac") was consulted but its adjustment is not there',
    f'required plugin "{keys.NRI_PLUGIN_NAME}" not present',
)


def _refused_by_a_validator(refusals: dict[str, set[str]], names: list[str]) -> None:
    assert set(refusals) == set(names), refusals
    for name, messages in refusals.items():
        for message in messages:
            assert any(r in message for r in REFUSALS), (name, message)


def _started_once(pods: dict[str, Pod]) -> None:
    """No container of these pods ever ran before the one running now (a bare one the audit stopped
    would show as a restart)."""
    for name, pod in pods.items():
        assert pod.status is not None and pod.status.containerStatuses is not None
        assert [s.restartCount for s in pod.status.containerStatuses] == [0], name


async def test_while_the_agent_is_stopped_no_gpu_container_starts_and_all_run_enforced_after(
    cluster: LocalCluster,
) -> None:
    """SIGSTOP the agent (not its validator), create GPU pods: the first NRI call to meet the hung agent
    waits 2 s (the request timeout) and NRI goes on without it. When that call is a create, the default
    validator still counts the agent present and the agent's validator refuses the container (without
    it, the container starts bare: this test fails then); every later create is refused as the agent is
    gone from containerd's path. SIGCONT: the agent reconnects and the kubelet's next try creates each
    container with its plan. No container ever ran bare. (Which refusal each pod meets depends on which
    NRI call met the hang first; tests/node/nri/test_nri_validator.py pins the create case.)"""
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    agent, validator = node.agent_pid, node.validator_pid
    assert agent is not None and validator is not None
    names = ["stopped-a", "stopped-b"]
    refusals: dict[str, set[str]] = {}
    os.kill(agent, signal.SIGSTOP)
    try:
        for name in names:
            await cluster.client.create(_pod(name, annotations=FRACTION), namespace="default")
        await _never_bare(
            cluster, names, _all(_refused), what="be refused while the agent hangs", refusals=refusals
        )
    finally:
        os.kill(agent, signal.SIGCONT)
    pods = await _never_bare(
        cluster, names, _all(_running), what="run once the agent answers", timeout_s=90, refusals=refusals
    )
    assert all(_enforced_env(node, p) for p in pods.values())
    _started_once(pods)
    assert node.agent_pid == agent and node.validator_pid == validator  # the same processes throughout
    _refused_by_a_validator(refusals, names)
    await _delete(cluster, *names)


async def test_while_the_agent_is_dead_no_gpu_container_starts_and_all_run_enforced_after(
    cluster: LocalCluster,
) -> None:
    """SIGKILL the agent (a crash, the OOM killer) and create GPU pods before it is back: the window a
    DaemonSet's restart leaves. Refused until the new agent is in containerd's path, then run with it."""
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    names = ["killed-a", "killed-b"]
    await node.kill_agent()
    for name in names:
        await cluster.client.create(_pod(name, annotations=FRACTION), namespace="default")
    refusals: dict[str, set[str]] = {}
    await _never_bare(
        cluster, names, _all(_refused), what="be refused while the agent is dead", refusals=refusals
    )
    await node.start_agent()
    pods = await _never_bare(
        cluster, names, _all(_running), what="run once the agent is back", timeout_s=90, refusals=refusals
    )
    assert all(_enforced_env(node, p) for p in pods.values())
    _started_once(pods)
    _refused_by_a_validator(refusals, names)
    await _delete(cluster, *names)


async def test_an_agent_that_dies_on_its_own_is_restarted_and_serves_with_no_container_started_bare(
    cluster: LocalCluster,
) -> None:
    """`gpufrac up --runtime containerd` keeps the real node's agent running as the DaemonSet's kubelet
    would: SIGKILLed from outside (no ``kill_agent``, nobody calls ``start_agent``), it is restarted with
    back-off, the exit is counted and logged, and GPU pods created while it was dead run with their plan
    once it is back -- none of them bare meanwhile."""
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    agent = node.agent_pid
    assert agent is not None
    names = ["crashed-a", "crashed-b"]
    os.kill(agent, signal.SIGKILL)
    for name in names:
        await cluster.client.create(_pod(name, annotations=FRACTION), namespace="default")
    pods = await _never_bare(cluster, names, _all(_running), what="run once the agent is back", timeout_s=90)
    assert all(_enforced_env(node, p) for p in pods.values())
    _started_once(pods)
    restarted = cluster.components[f"node-agent-{NODE}"]
    assert restarted.alive and node.agent_pid == restarted.pid != agent
    assert [e.code for e in restarted.exits] == [-signal.SIGKILL]
    assert f"node-agent-{NODE} killed by SIGKILL after" in restarted.log.read_text()
    await _delete(cluster, *names)


async def test_a_slow_agent_never_lets_a_gpu_container_start_bare(cluster: LocalCluster) -> None:
    """The agent starved: stopped 2.5 s, running 0.5 s, over and over while GPU pods arrive, so some of
    its answers come after containerd's 2 s and some in time (and it reconnects after each time NRI
    drops it). Whatever each create meets, a container runs only with its plan; once the agent is
    steady again every pod runs."""
    assert cluster.client is not None and cluster.real_node is not None
    node = cluster.real_node
    agent = node.agent_pid
    assert agent is not None
    names = ["slow-a", "slow-b", "slow-c"]

    async def starve() -> None:
        try:
            while True:
                os.kill(agent, signal.SIGSTOP)
                await asyncio.sleep(2.5)
                os.kill(agent, signal.SIGCONT)
                await asyncio.sleep(0.5)
        finally:
            os.kill(agent, signal.SIGCONT)

    starving = asyncio.create_task(starve())
    try:
        for name in names:
            await cluster.client.create(_pod(name, annotations=FRACTION), namespace="default")
            await asyncio.sleep(0.7)
        # Through 15 s of starvation nothing may run bare (whatever runs is checked at every poll).
        until = time.monotonic() + 15
        await _never_bare(
            cluster, names, lambda _pods: time.monotonic() > until, what="be watched", timeout_s=30
        )
    finally:
        starving.cancel()
        await asyncio.gather(starving, return_exceptions=True)
    pods = await _never_bare(
        cluster, names, _all(_running), what="run once the agent is steady", timeout_s=90
    )
    assert all(_enforced_env(node, p) for p in pods.values())
    _started_once(pods)
    await _delete(cluster, *names)


async def test_a_pod_bound_as_kais_newer_binder_binds_it_runs_with_its_gpu_and_the_plan_inside(
    cluster: LocalCluster,
) -> None:
    """KAI Scheduler's newer NvFractions binder on a default-mode (time-slicing) pod: request, devices as
    an NVML UUID of this node's inventory, and the compute portion it writes on every bind
    (``tests/node/test_kai_binder_shapes.py``), merged by a Binding from the binder's identity (the
    trusted binder; gpufrac's scheduler never sees the pod). The container runs in runc; its process has
    the memory caps of the plan and no active-thread percentage, and containerd injected the CDI device
    ``nvidia.com/gpu=<uuid>`` the node agent requested (the simulated spec's variable shows it)."""
    assert cluster.client is not None and cluster.real_node is not None
    uuid = gpu_uuid(NODE, 3)
    pod = _pod("kai-notebook", annotations={"gpu-fraction": "0.5"}, gpu=False)
    assert pod.spec is not None
    pod.spec.nodeName = None
    pod.spec.schedulerName = "kai-scheduler"  # nobody here schedules it: the "binder" below places it
    created = await cluster.client.create(pod, namespace="default")
    assert created.metadata is not None
    binder = cluster.controlplane.async_client(impersonate=DEFAULT_SCHEDULER_USER)
    try:
        await bind_pod(
            binder,
            name="kai-notebook",
            namespace="default",
            node=NODE,
            uid=created.metadata.uid,
            annotations={
                keys.memory_request_key("app"): "40779Mi",  # floor(81559 MiB x 0.5), as KAI writes it
                keys.devices_key("app"): uuid,
                keys.compute_portion_key("app"): "0.5",
            },
        )
    finally:
        await binder.close()

    running = await _wait_pod(cluster, "kai-notebook", _running, what="run")
    environ = process_environ(cluster.real_node.container_pid(_container_id(running)))
    expected = _expected_env(running)
    assert {k: environ.get(k) for k in ENFORCEMENT_ENV} == {k: expected.get(k) for k in ENFORCEMENT_ENV}
    assert (environ[NVIDIA_VISIBLE_DEVICES], environ[NVIDIA_GPU_MEMORY_LIMIT]) == (uuid, "40779")
    assert CUDA_MPS_ACTIVE_THREAD_PERCENTAGE not in environ
    assert environ[f"{SIMULATED_CDI_ENV_PREFIX}3"] == uuid
    assert not [k for k in environ if k.startswith(SIMULATED_CDI_ENV_PREFIX) and not k.endswith("_3")]
    await _delete(cluster, "kai-notebook")


def _workload(kind: str, name: str, *, host_network: bool) -> Any:
    """A Deployment (one replica) or a DaemonSet of busybox sleepers that tolerate the GPU node's taint."""
    labels = {"app": name}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "containers": [
                    {
                        "name": "app",
                        "image": ociimage.WORKLOAD.ref,
                        "imagePullPolicy": "Never",
                        "command": list(SLEEP_COMMAND),
                    }
                ],
                "hostNetwork": host_network,
                "terminationGracePeriodSeconds": 1,
                "tolerations": [keys.managed_toleration()],
            },
        },
    }
    if kind == "Deployment":
        spec["replicas"] = 1
    return codecs.from_dict(
        {
            "apiVersion": "apps/v1",
            "kind": kind,
            "metadata": {"name": name, "namespace": "default"},
            "spec": spec,
        }
    )


async def _pods_of(cluster: LocalCluster, app: str) -> list[Pod]:
    assert cluster.client is not None
    return [p async for p in cluster.client.list(Pod, namespace="default", labels={"app": app})]


async def test_the_controllers_give_a_deployment_and_a_daemonset_pods_that_run_on_the_real_node(
    cluster: LocalCluster,
) -> None:
    """kube-controller-manager creates the pods of both (and the ServiceAccount token the Deployment's
    pod mounts), kube-scheduler places the Deployment's pod, the DaemonSet's pod is placed by its node
    affinity; the kubelet runs both in runc, the Deployment's on the CNI bridge."""
    assert cluster.client is not None and cluster.real_node is not None
    for kind, name, host_network in (("Deployment", "plain-deploy", False), ("DaemonSet", "plain-ds", True)):
        await cluster.client.create(_workload(kind, name, host_network=host_network))

    running: dict[str, Pod] = {}
    deadline = time.monotonic() + 90
    while len(running) < 2:
        for app in ("plain-deploy", "plain-ds"):
            running.update((app, p) for p in await _pods_of(cluster, app) if _running(p))
        assert time.monotonic() < deadline, f"only {sorted(running)} of the workloads' pods run"
        await asyncio.sleep(0.5)

    deployed = running["plain-deploy"]
    assert deployed.spec is not None and deployed.status is not None
    assert (deployed.spec.schedulerName, deployed.spec.nodeName) == ("default-scheduler", NODE)
    assert deployed.status.podIP and deployed.status.podIP.startswith(POD_SUBNET.rsplit(".", 1)[0])
    assert running["plain-ds"].spec is not None and running["plain-ds"].spec.nodeName == NODE

    # The ServiceAccount token the kubelet mounted (TokenRequest, signed with the API server's key; the
    # CA from the kube-root-ca.crt ConfigMap the controller manager publishes) is one the API server
    # accepts: an in-cluster client of this pod would authenticate.
    root = Path(f"/proc/{cluster.real_node.container_pid(_container_id(deployed))}/root")
    account = root / "var/run/secrets/kubernetes.io/serviceaccount"
    token = (account / "token").read_text()
    assert (account / "ca.crt").read_text() == cluster.controlplane.ca_file.read_text()
    verify = ssl.create_default_context(cafile=str(cluster.controlplane.ca_file))
    with httpx2.Client(base_url=cluster.controlplane.server, verify=verify, trust_env=False) as http:
        review = http.get("/apis", headers={"Authorization": f"Bearer {token}"})
    assert review.status_code == 200, review.text
    # ...and reaches it where in-cluster clients dial, the kubernetes Service (no kube-proxy here: the
    # node's DNAT, over the bridge's default route), from the pod's own network namespace.
    dial = (
        "import socket, ssl; s = socket.create_connection(('10.0.0.1', 443), timeout=5); "
        f"ssl.create_default_context(cafile={str(cluster.controlplane.ca_file)!r})"
        ".wrap_socket(s, server_hostname='10.0.0.1').close()"
    )
    pid = cluster.real_node.container_pid(_container_id(deployed))
    done = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", sys.executable, "-c", dial],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr

    # Deleting the Deployment: the garbage collector removes its ReplicaSet and pod.
    await cluster.client.delete(Deployment, "plain-deploy", namespace="default")
    await cluster.client.delete(DaemonSet, "plain-ds", namespace="default")
    deadline = time.monotonic() + 60
    while await _pods_of(cluster, "plain-deploy") or await _pods_of(cluster, "plain-ds"):
        assert time.monotonic() < deadline, "the garbage collector left the workloads' pods behind"
        await asyncio.sleep(0.5)


def _messages(pod: Pod) -> str:
    """Every waiting and terminated message of the pod's containers, now and last time."""
    found = []
    for status in (pod.status.containerStatuses or []) if pod.status else []:
        for state in (status.state, status.lastState):
            if state is None:
                continue
            for part in (state.waiting, state.terminated):
                if part is not None and part.message:
                    found.append(part.message)
    return "\n".join(found)


def _condition(pod: Pod) -> Any:
    conditions = (pod.status.conditions or []) if pod.status else []
    return next((c for c in conditions if c.type == keys.POD_MEMORY_ENFORCED_CONDITION), None)


def _driver(cluster: LocalCluster) -> SimulatedMemoryLimits:
    """The real node's SIMULATED driver (the agent's state file): it keys limits by REAL cgroups."""
    assert cluster.real_node is not None
    return SimulatedMemoryLimits(
        path=cluster.real_node.root / "node-agent" / "sim-memory-limits.json",
        gpus=tuple,
        driver_version=lambda: "615.20.01",
    )


def _process_cgroup(pid: int) -> str:
    """The cgroup directory the process lives in, read from the kernel (v2 unified, else v1 memory)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if unified and not controllers:
            return f"/sys/fs/cgroup{path}"
        if not unified and "memory" in controllers.split(","):
            return f"/sys/fs/cgroup/memory{path}"
    raise AssertionError(f"no cgroup for pid {pid}: {lines}")


async def test_the_limit_is_set_on_the_cgroup_the_container_process_lives_in(cluster: LocalCluster) -> None:
    """runc made the container's cgroup; the agent set soft = request, hard = limit on exactly that one
    (the one /proc/<pid>/cgroup names), on the GPU the scheduler assigned, and the pod says so."""
    assert cluster.client is not None and cluster.real_node is not None
    await cluster.client.create(_pod("enforced", annotations=FRACTION), namespace="default")
    pod = await _wait_pod(cluster, "enforced", _running, what="run")
    assert pod.metadata is not None
    (plan,) = read_binding(pod.metadata.annotations or {})
    cgroup = _process_cgroup(cluster.real_node.container_pid(_container_id(pod)))
    held = _driver(cluster).held()
    assert {gpu: per_gpu[cgroup] for gpu, per_gpu in held.items() if cgroup in per_gpu} == {
        device: MemoryLimits(soft=plan.request_mib * MIB, hard=(plan.limit_mib or plan.request_mib) * MIB)
        for device in plan.devices
    }
    enforced = await _wait_pod(cluster, "enforced", lambda p: _condition(p) is not None, what="say")
    condition = _condition(enforced)
    assert condition.status == "True" and condition.reason == keys.POD_REASON_LIMITS_READ_BACK
    assert cgroup in condition.message
    await _delete(cluster, "enforced")


async def test_a_container_whose_limit_cannot_be_set_never_runs_and_the_pod_says_why(
    cluster: LocalCluster,
) -> None:
    """The driver refuses the limit on every GPU: containerd fails the start (the NRI plugin refused
    it before the workload ran), the kubelet reports why, and the condition is False -- never a pod that
    looks enforced."""
    assert cluster.client is not None
    driver = _driver(cluster)
    gpus = [gpu_uuid(NODE, index) for index in range(8)]
    for gpu in gpus:
        driver.refuse(gpu=gpu, code=NVML_ERROR_NOT_SUPPORTED)
    try:
        await cluster.client.create(_pod("unenforced", annotations=FRACTION), namespace="default")
        refused = await _wait_pod(
            cluster,
            "unenforced",
            lambda p: _running(p) or "is not in force" in _messages(p),
            what="be refused or run",
        )
        assert not _running(refused), "a fraction whose limit was refused runs"
        assert "NVML_ERROR_NOT_SUPPORTED" in _messages(refused)
        said = await _wait_pod(cluster, "unenforced", lambda p: _condition(p) is not None, what="say")
        condition = _condition(said)
        assert condition.status == "False" and condition.reason == keys.POD_REASON_LIMITS_NOT_IN_FORCE
    finally:
        for gpu in gpus:
            driver.refuse(gpu=gpu, code=None)
        await _delete(cluster, "unenforced")


def _metric(text: str, name: str, pod: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'pod="{pod}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_a_running_fractions_limit_is_resized_on_its_cgroup_while_the_process_keeps_running(
    cluster: LocalCluster,
) -> None:
    """The scheduler grants a grow by patching the bound pod's amounts; the node agent's watch sees it and
    sets the new soft and hard limit on the cgroup the running process lives in (SIMULATED driver keyed by
    the REAL cgroup): the same process (same PID, never restarted) is now held to the new limit, and the
    pod's GpuMemoryEnforced condition and the limit series of /metrics say the new values."""
    assert cluster.client is not None and cluster.real_node is not None
    await cluster.client.create(_pod("resized", annotations=FRACTION), namespace="default")
    pod = await _wait_pod(cluster, "resized", _running, what="run")
    assert pod.metadata is not None
    (plan,) = read_binding(pod.metadata.annotations or {})
    assert plan.request_mib is not None and plan.limit_mib is not None
    container = _container_id(pod)
    pid = cluster.real_node.container_pid(container)
    cgroup = _process_cgroup(pid)
    driver = _driver(cluster)

    def held() -> dict[str, MemoryLimits]:
        return {gpu: per_gpu[cgroup] for gpu, per_gpu in driver.held().items() if cgroup in per_gpu}

    assert held() == {
        d: MemoryLimits(soft=plan.request_mib * MIB, hard=plan.limit_mib * MIB) for d in plan.devices
    }
    request, limit = plan.request_mib + 1024, plan.limit_mib + 4096
    scheduler = cluster.controlplane.async_client(impersonate=DEFAULT_SCHEDULER_USER)
    patched = time.monotonic()
    try:
        await scheduler.patch(
            Pod,
            "resized",
            {"metadata": {"annotations": {
                keys.memory_request_key("app"): f"{request}Mi",
                keys.memory_limit_key("app"): f"{limit}Mi",
            }}},
            namespace="default",
            patch_type=PatchType.MERGE,
        )  # fmt: skip
    finally:
        await scheduler.close()
    wanted = {d: MemoryLimits(soft=request * MIB, hard=limit * MIB) for d in plan.devices}
    while held() != wanted:
        assert time.monotonic() - patched < 30, f"the resize did not reach the cgroup: {held()}"
        await asyncio.sleep(0.05)

    assert cluster.real_node.container_pid(container) == pid and _process_cgroup(pid) == cgroup
    os.kill(pid, 0)  # the same process, still running
    after = await _wait_pod(
        cluster,
        "resized",
        lambda p: _condition(p) is not None and f"hard {limit} MiB" in _condition(p).message,
        what="say the new limit",
    )
    assert _condition(after).status == "True" and _container_id(after) == container
    statuses = after.status.containerStatuses if after.status is not None else None
    assert statuses and statuses[0].restartCount == 0
    assert cluster.real_node.metrics_url
    deadline = time.monotonic() + 30
    async with httpx2.AsyncClient() as http:
        while (
            _metric((await http.get(cluster.real_node.metrics_url)).text, FRACTION_MEMORY_LIMIT, "resized")
            != limit * MIB
        ):
            assert time.monotonic() < deadline, "the limit series did not show the new limit"
            await asyncio.sleep(0.5)
    await _delete(cluster, "resized")
