"""Min-runtime, the preemption delay and the victim's DisruptionTarget condition, through the real API
server (issue #36).

Victims carry a finalizer, so after their eviction they stay terminating and their conditions can be
read: the Eviction API writes DisruptionTarget with its own reason (``EvictionByEvictionAPI``), and the
scheduler then says which kind of removal it was, for whom and which queues.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType
from sched_harness import Pool, add_nodes, condition, gpu_pod, running, wait_bound, wait_for
from test_preemption import events
from test_queues import _create, queue_crds, queues  # noqa: F401  (fixtures)

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.queues import GpufracQueue

FINALIZER = "gpufrac.io/test-still-terminating"


def victim_pod(pool: Pool, name: str, *, queue: str | None = None, priority: str | None = None) -> Pod:
    pod = gpu_pod(pool, name, labels={keys.QUEUE_LABEL: queue} if queue else None, whole_gpus=1)
    pod.spec.priorityClassName = priority
    pod.spec.terminationGracePeriodSeconds = 0
    pod.metadata.finalizers = [FINALIZER]
    return pod


async def start(client: AsyncClient, namespace: str, name: str, when: datetime) -> None:
    """What a kubelet writes when it starts the pod."""
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    await client.patch(
        Pod.Status, name, {"status": {"phase": "Running", "startTime": stamp}}, namespace=namespace
    )


async def let_go(client: AsyncClient, namespace: str) -> None:
    async for pod in client.list(Pod, namespace=namespace):
        await client.patch(
            Pod,
            pod.metadata.name,
            {"metadata": {"finalizers": None}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )


def disruption(pod: Pod) -> tuple[str | None, str | None]:
    found = [c for c in (pod.status.conditions or []) if c.type == "DisruptionTarget" and c.status == "True"]
    return (found[0].reason, found[0].message) if found else (None, None)


@pytest.mark.parametrize("where", ["queue", "scheduler default"])
async def test_reclaim_waits_until_the_victims_have_run_their_queues_minimum_and_says_so(
    client: AsyncClient,
    pool: Pool,
    queues: list[tuple[type, str]],  # noqa: F811
    where: str,
) -> None:
    """The minimum set on the victim's Queue, or (none set on its path) the scheduler's default."""
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2))
    ns, p = pool.namespace, pool.id
    half = {"gpuMemory": {"deserved": 81559}, "gpus": {"deserved": 1}}
    await _create(client, queues, GpufracQueue, f"{p}-a", {"resources": half})
    on_queue = {"reclaimMinRuntime": "4s"} if where == "queue" else {}
    await _create(client, queues, GpufracQueue, f"{p}-b", {"resources": half, **on_queue})
    config = pool.config(node_heartbeat_expiry_s=None, min_runtime={"reclaim_s": 0 if on_queue else 4})
    setting = f"queue {p}-b's reclaimMinRuntime" if on_queue else "the scheduler's min_runtime.reclaim_s"
    async with running(client, config) as service:
        for i in range(2):
            await client.create(victim_pod(pool, f"b-{i}", queue=f"{p}-b"))
        await wait_bound(client, ns, 2, timeout=20)
        started = datetime.now(UTC).replace(microsecond=0)
        for i in range(2):
            await start(client, ns, f"b-{i}", started)

        async def seen_started() -> bool:
            pods = [service.cache.booking(x.metadata.uid) async for x in client.list(Pod, namespace=ns)]
            return all(b is not None and b.pod.status.startTime for b in pods)

        await wait_for(seen_started, timeout=10, what="the scheduler saw the start times")
        await client.create(victim_pod(pool, "a-0", queue=f"{p}-a"))

        async def told() -> bool:
            return "minimum" in (condition(await client.get(Pod, "a-0", namespace=ns))[2] or "")

        await wait_for(told, timeout=20, what="a-0 told the victims are too young")
        message = condition(await client.get(Pod, "a-0", namespace=ns))[2]
        assert (
            f"No pod is evicted for it: no victim has run its queue's minimum of 4s ({setting}) yet; "
            "tried again at "
        ) in message, message
        assert await events(client, ns, "Reclaimed") == []

        # The timer wakes it when the first victim comes of age: it reclaims then, not before.
        async def reclaimed() -> bool:
            return len(await events(client, ns, "Reclaimed")) == 1

        await wait_for(reclaimed, timeout=20, what="the reclaim after the minimum")
        (event,) = await events(client, ns, "Reclaimed")
        when = event.eventTime or event.firstTimestamp or event.metadata.creationTimestamp
        assert (when - started).total_seconds() >= 4 - 1  # event times are whole seconds
        victim = await client.get(Pod, event.involvedObject.name, namespace=ns)
        assert victim.metadata.deletionTimestamp is not None
        reason, said = disruption(victim)
        assert reason == "ReclaimByScheduler", (reason, said)
        assert said.startswith(f"{pool.scheduler_name}: Reclaimed by {ns}/a-0 (queue {p}-a is ")
        assert f"reclaiming from queue {p}-b" in said and said.endswith("evicted through the Eviction API")
        await let_go(client, ns)


async def test_a_preemption_delay_makes_the_pod_wait_then_preempt_and_the_victim_says_preemption(
    client: AsyncClient, pool: Pool, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1))
    ns = pool.namespace
    async with running(client, pool.config(preemption_delay_s=3)):
        await client.create(victim_pod(pool, "low", priority=priorities["low"]))
        await wait_bound(client, ns, 1, timeout=20)
        high = await client.create(victim_pod(pool, "high", priority=priorities["high"]))
        until = datetime.fromtimestamp(high.metadata.creationTimestamp.timestamp() + 3, UTC)

        async def told() -> bool:
            return "Waiting until" in (condition(await client.get(Pod, "high", namespace=ns))[2] or "")

        await wait_for(told, timeout=10, what="high told it waits")
        assert condition(await client.get(Pod, "high", namespace=ns))[2].endswith(
            f" Waiting until {until:%Y-%m-%dT%H:%M:%SZ} before evicting anybody for it "
            "(preemption_delay_s=3 after its creation), so a node autoscaler can add room first."
        )
        assert await events(client, ns, "Preempted") == []

        async def preempted() -> bool:
            return len(await events(client, ns, "Preempted")) == 1

        await wait_for(preempted, timeout=20, what="the preemption after the delay")
        assert datetime.now(UTC) >= until
        low = await client.get(Pod, "low", namespace=ns)
        reason, said = disruption(low)
        assert reason == "PreemptionByScheduler", (reason, said)
        assert said.startswith(f"{pool.scheduler_name}: Preempted by {ns}/high (queue default) on node ")
        await let_go(client, ns)

        async def high_bound() -> bool:
            return bool((await client.get(Pod, "high", namespace=ns)).spec.nodeName)

        await wait_for(high_bound, timeout=20, what="high bound")
