"""gpufrac-scheduler and DRA claims of gpufrac's driver, against the real API server (DRAConsumableCapacity
on): claim pods placed by the engine with the allocation kube-scheduler would write, which the node's
prepare accepts; one ledger for claims (whoever allocated them) and annotation pods; compute modes kept
apart for claims as for annotation pods.

The nodes are simulated (no GPUs on this machine): their inventory annotation and ResourceSlice are
what a node agent publishes for them (the slice through the node agent's own publisher).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice
from lightkube.types import PatchType
from sched_harness import Pool, add_nodes, condition, gpu_pod, nodes_of, pods_of, running, wait_for

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode
from gpufrac.kube.errors import Conflict, api_errors
from gpufrac.local.simnodes import NodeShape
from gpufrac.node.dra.prepare import prepare_claim
from gpufrac.node.dra.slices import ResourceSlicePublisher, slice_name
from gpufrac.node.inject import NVIDIA_GPU_MEMORY_LIMIT, NVIDIA_GPU_MEMORY_REQUEST
from gpufrac.node.inventory.backend import GpuInfo, NodeInventory
from gpufrac.node.mps.mode import DriverVersion, capability_for
from gpufrac.scheduler.booking_audit import audit
from gpufrac.scheduler.claim_front import ClaimWriter
from gpufrac.scheduler.claims import gpu_device_name
from gpufrac.scheduler.objects import node_inventory

pytestmark = pytest.mark.kube

GPU_80GI = NodeShape(gpus=2, gpu_mib=81920)
TIME_SLICING = f"{ComputeMode.TIME_SLICING.value}.{keys.DRA_DRIVER_NAME}"
SM_SHARING = f"{ComputeMode.SM_SHARING.value}.{keys.DRA_DRIVER_NAME}"


# -- the world: classes, slices, claims ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def chart_classes(client: AsyncClient) -> AsyncIterator[None]:
    """The chart's DeviceClasses (deploy/helm/gpufrac/templates/dra-deviceclasses.yaml; their shape is
    checked in tests/deploy/test_chart_dra.py), for the test's duration (cluster-wide objects)."""
    created = []
    attributes = {ComputeMode.TIME_SLICING: "timeSlicing", ComputeMode.SM_SHARING: "smSharing"}
    for mode, attribute in attributes.items():
        driver = keys.DRA_DRIVER_NAME
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": f"{mode.value}.{driver}"},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{driver}" && '
                            f'device.attributes["{driver}"].{attribute}'
                        }
                    }
                ],
                "config": [
                    {
                        "opaque": {
                            "driver": driver,
                            "parameters": {
                                "apiVersion": keys.DRA_CONFIG_API_VERSION,
                                "kind": keys.DRA_CONFIG_KIND,
                                keys.DRA_CONFIG_COMPUTE_MODE: mode.value,
                            },
                        }
                    }
                ],
            },
        }
        with contextlib.suppress(Conflict), api_errors():
            await client.create(DeviceClass.from_dict(body))
            created.append(body["metadata"]["name"])
    try:
        yield
    finally:
        for name in created:
            with contextlib.suppress(Exception):
                await client.delete(DeviceClass, name)


async def publish_slices(client: AsyncClient, nodes: list[str]) -> None:
    """Each node's ResourceSlice, written by the node agent's publisher from the node's inventory."""
    capability = capability_for(driver=DriverVersion.parse("615.20.01"), mps_running=True)
    for name in nodes:
        node = await client.get(Node, name)
        gpus = tuple(
            GpuInfo(uuid=g.uuid, index=g.index, minor=g.index, model=g.model, mib=g.memory_mib)
            for g in node_inventory(node)
        )
        publisher = ResourceSlicePublisher(client=client, node_name=name)
        await publisher.sync(
            inventory=NodeInventory(driver_version="615.20.01", cuda_driver_version="13.0", gpus=gpus),
            capability=capability,
        )


@pytest.fixture
async def dra_nodes(client: AsyncClient, pool: Pool) -> AsyncIterator[list[str]]:
    """One simulated node of two 80Gi GPUs with its ResourceSlice; the classes exist."""
    async with chart_classes(client), dra_pool_nodes(client, pool, shape=GPU_80GI) as nodes:
        yield nodes


