"""Time-based fair share through the real API server (issue #36): a queue that used the cluster gets less
of the over-quota GPUs, so a queue that did not reclaims more from it than the plain fair share allows;
the history survives a restart through ``Queue.status.historicalUsage``.

One node of 2 A100-80GB GPUs, two queues of no deserved quota and equal weights. Queue a has used the
whole cluster (its status says so, as a scheduler that ran before this one wrote it) and holds all four
halves; queue b asks for four. The plain fair share splits the GPUs 2/2 (two reclaims). With k = 0.75,
KAI's portion max(w + k (w - u), 0) gives a 0.5 + 0.75 (0.5 - 1) = 0.125 and b 0.875: fair shares 20480
and 143360 MiB, three reclaims (half a pod of margin either way, as the history moves a little each pass).
"""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Pod
from lightkube.types import PatchType
from sched_harness import Pool, add_nodes, gpu_pod, running, wait_bound, wait_for
from test_queues import _create, queue_crds, queues  # noqa: F401  (fixtures)

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.queues import GpufracQueue

HALF = {"gpu-fraction": "0.5"}  # 40960 MiB of an 81920 MiB GPU
GPU_MIB = 81920


def half_pod(pool: Pool, name: str, queue: str) -> Pod:
    pod = gpu_pod(pool, name, HALF, labels={keys.QUEUE_LABEL: queue})
    pod.spec.terminationGracePeriodSeconds = 0
    return pod


async def status_of(client: AsyncClient, name: str) -> dict[str, Any]:
    return (await client.get(GpufracQueue, name)).status or {}


async def test_a_queue_that_used_the_cluster_loses_more_to_one_that_did_not(
    client: AsyncClient,
    pool: Pool,
    queues: list[tuple[type, str]],  # noqa: F811
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2, model="A100-80GB"))
    ns, p = pool.namespace, pool.id
    a, b = f"{p}-a", f"{p}-b"
    for name in (a, b):
        await _create(client, queues, GpufracQueue, name, {"resources": {"gpuMemory": {"deserved": 0}}})
    # What an earlier scheduler wrote: a used all of the cluster's GPU memory, b nothing.
    await client.patch(
        GpufracQueue.Status,
        a,
        {"status": {"historicalUsage": {"gpuMemory": 1.0, "gpus": 0.0}}},
        patch_type=PatchType.MERGE,
    )
    config = pool.config(
        queue_status_interval_s=0.2,
        node_heartbeat_expiry_s=None,
        time_fairness={"k": 0.75, "half_life_s": 3600},
    )
    async with running(client, config) as service:
        for i in range(4):
            await client.create(half_pod(pool, f"a-{i}", a))
        await wait_bound(client, ns, 4, timeout=60)

        async def history_in_force() -> bool:
            # The scheduler seeds its history from the status and writes it back on its first pass.
            return "historicalUsage" in (await status_of(client, b))

        await wait_for(history_in_force, timeout=20, what="the usage history written back")
        for i in range(4):
            await client.create(half_pod(pool, f"b-{i}", b))

        async def b_holds_three() -> bool:
            pods = [x async for x in client.list(Pod, namespace=ns)]
            return sum(1 for x in pods if x.metadata.name.startswith("b-") and x.spec.nodeName) == 3

        await wait_for(b_holds_three, timeout=60, what="three b pods bound")
        # A few more passes: nothing more is taken (a is at its time-based share, b at its own).
        passes = service.queue_status.passes
        await wait_for(lambda: _at_least(service.queue_status.passes, passes + 5), timeout=20, what="passes")
        events = [e async for e in client.list(Event, namespace=ns) if e.reason == "Reclaimed"]
        assert sorted(e.involvedObject.name[:2] for e in events) == ["a-", "a-", "a-"], events

        async def shares_written() -> bool:
            sa, sb = await status_of(client, a), await status_of(client, b)
            fa = sa.get("fairShare", {}).get("gpuMemory") or 0
            fb = sb.get("fairShare", {}).get("gpuMemory") or 0
            return abs(fa - GPU_MIB // 4) < 1000 and abs(fb - GPU_MIB * 7 // 4) < 1000

        await wait_for(shares_written, timeout=20, what="fair shares ~20480 / ~143360 in the queue status")
        # The seeded history was kept and written back: a hour-long half-life barely moves it in seconds.
        used_a = (await status_of(client, a))["historicalUsage"]["gpuMemory"]
        used_b = (await status_of(client, b))["historicalUsage"]["gpuMemory"]
        assert 0.99 <= used_a <= 1.0 and 0 <= used_b < 0.01, (used_a, used_b)


async def _at_least(value: int, target: int) -> bool:
    return value >= target
