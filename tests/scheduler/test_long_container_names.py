"""A GPU container whose name leaves no room for the scheduler's keys is never bound (issue 11).

The Binding merges its annotations into the pod without the API server's key check, so a scheduler
that bound such a pod would store a key like ``nvidia.com/container.<35 chars>.gpu-memory.request``
(64 characters after the prefix) and every later update of the pod would fail with 422, finalizer
removal included. These pods got past no webhook (created before it existed, or with it off); the
scheduler must leave them pending and say why.
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
    result = await Binder(client=client, fence=lambda: True).bind(
        pod, request=request, placement=placement, gpu_mib={gpu: 81920}
    )
    assert result.outcome is Outcome.UNWRITABLE
    assert f"{keys.NVIDIA_CONTAINER_PREFIX}{LONG}.gpu-memory.request" in result.detail
    stored = await client.get(Pod, "long", namespace=pool.namespace)
    assert not stored.spec.nodeName
    assert stored.metadata.resourceVersion == pod.metadata.resourceVersion  # nothing was written
