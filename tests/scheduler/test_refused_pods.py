"""Pods that got past no webhook (created before it existed, or with it off) and that the scheduler
must leave pending with the reason, neither binding them nor crashing on them (issue 11).

A GPU container whose name leaves no room for the scheduler's keys: the Binding merges its annotations
into the pod without the API server's key check, so a scheduler that bound such a pod would store a key
like ``nvidia.com/container.<35 chars>.gpu-memory.request`` (64 characters after the prefix) and every
later update of the pod would fail with 422, finalizer removal included. A quantity of thousands of
digits: Python's int conversion raised ValueError, and the scheduler crash-looped while the pod waited.
"""

from __future__ import annotations

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from sched_harness import Pool, add_nodes, condition, gpu_pod, nodes_of, running, wait_bound, wait_for

from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.request import ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.scheduler.binder import Binder, Outcome
from gpufrac.scheduler.objects import node_inventory

pytestmark = pytest.mark.kube

LONG = "tokenizer-and-embedding-server-east"  # 35 characters: its request key's name part would be 64


async def test_a_pod_the_scheduler_could_not_annotate_ends_unschedulable_with_the_reason(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1)
    with pytest.raises(InvalidPodRequest) as contract:
        parse_pod({"gpu-fraction": "0.5"}, [ContainerSpec(name=LONG)])
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "long", {"gpu-fraction": "0.5"}, containers=(LONG,)))
        await client.create(gpu_pod(pool, "short", {"gpu-fraction": "0.5"}))
        await wait_bound(client, pool.namespace, 1, timeout=20)

        async def reported() -> bool:
            pod = await client.get(Pod, "long", namespace=pool.namespace)
            return condition(pod)[0] == "False"

        await wait_for(reported, timeout=20, what="the long-named pod reported")
        pod = await client.get(Pod, "long", namespace=pool.namespace)
        assert not pod.spec.nodeName
        status, reason, message = condition(pod)
        assert (status, reason, message) == ("False", "Unschedulable", str(contract.value))
        assert f"{keys.NVIDIA_CONTAINER_PREFIX}{LONG}.gpu-memory.request" in (message or "")
        assert "at most 34 characters" in (message or "")
        # The pod stays an ordinary object: labels (and finalizers) can still be changed.
        await client.patch(Pod, "long", {"metadata": {"labels": {"seen": "yes"}}}, namespace=pool.namespace)


async def test_the_binder_writes_nothing_when_the_contract_refuses_to_render(
    client: AsyncClient, pool: Pool
) -> None:
    """A request that skipped the parse-time check (an older scheduler's, or one built by hand) still
    never reaches the API: the binder answers UNWRITABLE with the contract's sentence."""
    (node,) = await add_nodes(client, pool, count=1)
    gpu = sorted(g.uuid for g in node_inventory((await nodes_of(client, pool))[0]))[0]
    pod = await client.create(gpu_pod(pool, "long", {"gpu-fraction": "0.5"}, containers=(LONG,)))
    half = GpuMemory(portion=0.5)
    request = PodGpuRequest(containers=(ContainerGpuRequest(container=LONG, request=half, limit=half),))
    placement = Placement(
        pod_uid=pod.metadata.uid,
        node=node,
        containers=(
            ContainerPlacement(
                LONG, request.containers[0].mode, False, (DeviceAssignment(gpu, 0, 1024, 1024, None),)
            ),
        ),
    )
    result = await Binder(client=client, fence=lambda: True).bind(pod, request=request, placement=placement)
    assert result.outcome is Outcome.UNWRITABLE
    assert f"{keys.NVIDIA_CONTAINER_PREFIX}{LONG}.gpu-memory.request" in result.detail
    stored = await client.get(Pod, "long", namespace=pool.namespace)
    assert not stored.spec.nodeName
    assert stored.metadata.resourceVersion == pod.metadata.resourceVersion  # nothing was written


async def test_a_quantity_of_thousands_of_digits_is_reported_and_the_scheduler_keeps_placing(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1)
    huge = {keys.memory_request_key("app"): "9" * 5000 + "Mi"}
    with pytest.raises(InvalidPodRequest) as contract:
        parse_pod(huge, [ContainerSpec(name="app")])
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "huge", huge))

        async def reported() -> bool:
            pod = await client.get(Pod, "huge", namespace=pool.namespace)
            return condition(pod)[0] == "False"

        await wait_for(reported, timeout=20, what="the huge pod reported")
        pod = await client.get(Pod, "huge", namespace=pool.namespace)
        assert condition(pod) == ("False", "Unschedulable", str(contract.value))
        assert "a quantity must be at most 64 characters long (it has 5002)" in str(contract.value)
        # The scheduler lives on: a pod created afterwards is placed.
        await client.create(gpu_pod(pool, "after", {"gpu-fraction": "0.5"}))
        pods = await wait_bound(client, pool.namespace, 1, timeout=20)
        assert [p.metadata.name for p in pods if p.spec.nodeName] == ["after"]
