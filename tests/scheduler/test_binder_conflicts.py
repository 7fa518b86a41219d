"""The atomic Binding's resourceVersion precondition against a pod that changed since it was placed.

A preemptor is placed the moment its last victim is gone, often before the informer has shown the
status the scheduler itself just wrote (its nomination, its PodScheduled condition): that bump alone
must not fail the bind, or the freed room is released and taken by another pod. A change to what the
placement was computed from (the pod's GPU request in its annotations) must still fail it.
"""

from __future__ import annotations

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from sched_harness import Pool, add_nodes, gpu_pod, nodes_of

from gpufrac.contract import keys
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.kube.patch import set_nominated_node
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement
from gpufrac.scheduler.binder import Binder, Outcome
from gpufrac.scheduler.objects import node_inventory

pytestmark = pytest.mark.kube


async def placed_half(client: AsyncClient, pool: Pool, name: str) -> tuple[Pod, Placement]:
    (node,) = await add_nodes(client, pool, count=1, prefix=name)
    gpu = sorted(g.uuid for g in node_inventory((await nodes_of(client, pool))[0]))[0]
    pod = await client.create(gpu_pod(pool, name, {keys.GPU_FRACTION: "0.5"}))
    request = parse_pod({keys.GPU_FRACTION: "0.5"}, [ContainerSpec(name="app")])
    c = request.containers[0]
    devices = (DeviceAssignment(gpu, 0, 8192, 8192, None),)
    return pod, Placement(pod.metadata.uid, node, (ContainerPlacement("app", c.mode, False, devices),))


async def test_a_pod_whose_status_moved_since_it_was_placed_is_bound_at_once(
    client: AsyncClient, pool: Pool
) -> None:
    pod, placement = await placed_half(client, pool, "nominated")
    # The scheduler's own write the informer has not shown yet: a preemptor's nomination.
    await set_nominated_node(client, name="nominated", namespace=pool.namespace, node=placement.node)
    request = parse_pod(pod.metadata.annotations, [ContainerSpec(name="app")])
    result = await Binder(client=client, fence=lambda: True).bind(pod, request=request, placement=placement)
    assert result.outcome is Outcome.BOUND
    stored = await client.get(Pod, "nominated", namespace=pool.namespace)
    assert stored.spec.nodeName == placement.node


async def test_a_pod_whose_request_changed_since_it_was_placed_is_not_bound(
    client: AsyncClient, pool: Pool
) -> None:
    pod, placement = await placed_half(client, pool, "edited")
    # The user asked for more since the decision: the placement no longer describes the pod.
    await client.patch(
        Pod, "edited", {"metadata": {"annotations": {keys.GPU_FRACTION: "0.9"}}}, namespace=pool.namespace
    )
    request = parse_pod(pod.metadata.annotations, [ContainerSpec(name="app")])
    result = await Binder(client=client, fence=lambda: True).bind(pod, request=request, placement=placement)
    assert result.outcome is Outcome.CONFLICT
    stored = await client.get(Pod, "edited", namespace=pool.namespace)
    assert not stored.spec.nodeName