@contextlib.asynccontextmanager
async def dra_pool_nodes(client: AsyncClient, pool: Pool, *, shape: NodeShape) -> AsyncIterator[list[str]]:
    nodes = await add_nodes(client, pool, count=1, shape=shape)
    await publish_slices(client, nodes)
    try:
        yield nodes
    finally:
        for name in nodes:
            with contextlib.suppress(Exception):
                await client.delete(ResourceSlice, slice_name(name))


def claim_body(
    pool: Pool, name: str, *, device_class: str = TIME_SLICING, memory: str | None = "20Gi", **exactly: Any
) -> dict[str, Any]:
    request: dict[str, Any] = {"deviceClassName": device_class, **exactly}
    if memory is not None:
        request.setdefault("capacity", {"requests": {}})["requests"][keys.DRA_MEMORY_CAPACITY] = memory
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": pool.namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }


async def create_claim(client: AsyncClient, body: dict[str, Any]) -> ResourceClaim:
    with api_errors():
        return await client.create(ResourceClaim.from_dict(body))  # type: ignore[no-any-return]


def claim_pod(pool: Pool, name: str, *, claim: str | None = None, template: str | None = None) -> Pod:
    entry: dict[str, Any] = {"name": "gpu"}
    if claim is not None:
        entry["resourceClaimName"] = claim
    if template is not None:
        entry["resourceClaimTemplateName"] = template
    return Pod.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": pool.namespace},
            "spec": {
                "schedulerName": pool.scheduler_name,
                "resourceClaims": [entry],
                "containers": [
                    {
                        "name": "app",
                        "image": "busybox",
                        "resources": {
                            "requests": {"cpu": "100m", "memory": "128Mi"},
                            "claims": [{"name": "gpu"}],
                        },
                    }
                ],
            },
        }
    )


async def get_pod(client: AsyncClient, pool: Pool, name: str) -> Pod:
    return await client.get(Pod, name, namespace=pool.namespace)


async def get_claim(client: AsyncClient, pool: Pool, name: str) -> dict[str, Any]:
    return (await client.get(ResourceClaim, name, namespace=pool.namespace)).to_dict()


async def wait_pod_bound(client: AsyncClient, pool: Pool, name: str, *, timeout: float = 30) -> Pod:
    async def bound() -> bool:
        return bool((await get_pod(client, pool, name)).spec.nodeName)

    await wait_for(bound, timeout=timeout, what=f"pod {name} bound")
    return await get_pod(client, pool, name)


async def wait_unschedulable(client: AsyncClient, pool: Pool, name: str, *, says: str) -> str:
    message = ""

    async def reported() -> bool:
        nonlocal message
        status, _, message = condition(await get_pod(client, pool, name))
        return status == "False" and says in (message or "")

    await wait_for(reported, timeout=30, what=f"pod {name} unschedulable with {says!r} (last: {message!r})")
    return message


def allocated_device(claim: dict[str, Any]) -> str:
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 1
    return str(results[0]["device"])


async def devices_by_gpu(client: AsyncClient, node: str) -> dict[str, str]:
    """Device name -> GPU UUID, as the node's slice names them."""
    return {gpu_device_name(g): g.uuid for g in node_inventory(await client.get(Node, node))}


async def annotation_gpu(client: AsyncClient, pool: Pool, name: str) -> str:
    pod = await wait_pod_bound(client, pool, name)
    return (pod.metadata.annotations or {})[keys.devices_key("app")]


# -- claim pods placed by gpufrac-scheduler ---------------------------------------------------------------


