"""Reclaim through the real API server, decided against the books as they will be (issue #36).

docs/queues.md's worked example tree on 4 nodes of 2 A100-80GB GPUs, every GPU full of 40 GiB pods. The
victims carry a finalizer, so after their eviction they stay terminating (booked, holding their GPUs)
until the test lets them go, as pods with a long grace period would: every later decision is taken while
the earlier victims are still there, which is what emptied the wrong queue before.
"""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Pod
from lightkube.types import PatchType
from sched_harness import Pool, add_nodes, condition, gpu_pod, running, wait_bound, wait_for
from test_queues import _create, queue_crds, queues  # noqa: F401  (fixtures)

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.queues import GpufracQueue

FINALIZER = "gpufrac.io/test-still-terminating"
HALF = {"gpu-fraction": "0.5"}  # 40960 MiB of an 81920 MiB GPU


def worked_example(pool: Pool) -> dict[str, dict[str, Any]]:
    """docs/queues.md's tree, names prefixed by the pool."""
    p = pool.id
    return {
        f"{p}-research": {"resources": {"gpuMemory": {"deserved": 327680, "overQuotaWeight": 2}}},
        f"{p}-vision": {"parentQueue": f"{p}-research", "resources": {"gpuMemory": {"deserved": 163840}}},
        f"{p}-nlp": {
            "parentQueue": f"{p}-research",
            "resources": {"gpuMemory": {"deserved": 163840, "overQuotaWeight": 3}},
        },
        f"{p}-prod": {"resources": {"gpuMemory": {"deserved": 245760, "limit": 327680}}},
        f"{p}-batch": {"resources": {"gpuMemory": {"deserved": 0}}},
    }


def half_pod(pool: Pool, name: str, queue: str) -> Pod:
    pod = gpu_pod(pool, name, HALF, labels={keys.QUEUE_LABEL: queue})
    pod.metadata.finalizers = [FINALIZER]
    pod.spec.terminationGracePeriodSeconds = 0
    return pod


async def reclaimed(client: AsyncClient, namespace: str) -> list[Event]:
    return [e async for e in client.list(Event, namespace=namespace) if e.reason == "Reclaimed"]


async def test_five_prod_pods_reclaim_from_batch_only_and_the_fifth_its_limit_refuses_evicts_nobody(
    client: AsyncClient,
    pool: Pool,
    queues: list[tuple[type, str]],  # noqa: F811
) -> None:
    await add_nodes(client, pool, count=4, shape=NodeShape(gpus=2, model="A100-80GB"))
    ns, p = pool.namespace, pool.id
    for name, spec in worked_example(pool).items():
        await _create(client, queues, GpufracQueue, name, spec)
    config = pool.config(queue_status_interval_s=0.2, node_heartbeat_expiry_s=None)
    async with running(client, config) as service:
        # Before: batch 245760 (6 pods), prod 163840 (4), vision 204800 (5), nlp 40960 (1): all 16 halves.
        for queue, count in (("batch", 6), ("prod", 4), ("vision", 5), ("nlp", 1)):
            for i in range(count):
                await client.create(half_pod(pool, f"{queue}-{i}", f"{p}-{queue}"))
        await wait_bound(client, ns, 16, timeout=60)
        for i in range(4, 9):
            await client.create(half_pod(pool, f"prod-{i}", f"{p}-prod"))

        async def four_reclaims() -> bool:
            return len(await reclaimed(client, ns)) >= 4

        await wait_for(four_reclaims, timeout=60, what="four reclaims")
        # A few more cycles: nothing more is taken while the victims are still terminating.
        passes = service.queue_status.passes
        await wait_for(lambda: _at_least(service.queue_status.passes, passes + 5), timeout=20, what="passes")
        events = await reclaimed(client, ns)
        victims = sorted(e.involvedObject.name for e in events)
        assert len(victims) == 4 and all(v.startswith("batch-") for v in victims), victims
        assert (
            f"queue {p}-prod" in events[0].message and f"reclaiming from queue {p}-batch" in events[0].message
        )
        assert service.preemptions is not None and service.preemptions.evictions == 4

        # The victims finish terminating: the four nominated prod pods bind; the fifth (whichever came
        # last) stays out, refused by prod's limit, having evicted nobody.
        for name in victims:
            await client.patch(
                Pod, name, {"metadata": {"finalizers": None}}, namespace=ns, patch_type=PatchType.MERGE
            )

        async def prod_bound() -> bool:
            pods = [x async for x in client.list(Pod, namespace=ns)]
            return sum(1 for x in pods if x.metadata.name.startswith("prod-") and x.spec.nodeName) == 8

        await wait_for(prod_bound, timeout=60, what="eight prod pods bound")
        (fifth,) = [
            x
            async for x in client.list(Pod, namespace=ns)
            if x.metadata.name.startswith("prod-") and not x.spec.nodeName
        ]
        # Refused for memory (the cluster is full), and told why nobody is evicted for it.
        assert condition(fifth)[2].endswith(
            f"No pod is evicted for it: queue {p}-prod would exceed its GPU-memory limit of 327680 MiB, "
            "counting its nominated pods."
        ), condition(fifth)
        assert service.preemptions.evictions == 4

        async def allocations() -> dict[str, int]:
            out = {}
            for queue in ("prod", "batch", "vision", "nlp"):
                status = (await client.get(GpufracQueue, f"{p}-{queue}")).status or {}
                out[queue] = status.get("allocated", {}).get("gpuMemory")
            return out

        expected = {"prod": 327680, "batch": 81920, "vision": 204800, "nlp": 40960}

        async def settled() -> bool:
            return await allocations() == expected

        await wait_for(settled, timeout=20, what=f"queue status {expected}")
        # Let the remaining pods go at teardown.
        for x in [x async for x in client.list(Pod, namespace=ns)]:
            await client.patch(
                Pod,
                x.metadata.name,
                {"metadata": {"finalizers": None}},
                namespace=ns,
                patch_type=PatchType.MERGE,
            )


async def _at_least(value: int, target: int) -> bool:
    return value >= target
