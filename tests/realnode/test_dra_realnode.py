"""DRA on the real node: the stock kube-scheduler allocates a 20Gi claim on our ResourceSlice, the real
kubelet asks our plugin to prepare it, and containerd applies our CDI spec -- read from the container's
process in the kernel (``/proc/<pid>/environ``), not from our records.

Everything runs with the embedded cluster's feature gates (``local.featuregates``): kube-apiserver (the
session's control plane), kube-scheduler and the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import (
    Container,
    HostPathVolumeSource,
    PodSpec,
    Toleration,
    Volume,
    VolumeMount,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceClaimTemplate

from gpufrac.contract import keys
from gpufrac.local import ociimage
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.dra import install_device_classes
from gpufrac.local.featuregates import feature_gates_flag
from gpufrac.local.processes import Spawned, spawn, terminate
from gpufrac.local.realnode import (
    SIMULATED_CDI_ENV_PREFIX,
    TESTENV_BIN,
    RealNode,
    missing_requirements,
    process_environ,
    runnable_here,
)
from gpufrac.local.simnodes import NodeShape, gpu_uuid
from gpufrac.node.dra.prepare import spec_path
from gpufrac.node.inject import NVIDIA_GPU_MEMORY_LIMIT, NVIDIA_GPU_MEMORY_REQUEST, NVIDIA_VISIBLE_DEVICES

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

NODE = "dra-gpu-000"


async def eventually(check: Callable[[], Awaitable[Any]], *, what: str, timeout: float = 120.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@pytest.fixture(scope="module")
async def dra_node(controlplane: ControlPlane) -> AsyncIterator[tuple[RealNode, AsyncClient]]:
    work = Path(tempfile.mkdtemp(prefix="dra-"))  # short: the plugin's unix sockets live under it
    client = controlplane.async_client()
    node = RealNode(
        name=NODE,
        kubeconfig=controlplane.kubeconfig,
        client=client,
        work_dir=work / "n",
        logs=work / "logs",
        shape=NodeShape(gpus=1, model="A100-80GB", gpu_mib=81920),  # exactly 80Gi: four 20Gi shares
        agent_argv=lambda: [sys.executable, "-m", "gpufrac"],
        apiserver=controlplane.server,
        dra=True,
    )
    scheduler: Spawned | None = None
    (work / "logs").mkdir(parents=True, exist_ok=True)
    # The controller manager lifts the not-ready taint a new Node gets (RealNode waits for that),
    # expands ResourceClaimTemplates into claims and deallocates claims whose pods are gone.
    controllers = spawn(
        name="kube-controller-manager",
        argv=[
            str(TESTENV_BIN / "kube-controller-manager"),
            f"--kubeconfig={controlplane.kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            feature_gates_flag(),
        ],
        logs=work / "logs",
    )
    try:
        await node.start()
        scheduler = spawn(
            name="kube-scheduler",
            argv=[
                str(TESTENV_BIN / "kube-scheduler"),
                f"--kubeconfig={controlplane.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                feature_gates_flag(),
            ],
            logs=work / "logs",
        )
        await install_device_classes(client, work_dir=work)  # the chart's, rendered by helm
        yield node, client
    finally:
        if scheduler is not None:
            await asyncio.to_thread(terminate, scheduler.popen)
        await node.stop()
        await asyncio.to_thread(terminate, controllers.popen)
        for mode in ("time-slicing", "sm-sharing"):
            with contextlib.suppress(Exception):
                await client.delete(DeviceClass, f"{mode}.{keys.DRA_DRIVER_NAME}")
        with contextlib.suppress(Exception):
            await client.delete(Node, NODE)
        await client.close()
        shutil.rmtree(work, ignore_errors=True)


def claim_for(name: str, namespace: str, memory: str) -> ResourceClaim:
    return ResourceClaim.from_dict(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": f"time-slicing.{keys.DRA_DRIVER_NAME}",
                                "capacity": {"requests": {keys.DRA_MEMORY_CAPACITY: memory}},
                            },
                        }
                    ]
                }
            },
        }
    )


def pod_with_claim(name: str, namespace: str, claim: str) -> Pod:
    return runnable_here(
        Pod(
            metadata=ObjectMeta(name=name, namespace=namespace),
            spec=PodSpec(
                containers=[Container(name="app", resources={"claims": [{"name": "gpu"}]})],  # type: ignore[arg-type]
                resourceClaims=[{"name": "gpu", "resourceClaimName": claim}],  # type: ignore[list-item]
                tolerations=[Toleration(key=keys.MANAGED_TAINT_KEY, operator="Exists")],
            ),
        )
    )


def running(pod: Pod) -> bool:
    statuses = (pod.status.containerStatuses or []) if pod.status else []
    return bool(statuses) and all(s.state is not None and s.state.running is not None for s in statuses)


def unschedulable(pod: Pod) -> bool:
    conditions = (pod.status.conditions or []) if pod.status else []
    return any(c.type == "PodScheduled" and c.status == "False" for c in conditions)


async def test_four_20gi_claims_share_an_80gi_gpu_a_fifth_does_not_fit_and_restarts_lose_nothing(
    dra_node: tuple[RealNode, AsyncClient], namespace: str
) -> None:
    node, client = dra_node
    names = [f"share-{i}" for i in range(5)]
    for name in names:
        await client.create(claim_for(name, namespace, "20Gi"))
        await client.create(pod_with_claim(name, namespace, name))

    async def pods() -> list[Pod]:
        return [await client.get(Pod, name, namespace=namespace) for name in names]

    async def four_run_one_waits() -> bool:
        current = await pods()
        return sum(map(running, current)) == 4 and sum(map(unschedulable, current)) == 1

    await eventually(four_run_one_waits, what="four claim pods running and the fifth unschedulable")
    current = await pods()
    (left_out,) = [p for p in current if unschedulable(p)]
    assert left_out.spec is not None and left_out.spec.nodeName is None
    uuid = gpu_uuid(NODE, 0)
    for pod in (p for p in current if running(p)):
        assert pod.spec is not None and pod.spec.nodeName == NODE  # kube-scheduler placed it
        assert pod.metadata is not None and pod.metadata.name is not None
        claim = (await client.get(ResourceClaim, pod.metadata.name, namespace=namespace)).to_dict()
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        # Its memory, and no compute: a time-slicing claim names none, and the policy's default is 0.
        assert result["consumedCapacity"] == {
            keys.DRA_MEMORY_CAPACITY: "20Gi",
            keys.DRA_COMPUTE_CAPACITY: "0",
        }
        # What the container's process got, from the kernel: our CDI spec's limits and the GPU's device.
        assert pod.status is not None and pod.status.containerStatuses
        env = process_environ(node.container_pid(pod.status.containerStatuses[0].containerID or ""))
        assert env[NVIDIA_VISIBLE_DEVICES] == uuid
        assert (env[NVIDIA_GPU_MEMORY_REQUEST], env[NVIDIA_GPU_MEMORY_LIMIT]) == ("20480", "20480")
        assert env[f"{SIMULATED_CDI_ENV_PREFIX}0"] == uuid

    # The node agent crashes (SIGKILL: none of its shutdown runs) and comes back: its plugin sockets are
    # made anew, the kubelet registers it again, and what was prepared before is still known -- the
    # CDI specs are the state. A pod gone later: the kubelet unprepares its claim through the new agent,
    # and the spec (with the claim's MPS leaf) goes.
    await node.kill_agent()
    await node.start_agent()
    # The kubelet restarts too: it finds the plugin's registration socket again and keeps the pods.
    await node.restart_kubelet()
    gone = next(p for p in current if running(p))
    assert gone.metadata is not None and gone.metadata.name is not None
    claim = (await client.get(ResourceClaim, gone.metadata.name, namespace=namespace)).to_dict()
    spec = spec_path(node.root / "cdi", claim["metadata"]["uid"])
    assert spec.exists()
    # The claim is deleted while its pod runs: the container keeps what it was given (the spec stays
    # until the pod is gone), and unprepare needs only the claim's UID, not the deleted object.
    await client.delete(ResourceClaim, gone.metadata.name, namespace=namespace)
    assert gone.status is not None and gone.status.containerStatuses
    pid = node.container_pid(gone.status.containerStatuses[0].containerID or "")
    assert process_environ(pid)[NVIDIA_GPU_MEMORY_LIMIT] == "20480" and spec.exists()
    await client.delete(Pod, gone.metadata.name, namespace=namespace)

    async def unprepared() -> bool:
        return not spec.exists()

    await eventually(unprepared, what="the kubelet to unprepare the claim (its CDI spec removed)")

    # The rest go too, and their claims with them (the GPU is free for the next test).
    for pod in current:
        if pod is not gone and pod.metadata is not None and pod.metadata.name is not None:
            await client.delete(Pod, pod.metadata.name, namespace=namespace)

    async def nothing_prepared() -> bool:
        return not list((node.root / "cdi").glob(f"{keys.DRA_DRIVER_NAME}-*.json"))

    await eventually(nothing_prepared, what="every claim unprepared", timeout=180)


def template_pod(name: str, namespace: str, *, template: str, gate: Path) -> Pod:
    """A pod whose claim comes from ``template``; its init container waits until ``gate``/go exists, so
    the test holds the pod between prepare (before the sandbox) and the start of its GPU container."""
    pod = runnable_here(
        Pod(
            metadata=ObjectMeta(name=name, namespace=namespace),
            spec=PodSpec(
                containers=[Container(name="app", resources={"claims": [{"name": "gpu"}]})],  # type: ignore[arg-type]
                resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": template}],  # type: ignore[list-item]
                tolerations=[Toleration(key=keys.MANAGED_TAINT_KEY, operator="Exists")],
                volumes=[Volume(name="gate", hostPath=HostPathVolumeSource(path=str(gate)))],
            ),
        )
    )
    assert pod.spec is not None
    pod.spec.initContainers = [
        Container(
            name="gate",
            image=ociimage.WORKLOAD.ref,
            imagePullPolicy="Never",
            command=["/bin/sh", "-c", "until [ -e /gate/go ]; do sleep 0.2; done"],
            volumeMounts=[VolumeMount(name="gate", mountPath="/gate")],
        )
    ]
    return pod


async def test_a_claim_template_is_expanded_and_its_claim_survives_an_agent_restart_before_start(
    dra_node: tuple[RealNode, AsyncClient], namespace: str, tmp_path: Path
) -> None:
    node, client = dra_node
    await client.create(
        ResourceClaimTemplate.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "gpu-20gi", "namespace": namespace},
                "spec": {"spec": claim_for("unused", namespace, "20Gi").to_dict()["spec"]},
            }
        )
    )
    gate = tmp_path / "gate"
    gate.mkdir()
    await client.create(template_pod("templated", namespace, template="gpu-20gi", gate=gate))

    async def generated() -> str | None:
        pod = await client.get(Pod, "templated", namespace=namespace)
        statuses = (pod.status.resourceClaimStatuses or []) if pod.status else []
        return next((s.resourceClaimName for s in statuses if s.resourceClaimName), None)

    await eventually(generated, what="kube-controller-manager to create the pod's claim from the template")
    claim_name = await generated()
    assert claim_name is not None
    claim = (await client.get(ResourceClaim, claim_name, namespace=namespace)).to_dict()
    assert [o["name"] for o in claim["metadata"]["ownerReferences"]] == ["templated"]
    spec = spec_path(node.root / "cdi", claim["metadata"]["uid"])

    async def held_at_the_gate() -> bool:
        pod = await client.get(Pod, "templated", namespace=namespace)
        inits = (pod.status.initContainerStatuses or []) if pod.status else []
        return spec.exists() and any(s.state is not None and s.state.running is not None for s in inits)

    await eventually(held_at_the_gate, what="the claim prepared and the pod held before its GPU container")
    # Exactly between prepare and container start: the agent dies (SIGKILL, none of its shutdown runs).
    # The container starts while it is away -- the runtime reads our CDI spec, not the agent -- and gets
    # its share; the agent comes back and unprepares the claim when the pod goes.
    await node.kill_agent()
    (gate / "go").touch()

    async def app_running() -> bool:
        return running(await client.get(Pod, "templated", namespace=namespace))

    await eventually(app_running, what="the GPU container to start while the agent is down")
    pod = await client.get(Pod, "templated", namespace=namespace)
    assert pod.status is not None and pod.status.containerStatuses
    env = process_environ(node.container_pid(pod.status.containerStatuses[0].containerID or ""))
    assert (env[NVIDIA_GPU_MEMORY_REQUEST], env[NVIDIA_GPU_MEMORY_LIMIT]) == ("20480", "20480")
    assert env[NVIDIA_VISIBLE_DEVICES] == gpu_uuid(NODE, 0)

    await node.start_agent()
    await client.delete(Pod, "templated", namespace=namespace)

    async def released() -> bool:
        claims = [c async for c in client.list(ResourceClaim, namespace=namespace)]
        return not spec.exists() and not claims

    await eventually(released, what="the claim unprepared by the restarted agent and deleted with its pod")
