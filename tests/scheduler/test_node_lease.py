"""The node agent's heartbeat is its node's Lease, and the scheduler judges nodes by it (real API server).

An agent that is OOM-killed or hangs leaves its Node saying Ready. Its Lease stops moving instead: the
scheduler takes the node out of placement once the Lease is older than ``node_heartbeat_expiry_s``, and
puts it back when renewals resume. The renewer here is the agent's own (``gpufrac.node.heartbeat``).
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node, Pod
from sched_harness import (
    Pool,
    add_nodes,
    condition,
    gpu_pod,
    metric,
    running,
    scrape,
    set_agent_heartbeat,
    wait_bound,
    wait_for,
)

from gpufrac.node.heartbeat import NodeLease

EXPIRED = "0/1 nodes are available: 1 node agent heartbeat(s) expired."


async def test_a_node_whose_lease_is_renewed_takes_pods_and_one_whose_lease_stops_does_not(
    client: AsyncClient, pool: Pool
) -> None:
    (node,) = await add_nodes(client, pool, count=1)
    # The Node's own heartbeat is an hour old: only the Lease can keep this node placeable.
    await set_agent_heartbeat(client, node, datetime.now(UTC) - timedelta(hours=1))
    renewer = NodeLease(client=client, node_name=node, renew_s=0.5, namespace=pool.namespace)
    renewing = asyncio.create_task(renewer.run())
    try:
        config = pool.config(node_heartbeat_expiry_s=4, node_lease_namespace=pool.namespace)
        async with running(client, config) as service:
            await client.create(gpu_pod(pool, "while-alive", {"gpu-fraction": "0.25"}))
            (bound,) = await wait_bound(client, pool.namespace, 1, timeout=20)
            assert bound.spec.nodeName == node
            lease = await client.get(Lease, node, namespace=pool.namespace)
            assert lease.spec.holderIdentity == node
            assert [o.kind for o in lease.metadata.ownerReferences or []] == ["Node"]

            renewing.cancel()  # the agent is OOM-killed: its Lease stops moving, its Node still says True
            await asyncio.gather(renewing, return_exceptions=True)
            stopped = time.monotonic()

            async def expired() -> bool:
                return (
                    metric(await scrape(service.probe_port), "gpufrac_scheduler_nodes_heartbeat_expired") == 1
                )

            await wait_for(expired, timeout=20, interval=0.05, what="the node taken out of placement")
            print(
                f"lease expiry detected {time.monotonic() - stopped:.1f}s after the last renewal (expiry 4s)"
            )
            await client.create(gpu_pod(pool, "while-dead", {"gpu-fraction": "0.25"}))

            async def refused() -> bool:
                return condition(await client.get(Pod, "while-dead", namespace=pool.namespace))[2] == EXPIRED

            await wait_for(refused, timeout=20, what="PodScheduled=False")
            assert not (await client.get(Pod, "while-dead", namespace=pool.namespace)).spec.nodeName

            renewing = asyncio.create_task(renewer.run())  # the agent is back
            pods = await wait_bound(client, pool.namespace, 2, timeout=20)
            assert all(p.spec.nodeName == node for p in pods)
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)


async def test_renewing_the_lease_does_not_write_the_node(client: AsyncClient, pool: Pool) -> None:
    (node,) = await add_nodes(client, pool, count=1)
    before = (await client.get(Node, node)).metadata.resourceVersion
    renewer = NodeLease(client=client, node_name=node, renew_s=0.05, namespace=pool.namespace)
    for _ in range(5):
        await renewer.renew_once()
    assert renewer.renewals == 5
    assert (await client.get(Node, node)).metadata.resourceVersion == before