async def test_a_claim_pod_is_placed_with_the_allocation_kube_scheduler_writes_and_the_node_prepares_it(
    client: AsyncClient, pool: Pool, dra_nodes: list[str], tmp_path: Path
) -> None:
    node = dra_nodes[0]
    await create_claim(client, claim_body(pool, "share", memory="20000Mi"))
    async with running(client, pool.config()):
        await client.create(claim_pod(pool, "infer", claim="share"))
        pod = await wait_pod_bound(client, pool, "infer")
    assert pod.spec.nodeName == node
    assert not any(k.startswith(keys.NVIDIA_CONTAINER_PREFIX) for k in pod.metadata.annotations or {})

    claim = await get_claim(client, pool, "share")
    assert keys.DRA_CLAIM_FINALIZER in claim["metadata"]["finalizers"]
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "infer", "uid": pod.metadata.uid}]
    allocation = claim["status"]["allocation"]
    devices = await devices_by_gpu(client, node)
    (result,) = allocation["devices"]["results"]
    assert result["driver"] == keys.DRA_DRIVER_NAME and result["pool"] == node and result["request"] == "gpu"
    assert result["device"] in devices
    # 20000Mi rounded by the slice's policy (whole MiB: unchanged), every capacity recorded.
    assert result["consumedCapacity"] == {keys.DRA_MEMORY_CAPACITY: "20000Mi", keys.DRA_COMPUTE_CAPACITY: "0"}
    assert result["shareID"]
    assert allocation["devices"]["config"] == [
        {
            "source": "FromClass",
            "requests": ["gpu"],
            "opaque": {
                "driver": keys.DRA_DRIVER_NAME,
                "parameters": {
                    "apiVersion": keys.DRA_CONFIG_API_VERSION,
                    "kind": keys.DRA_CONFIG_KIND,
                    keys.DRA_CONFIG_COMPUTE_MODE: ComputeMode.TIME_SLICING.value,
                },
            },
        }
    ]
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    }

    # The node's prepare accepts it: the share is exactly what an annotation pod of 20000 MiB gets.
    (share,) = prepare_claim(claim, uuids=devices, pipe_root=str(tmp_path))
    bound = share.plan.bound
    assert bound.devices == (devices[result["device"]],)
    assert (bound.request_mib, bound.limit_mib, bound.mode) == (20000, 20000, ComputeMode.TIME_SLICING)
    env = dict(share.plan.env)
    assert (env[NVIDIA_GPU_MEMORY_REQUEST], env[NVIDIA_GPU_MEMORY_LIMIT]) == ("20000", "20000")


async def test_an_sm_sharing_claim_gets_its_compute_portion_and_memory_limit_from_the_claim(
    client: AsyncClient, pool: Pool, dra_nodes: list[str], tmp_path: Path
) -> None:
    body = claim_body(
        pool,
        "mps",
        device_class=SM_SHARING,
        memory=None,
        capacity={"requests": {"memory": "10Gi", "compute": "25"}},
    )
    body["spec"]["devices"]["config"] = [
        {
            "requests": ["gpu"],
            "opaque": {
                "driver": keys.DRA_DRIVER_NAME,
                "parameters": {
                    "apiVersion": keys.DRA_CONFIG_API_VERSION,
                    "kind": keys.DRA_CONFIG_KIND,
                    keys.DRA_CONFIG_MEMORY_LIMIT: "12Gi",
                },
            },
        }
    ]
    await create_claim(client, body)
    async with running(client, pool.config()):
        await client.create(claim_pod(pool, "mps-pod", claim="mps"))
        await wait_pod_bound(client, pool, "mps-pod")
    claim = await get_claim(client, pool, "mps")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {keys.DRA_MEMORY_CAPACITY: "10Gi", keys.DRA_COMPUTE_CAPACITY: "25"}
    sources = [c["source"] for c in claim["status"]["allocation"]["devices"]["config"]]
    assert sources == ["FromClass", "FromClaim"]
    (share,) = prepare_claim(claim, uuids=await devices_by_gpu(client, dra_nodes[0]), pipe_root=str(tmp_path))
    bound = share.plan.bound
    assert (bound.mode, bound.request_mib, bound.limit_mib) == (ComputeMode.SM_SHARING, 10240, 12288)
    assert bound.compute_portion == pytest.approx(0.25)


