"""``gpufrac up --runtime containerd --dra``: the embedded cluster, its one real node the DRA driver.

The cluster's own kube-controller-manager and kube-scheduler (with its feature gates) expand a
ResourceClaimTemplate and allocate the claim on the node's slice; the classes are the chart's, installed
by ``up``; the container's process has the share's limits from our CDI spec. gpufrac-scheduler, which
``up`` runs too, allocates claims on the same GPU through the same ledger.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from lightkube.models.core_v1 import Container, PodSpec, Toleration
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceClaimTemplate

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode
from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.featuregates import feature_gates_flag
from gpufrac.local.realnode import missing_requirements, process_environ, runnable_here
from gpufrac.local.simnodes import NodeShape, gpu_uuid
from gpufrac.node.inject import NVIDIA_GPU_MEMORY_LIMIT, NVIDIA_VISIBLE_DEVICES

pytestmark = pytest.mark.kube

_missing = missing_requirements()
if _missing:
    pytest.skip(f"no real node on this machine: it lacks {'; '.join(_missing)}", allow_module_level=True)

NODE = "up-dra-000"


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    shape = ClusterShape(
        nodes=1,
        prefix="up-dra-",
        node=NodeShape(gpus=1, model="A100-80GB", gpu_mib=81920),
        runtime="containerd",
        dra=True,
    )
    assert shape.node_names == [NODE]
    async with LocalCluster(shape=shape) as local:
        yield local


async def eventually(check: Callable[[], Awaitable[Any]], *, what: str, timeout: float = 120.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_up_with_dra_runs_a_pod_whose_claim_comes_from_a_template(cluster: LocalCluster) -> None:
    for component in ("kube-controller-manager", "kube-scheduler"):
        assert feature_gates_flag() in cluster.components[component].argv  # the cluster's one setting
    client = cluster.client
    assert client is not None
    classes = {c.metadata.name async for c in client.list(DeviceClass) if c.metadata is not None}
    assert {f"{mode.value}.{keys.DRA_DRIVER_NAME}" for mode in ComputeMode} <= classes

    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": f"{ComputeMode.TIME_SLICING.value}.{keys.DRA_DRIVER_NAME}",
            "capacity": {"requests": {keys.DRA_MEMORY_CAPACITY: "20Gi"}},
        },
    }
    await client.create(
        ResourceClaimTemplate.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "gpu-20gi", "namespace": "default"},
                "spec": {"spec": {"devices": {"requests": [request]}}},
            }
        )
    )
    await client.create(
        runnable_here(
            Pod(
                metadata=ObjectMeta(name="infer", namespace="default"),
                spec=PodSpec(
                    containers=[Container(name="app", resources={"claims": [{"name": "gpu"}]})],  # type: ignore[arg-type]
                    resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "gpu-20gi"}],  # type: ignore[list-item]
                    tolerations=[Toleration(key=keys.MANAGED_TAINT_KEY, operator="Exists")],
                ),
            )
        )
    )

    async def running() -> bool:
        pod = await client.get(Pod, "infer", namespace="default")
        statuses = (pod.status.containerStatuses or []) if pod.status else []
        return bool(statuses) and all(s.state is not None and s.state.running is not None for s in statuses)

    await eventually(running, what="the claim pod to run on the real node")
    pod = await client.get(Pod, "infer", namespace="default")
    assert pod.spec is not None and pod.spec.nodeName == NODE
    assert pod.status is not None and pod.status.containerStatuses
    node = cluster.real_node
    assert node is not None
    env = process_environ(node.container_pid(pod.status.containerStatuses[0].containerID or ""))
    assert (env[NVIDIA_VISIBLE_DEVICES], env[NVIDIA_GPU_MEMORY_LIMIT]) == (gpu_uuid(NODE, 0), "20480")

    # kubectl gpufrac top shows the claim's container as a fraction: the claim's 20Gi as request and limit.
    async def in_top() -> bool:
        done = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "gpufrac.kubectl",
                "--kubeconfig",
                str(cluster.kubeconfig),
                "top",
                "--once",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        rows = [line.split("│") for line in done.stdout.splitlines() if "default/infer/app" in line]
        return [[c.strip() for c in row[4:8]] for row in rows] == [
            ["time-slicing", "20.0Gi", "20.0Gi", "0Mi"]
        ]

    await eventually(in_top, what="kubectl gpufrac top to show default/infer/app", timeout=30)
    await client.delete(Pod, "infer", namespace="default")


def claim(name: str, *, mode: ComputeMode, memory: str) -> ResourceClaim:
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": f"{mode.value}.{keys.DRA_DRIVER_NAME}",
            "capacity": {"requests": {keys.DRA_MEMORY_CAPACITY: memory}},
        },
    }
    return ResourceClaim.from_dict(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [request]}},
        }
    )


def claim_pod(name: str, *, claim_name: str, scheduler: str | None) -> Pod:
    return runnable_here(
        Pod(
            metadata=ObjectMeta(name=name, namespace="default"),
            spec=PodSpec(
                schedulerName=scheduler,
                containers=[Container(name="app", resources={"claims": [{"name": "gpu"}]})],  # type: ignore[arg-type]
                resourceClaims=[{"name": "gpu", "resourceClaimName": claim_name}],  # type: ignore[list-item]
                tolerations=[Toleration(key=keys.MANAGED_TAINT_KEY, operator="Exists")],
            ),
        )
    )


async def test_the_stock_scheduler_and_gpufrac_scheduler_share_the_gpu_through_one_ledger(
    cluster: LocalCluster,
) -> None:
    """A claim allocated by kube-scheduler and one allocated by gpufrac-scheduler run side by side on
    the one GPU, each with its own limits from our CDI spec; an sm-sharing claim for gpufrac-scheduler
    then waits, since the GPU holds time-slicing shares (one compute mode per GPU)."""
    client = cluster.client
    assert client is not None
    node = cluster.real_node
    assert node is not None
    await client.create(claim("stock-20gi", mode=ComputeMode.TIME_SLICING, memory="20Gi"))
    await client.create(claim("ours-10gi", mode=ComputeMode.TIME_SLICING, memory="10Gi"))
    await client.create(claim("ours-mps", mode=ComputeMode.SM_SHARING, memory="10Gi"))
    await client.create(claim_pod("stock", claim_name="stock-20gi", scheduler=None))
    await client.create(claim_pod("ours", claim_name="ours-10gi", scheduler=keys.DEFAULT_SCHEDULER_NAME))

    async def limit_of(name: str) -> str | None:
        pod = await client.get(Pod, name, namespace="default")
        statuses = (pod.status.containerStatuses or []) if pod.status else []
        if not statuses or statuses[0].state is None or statuses[0].state.running is None:
            return None
        env = process_environ(node.container_pid(statuses[0].containerID or ""))
        return env[NVIDIA_GPU_MEMORY_LIMIT]

    async def both_run() -> bool:
        return (await limit_of("stock"), await limit_of("ours")) == ("20480", "10240")

    await eventually(both_run, what="the stock-scheduled and the gpufrac-scheduled claim pods to run")
    ours = await client.get(ResourceClaim, "ours-10gi", namespace="default")
    results = ours.to_dict()["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [(keys.DRA_DRIVER_NAME, NODE)]

    await client.create(claim_pod("ours-mps", claim_name="ours-mps", scheduler=keys.DEFAULT_SCHEDULER_NAME))

    async def refused() -> bool:
        pod = await client.get(Pod, "ours-mps", namespace="default")
        conditions = (pod.status.conditions or []) if pod.status else []
        return any(
            c.type == "PodScheduled" and "compute-mode conflict" in (c.message or "") for c in conditions
        )

    await eventually(refused, what="the sm-sharing claim pod to wait with the mode conflict")
    pod = await client.get(Pod, "ours-mps", namespace="default")
    assert pod.spec is not None and not pod.spec.nodeName
    for name in ("stock", "ours", "ours-mps"):
        await client.delete(Pod, name, namespace="default")