async def test_a_claim_that_names_no_memory_takes_a_whole_gpu(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    await create_claim(client, claim_body(pool, "whole", memory=None))
    await create_claim(client, claim_body(pool, "whole-too", memory=None))
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "small", {keys.memory_request_key("app"): "1Gi"}))
        small_gpu = await annotation_gpu(client, pool, "small")
        await client.create(claim_pod(pool, "w1", claim="whole"))
        await wait_pod_bound(client, pool, "w1")
        # The only empty GPU is taken: a second whole-GPU claim waits.
        await client.create(claim_pod(pool, "w2", claim="whole-too"))
        await wait_unschedulable(client, pool, "w2", says="not enough whole free GPUs")
    claim = await get_claim(client, pool, "whole")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"][keys.DRA_MEMORY_CAPACITY] == "80Gi"  # the slice's default: all of it
    assert (await devices_by_gpu(client, dra_nodes[0]))[result["device"]] != small_gpu


async def test_a_template_claim_pod_waits_for_its_claim_then_is_placed(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    async with running(client, pool.config()):
        pod = await client.create(claim_pod(pool, "templated", template="gpu-20gi"))
        await wait_unschedulable(
            client, pool, "templated", says="waiting for the ResourceClaim of template gpu-20gi"
        )
        # What kube-controller-manager's resourceclaim controller does: the claim, owned by the pod, and
        # its name in the pod's status.
        body = claim_body(pool, "templated-gpu-x1")
        body["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": "templated",
                "uid": pod.metadata.uid,
                "controller": True,
            }
        ]
        await create_claim(client, body)
        await client.patch(
            Pod.Status,
            "templated",
            {"status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "templated-gpu-x1"}]}},
            namespace=pool.namespace,
            patch_type=PatchType.MERGE,
        )
        bound = await wait_pod_bound(client, pool, "templated")
    claim = await get_claim(client, pool, "templated-gpu-x1")
    assert claim["status"]["reservedFor"][0]["uid"] == bound.metadata.uid
    assert (
        claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"][keys.DRA_MEMORY_CAPACITY]
        == "20Gi"
    )


async def test_a_shared_claim_counts_once_and_its_second_pod_follows_it(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    """Two pods on one claim of 50Gi on an 80Gi GPU: one share booked, not two (a third pod's 50Gi
    claim goes to the other GPU, and a fourth finds no room)."""
    for name in ("shared", "second", "third"):
        await create_claim(client, claim_body(pool, name, memory="50Gi"))
    async with running(client, pool.config()):
        await client.create(claim_pod(pool, "a", claim="shared"))
        await wait_pod_bound(client, pool, "a")
        await client.create(claim_pod(pool, "b", claim="shared"))
        await wait_pod_bound(client, pool, "b")
        await client.create(claim_pod(pool, "c", claim="second"))
        await wait_pod_bound(client, pool, "c")
        await client.create(claim_pod(pool, "d", claim="third"))
        await wait_unschedulable(client, pool, "d", says="insufficient GPU memory")
    shared, second = await get_claim(client, pool, "shared"), await get_claim(client, pool, "second")
    assert [r["name"] for r in shared["status"]["reservedFor"]] == ["a", "b"]
    assert allocated_device(shared) != allocated_device(second)
    assert "allocation" not in (await get_claim(client, pool, "third")).get("status", {})


async def test_claims_of_other_drivers_and_cel_selectors_are_refused_by_name(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    other = f"nic-{pool.id}.example.com"
    with contextlib.suppress(Conflict), api_errors():
        await client.create(
            DeviceClass.from_dict(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": other},
                    "spec": {},
                }
            )
        )
    try:
        await create_claim(client, claim_body(pool, "nic", device_class=other, memory=None))
        await create_claim(
            client,
            claim_body(
                pool,
                "picky",
                selectors=[
                    {"cel": {"expression": f'device.attributes["{keys.DRA_DRIVER_NAME}"].model == "x"'}}
                ],
            ),
        )
        async with running(client, pool.config()):
            await client.create(claim_pod(pool, "nic-pod", claim="nic"))
            await client.create(claim_pod(pool, "picky-pod", claim="picky"))
            await client.create(claim_pod(pool, "lost-pod", claim="missing"))
            message = await wait_unschedulable(client, pool, "nic-pod", says="is not a class of driver")
            assert f"deviceClassName='{other}'" in message and "use kube-scheduler" in message
            await wait_unschedulable(client, pool, "picky-pod", says="does not evaluate CEL selectors")
            await wait_unschedulable(client, pool, "lost-pod", says="the claim does not exist")
    finally:
        await client.delete(DeviceClass, other)


# -- one ledger -------------------------------------------------------------------------------------------


async def allocate_as_kube_scheduler(
    client: AsyncClient, pool: Pool, name: str, *, node: str, device: str, memory: str, mode: ComputeMode
) -> None:
    """Write a claim's allocation the way the stock kube-scheduler does (another scheduler's work)."""
    claim = await client.get(ResourceClaim, name, namespace=pool.namespace)
    allocation = {
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": keys.DRA_DRIVER_NAME,
                    "pool": node,
                    "device": device,
                    "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: memory, keys.DRA_COMPUTE_CAPACITY: "0"},
                    "shareID": "4a9a6f1e-0000-4000-8000-000000000001",
                }
            ],
            "config": [
                {
                    "source": "FromClass",
                    "requests": ["gpu"],
                    "opaque": {
                        "driver": keys.DRA_DRIVER_NAME,
                        "parameters": {
                            "apiVersion": keys.DRA_CONFIG_API_VERSION,
                            "kind": keys.DRA_CONFIG_KIND,
                            keys.DRA_CONFIG_COMPUTE_MODE: mode.value,
                        },
                    },
                }
            ],
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    await client.patch(
        ResourceClaim.Status,
        name,
        {
            "metadata": {"resourceVersion": claim.metadata.resourceVersion},
            "status": {"allocation": allocation},
        },
        namespace=pool.namespace,
        patch_type=PatchType.MERGE,
    )


async def deallocate(client: AsyncClient, pool: Pool, name: str) -> None:
    """What kube-controller-manager does once a claim's pods are gone."""
    await client.patch(
        ResourceClaim.Status,
        name,
        {"status": {"allocation": None, "reservedFor": None}},
        namespace=pool.namespace,
        patch_type=PatchType.MERGE,
    )


async def test_a_claim_another_scheduler_allocated_holds_its_memory_against_annotation_pods(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    node = dra_nodes[0]
    devices = await devices_by_gpu(client, node)
    first = sorted(devices)[0]
    await create_claim(client, claim_body(pool, "stock", memory="70Gi"))
    # Allocated before the scheduler starts: its books are built from the API.
    await allocate_as_kube_scheduler(
        client, pool, "stock", node=node, device=first, memory="70Gi", mode=ComputeMode.TIME_SLICING
    )
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "small", {keys.memory_request_key("app"): "20Gi"}))
        # 10Gi free next to the claim: the 20Gi pod goes to the other GPU.
        assert await annotation_gpu(client, pool, "small") != devices[first]
        # 60Gi left on that GPU and 10Gi on the claim's: a 70Gi pod waits...
        await client.create(gpu_pod(pool, "big", {keys.memory_request_key("app"): "70Gi"}))
        await wait_unschedulable(client, pool, "big", says="insufficient GPU memory")
        # ... until the claim is deallocated, then it gets the claim's GPU.
        await deallocate(client, pool, "stock")
        assert await annotation_gpu(client, pool, "big") == devices[first]


async def test_a_restarted_scheduler_books_the_claims_it_allocated_from_the_api(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    devices = await devices_by_gpu(client, dra_nodes[0])
    await create_claim(client, claim_body(pool, "big", memory="70Gi"))
    async with running(client, pool.config(), identity="first"):
        await client.create(claim_pod(pool, "claimant", claim="big"))
        await wait_pod_bound(client, pool, "claimant")
    held = devices[allocated_device(await get_claim(client, pool, "big"))]
    async with running(client, pool.config(), identity="second"):
        await client.create(gpu_pod(pool, "after", {keys.memory_request_key("app"): "70Gi"}))
        assert await annotation_gpu(client, pool, "after") != held
        # Both GPUs hold 70Gi now: a second 70Gi pod has nowhere to go.
        await client.create(gpu_pod(pool, "more", {keys.memory_request_key("app"): "70Gi"}))
        await wait_unschedulable(client, pool, "more", says="insufficient GPU memory")


async def test_claim_pods_and_annotation_pods_never_over_commit_a_gpu(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    """Both kinds on one node of two 80Gi GPUs, in one burst: every GPU's claims plus annotation pods
    stay within 80Gi, and what does not fit waits."""
    for i in range(4):
        await create_claim(client, claim_body(pool, f"c{i}", memory="30Gi"))
    async with running(client, pool.config()):
        for i in range(4):
            await client.create(claim_pod(pool, f"claim-{i}", claim=f"c{i}"))
            await client.create(gpu_pod(pool, f"anno-{i}", {keys.memory_request_key("app"): "30Gi"}))

        async def settled() -> bool:
            pods = await pods_of(client, pool.namespace)
            return all(p.spec.nodeName or condition(p)[0] == "False" for p in pods) and len(pods) == 8

        await wait_for(settled, timeout=30, what="every pod bound or reported")
        pods = await pods_of(client, pool.namespace)
        claims = [c async for c in client.list(ResourceClaim, namespace=pool.namespace)]
        report = audit(nodes=await nodes_of(client, pool), pods=pods, claims=claims)
        assert report.ok, report.problems
        # Two 30Gi shares per 80Gi GPU, whichever kind: four of the eight pods fit.
        assert sum(1 for p in pods if p.spec.nodeName) == 4
        assert sorted(b.request_mib for b in report.gpus.values()) == [61440, 61440]
        assert sum(len(b.pods) for b in report.gpus.values()) == 4


# -- compute modes ----------------------------------------------------------------------------------------


async def test_an_sm_sharing_claim_never_lands_on_a_gpu_holding_time_slicing_shares(
    client: AsyncClient, pool: Pool, dra_nodes: list[str]
) -> None:
    node = dra_nodes[0]
    devices = await devices_by_gpu(client, node)
    first, second = sorted(devices)
    # GPU one: a time-slicing claim (another scheduler's); GPU two: a time-slicing annotation pod (too
    # big to join the claim).
    await create_claim(client, claim_body(pool, "ts", memory="10Gi"))
    await allocate_as_kube_scheduler(
        client, pool, "ts", node=node, device=first, memory="10Gi", mode=ComputeMode.TIME_SLICING
    )
    await create_claim(client, claim_body(pool, "mps", device_class=SM_SHARING, memory="10Gi"))
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "ts-pod", {keys.memory_request_key("app"): "75Gi"}))
        assert await annotation_gpu(client, pool, "ts-pod") == devices[second]
        await client.create(claim_pod(pool, "mps-pod", claim="mps"))
        await wait_unschedulable(client, pool, "mps-pod", says="compute-mode conflict")
        # The time-slicing claim goes: its GPU is empty again, and the sm-sharing claim takes it.
        await deallocate(client, pool, "ts")
        await wait_pod_bound(client, pool, "mps-pod")
        assert allocated_device(await get_claim(client, pool, "mps")) == first
        # An sm-sharing annotation pod keeps off the time-slicing GPU and joins the claim's.
        await client.create(
            gpu_pod(
                pool,
                "mps-anno",
                {
                    keys.memory_request_key("app"): "10Gi",
                    keys.compute_mode_key("app"): ComputeMode.SM_SHARING.value,
                },
            )
        )
        assert await annotation_gpu(client, pool, "mps-anno") == devices[first]


async def test_a_time_slicing_annotation_pod_waits_while_an_sm_sharing_claim_holds_the_only_gpu(
    client: AsyncClient, pool: Pool
) -> None:
    async with chart_classes(client), dra_pool_nodes(client, pool, shape=NodeShape(gpus=1, gpu_mib=81920)):
        await create_claim(client, claim_body(pool, "mps", device_class=SM_SHARING, memory="10Gi"))
        async with running(client, pool.config()):
            await client.create(claim_pod(pool, "mps-pod", claim="mps"))
            await wait_pod_bound(client, pool, "mps-pod")
            await client.create(gpu_pod(pool, "ts-pod", {keys.memory_request_key("app"): "10Gi"}))
            await wait_unschedulable(client, pool, "ts-pod", says="compute-mode conflict")
            await deallocate(client, pool, "mps")
            await wait_pod_bound(client, pool, "ts-pod")


async def test_a_claim_changed_or_deleted_under_the_writer_is_not_allocated_and_says_why(
    client: AsyncClient, pool: Pool
) -> None:
    """The writer's preconditions: a claim that changed since it was read is left alone (the pod is
    placed again on the claim's new version), and a deleted one is reported as such."""
    stale = await create_claim(client, claim_body(pool, "moving"))
    await client.patch(
        ResourceClaim, "moving", {"metadata": {"labels": {"touched": "yes"}}}, namespace=pool.namespace
    )
    gone = await create_claim(client, claim_body(pool, "gone"))
    await client.delete(ResourceClaim, "gone", namespace=pool.namespace)
    pod = Pod.from_dict({"metadata": {"name": "p", "namespace": pool.namespace, "uid": "0000-pod"}})
    writer = ClaimWriter(client=client, fence=lambda: True)
    allocation = {"devices": {"results": [], "config": []}}
    landed, error = await writer.write(pod, claims=[stale], allocations={stale.metadata.uid: allocation})
    assert landed == set() and error is not None and "ResourceClaim" in error and "changed" in error
    assert "allocation" not in (await get_claim(client, pool, "moving")).get("status", {})
    landed, error = await writer.write(pod, claims=[gone], allocations={gone.metadata.uid: allocation})
    assert landed == set() and error == f"ResourceClaim {pool.namespace}/gone was deleted"
    landed, error = await ClaimWriter(client=client, fence=lambda: False).write(
        pod, claims=[stale], allocations={}
    )
    assert error == "this scheduler is no longer the leader"


async def test_two_writers_of_one_claim_allocate_it_once_and_the_loser_reserves_it_after_reading_it_again(
    client: AsyncClient, pool: Pool
) -> None:
    """Two schedulers read the same claim (finalizer already on) and each writes an allocation at that
    version: the API server takes the first and refuses the second (409), so the claim holds one
    allocation; the loser, reading the claim again, only adds its pod to ``reservedFor``."""
    await create_claim(client, claim_body(pool, "contended"))
    await client.patch(
        ResourceClaim,
        "contended",
        {"metadata": {"finalizers": [keys.DRA_CLAIM_FINALIZER]}},
        namespace=pool.namespace,
        patch_type=PatchType.MERGE,
    )
    read = await client.get(ResourceClaim, "contended", namespace=pool.namespace)

    def allocation(device: str) -> dict[str, Any]:
        result = {
            "request": "gpu",
            "driver": keys.DRA_DRIVER_NAME,
            "pool": "node-a",
            "device": device,
            "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: "20Gi"},
            "shareID": f"00000000-0000-4000-8000-00000000000{device[-1]}",
        }
        return {"devices": {"results": [result], "config": []}}

    def pod(name: str) -> Pod:
        return Pod.from_dict({"metadata": {"name": name, "namespace": pool.namespace, "uid": f"uid-{name}"}})

    writer = ClaimWriter(client=client, fence=lambda: True)
    uid = read.metadata.uid
    landed, error = await writer.write(pod("first"), claims=[read], allocations={uid: allocation("gpu-0")})
    assert (landed, error) == ({uid}, None)
    landed, error = await writer.write(pod("second"), claims=[read], allocations={uid: allocation("gpu-1")})
    assert landed == set() and error is not None and "changed while it was being allocated" in error
    status = (await get_claim(client, pool, "contended"))["status"]
    assert allocated_device({"status": status}) == "gpu-0"
    assert [r["name"] for r in status["reservedFor"]] == ["first"]

    again = await client.get(ResourceClaim, "contended", namespace=pool.namespace)
    landed, error = await writer.write(pod("second"), claims=[again], allocations={})
    assert (landed, error) == (set(), None)
    claim = await get_claim(client, pool, "contended")
    assert allocated_device(claim) == "gpu-0"
    assert claim["status"]["allocation"]["devices"]["results"][0]["shareID"].endswith("0")
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["first", "second"]
    assert claim["metadata"]["finalizers"] == [keys.DRA_CLAIM_FINALIZER]
