"""Preemption and reclaim through the real API server: Eviction API, budgets, Events, no thrash.

The control plane runs no kubelet, so a victim with a zero termination grace period is deleted by its
eviction at once, as a kubelet would finish it, and a test writes the Running phase a kubelet would.
A PodDisruptionBudget that must hold one pod of one never allows a disruption, whether or not a
disruption controller has processed it: an eviction of that pod is refused (429).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType
from sched_harness import (
    Pool,
    add_nodes,
    audit_pool,
    condition,
    gpu_pod,
    preemptions_without_io,
    running,
    wait_bound,
    wait_for,
)

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.local.simnodes import NodeShape
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import GpuDevice, NodeSpec, PendingPod
from gpufrac.placement.state import TIME_SLICING
from gpufrac.scheduler.preemption import HOLD_PREFIX, Preemptions


def whole_gpu_pod(pool: Pool, name: str, *, priority: str | None = None, queue: str | None = None) -> Pod:
    pod = gpu_pod(pool, name, labels={keys.QUEUE_LABEL: queue} if queue else None, whole_gpus=1)
    pod.spec.priorityClassName = priority
    pod.spec.terminationGracePeriodSeconds = 0
    return pod


async def mark_running(client: AsyncClient, namespace: str, name: str) -> None:
    """What a kubelet would write once the pod started (the eviction API ignores budgets for pods that
    are still Pending)."""
    await client.patch(Pod.Status, name, {"status": {"phase": "Running"}}, namespace=namespace)


async def events(client: AsyncClient, namespace: str, reason: str) -> list[Event]:
    return [e async for e in client.list(Event, namespace=namespace) if e.reason == reason]


async def exists(client: AsyncClient, namespace: str, name: str) -> bool:
    return name in [p.metadata.name async for p in client.list(Pod, namespace=namespace)]


async def test_a_higher_priority_pod_evicts_a_lower_one_and_takes_its_gpu(
    client: AsyncClient, pool: Pool, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1))
    ns = pool.namespace
    async with running(client, pool.config()) as service:
        await client.create(whole_gpu_pod(pool, "low", priority=priorities["low"]))
        await wait_bound(client, ns, 1, timeout=20)
        # Kubernetes 1.37 clears status.nominatedNodeName when the pod is bound (KEP-5278), so the
        # nomination is read from the pod's changes while its victim leaves.
        nominated: set[str] = set()

        async def watch_nominations() -> None:
            async for _, seen in client.watch(Pod, namespace=ns, fields={"metadata.name": "high"}):
                if seen.status is not None and seen.status.nominatedNodeName:
                    nominated.add(seen.status.nominatedNodeName)

        watcher = asyncio.create_task(watch_nominations())
        await client.create(whole_gpu_pod(pool, "high", priority=priorities["high"]))

        async def high_bound() -> bool:
            pod = await client.get(Pod, "high", namespace=ns)
            return bool(pod.spec.nodeName)

        await wait_for(high_bound, timeout=30, what="the high-priority pod bound")
        watcher.cancel()
        assert not await exists(client, ns, "low")
        high = await client.get(Pod, "high", namespace=ns)
        assert nominated == {high.spec.nodeName}
        preempted = await events(client, ns, "Preempted")
        assert [(e.involvedObject.name, e.type) for e in preempted] == [("low", "Normal")]
        assert f"by {ns}/high (queue default) on node {high.spec.nodeName}" in preempted[0].message
        preempting = await events(client, ns, "Preempting")
        assert [e.involvedObject.name for e in preempting] == ["high"]
        assert service.preemptions is not None and service.preemptions.evictions == 1
        assert (await audit_pool(client, pool)).ok


async def test_a_disruption_budget_refusal_makes_the_scheduler_take_another_victim(
    client: AsyncClient, pool: Pool, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2))
    ns = pool.namespace
    budget = PodDisruptionBudget.from_dict(
        {
            "metadata": {"name": "keep", "namespace": ns},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "protected"}}},
        }
    )
    await client.create(budget)
    async with running(client, pool.config()):
        # The cheaper victim (lowest priority) is the protected one; the budget refuses it.
        protected = whole_gpu_pod(pool, "protected", priority=priorities["low"])
        protected.metadata.labels = {"app": "protected"}
        await client.create(protected)
        await client.create(whole_gpu_pod(pool, "plain", priority=priorities["mid"]))
        await wait_bound(client, ns, 2, timeout=20)
        for name in ("protected", "plain"):
            await mark_running(client, ns, name)
        await client.create(whole_gpu_pod(pool, "high", priority=priorities["high"]))

        async def high_bound() -> bool:
            return bool((await client.get(Pod, "high", namespace=ns)).spec.nodeName)

        await wait_for(high_bound, timeout=30, what="the high-priority pod bound")
        assert await exists(client, ns, "protected")
        assert not await exists(client, ns, "plain")
        blocked = await events(client, ns, "PreemptionBlocked")
        assert [e.involvedObject.name for e in blocked] == ["high"]
        assert f"evicting {ns}/protected was refused" in blocked[0].message
        assert [e.involvedObject.name for e in await events(client, ns, "Preempted")] == ["plain"]
        assert (await audit_pool(client, pool)).ok


async def test_a_queue_below_its_share_reclaims_and_the_victims_replacement_is_not_placed_back(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2))
    ns = pool.namespace
    queues = [{"name": "a", "deserved_share": 0.5}, {"name": "b", "deserved_share": 0.5}, {"name": "default"}]
    async with running(client, pool.config(queues=queues)) as service:
        for i in range(2):
            await client.create(whole_gpu_pod(pool, f"b-{i}", queue="b"))
        await wait_bound(client, ns, 2, timeout=20)
        await client.create(whole_gpu_pod(pool, "a-0", queue="a"))

        async def a_bound() -> bool:
            return bool((await client.get(Pod, "a-0", namespace=ns)).spec.nodeName)

        await wait_for(a_bound, timeout=30, what="queue a's pod bound")
        reclaimed = await events(client, ns, "Reclaimed")
        assert len(reclaimed) == 1
        victim = reclaimed[0].involvedObject.name
        # The tenant evicted learns whose quota took its GPU and the numbers (one GPU of 81559 MiB each
        # is a's fair share, and b's, of the two); the pod that took it, from which queue and why.
        story = (
            "queue a is 81559 MiB below its fair share 81559; "
            "reclaiming from queue b, 81559 MiB over its fair share 81559"
        )
        assert f"by {ns}/a-0 ({story}) on node" in reclaimed[0].message
        (taking,) = await events(client, ns, "Preempting")
        assert taking.message.endswith(
            f"to make room: {ns}/{victim} (queue b). {story[0].upper()}{story[1:]}"
        )
        assert not await exists(client, ns, victim)

        # Its controller recreates it: queue b is at its share now, so nothing is evicted for it.
        await client.create(whole_gpu_pod(pool, victim, queue="b"))

        async def reported() -> bool:
            return condition(await client.get(Pod, victim, namespace=ns))[0] == "False"

        await wait_for(reported, timeout=20, what="the replacement reported unschedulable")
        assert (await client.get(Pod, "a-0", namespace=ns)).spec.nodeName
        assert len(await events(client, ns, "Reclaimed")) == 1
        assert service.preemptions is not None and service.preemptions.evictions == 1
        assert (await audit_pool(client, pool)).ok


async def test_a_burst_of_high_priority_pods_on_a_full_cluster_evicts_each_victim_once_and_never_overcommits(
    client: AsyncClient, pool: Pool, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=2, shape=NodeShape(gpus=2))
    ns = pool.namespace
    async with running(client, pool.config()) as service:
        # Full: four half-GPU pods of low priority on each node's two GPUs (8 pods on 4 GPUs).
        for i in range(8):
            low = gpu_pod(pool, f"low-{i}", {"gpu-fraction": "0.5"})
            low.spec.priorityClassName = priorities["low"]
            low.spec.terminationGracePeriodSeconds = 0
            await client.create(low)
        await wait_bound(client, ns, 8, timeout=30)
        for i in range(4):
            await client.create(whole_gpu_pod(pool, f"high-{i}", priority=priorities["high"]))

        audits = 0

        async def all_high_bound() -> bool:
            nonlocal audits
            report = await audit_pool(client, pool)  # during the run, not only at the end
            assert report.ok, report
            audits += 1
            pods = [p async for p in client.list(Pod, namespace=ns)]
            return sum(1 for p in pods if p.metadata.name.startswith("high-") and p.spec.nodeName) == 4

        await wait_for(all_high_bound, timeout=60, interval=0.2, what="the burst bound")
        preempted = [e.involvedObject.name for e in await events(client, ns, "Preempted")]
        assert sorted(preempted) == sorted(set(preempted)), "a victim was evicted twice"
        assert len(preempted) == 8 and service.preemptions is not None and service.preemptions.evictions == 8
        assert audits > 1
        left = [p.metadata.name async for p in client.list(Pod, namespace=ns)]
        assert sorted(left) == [f"high-{i}" for i in range(4)]


async def test_a_restarted_scheduler_waits_for_the_victims_of_the_plan_made_before_it(
    client: AsyncClient, pool: Pool, priorities: dict[str, str]
) -> None:
    """The first scheduler evicts low-a for high and nominates low-a's node; a finalizer keeps low-a
    terminating while the scheduler is replaced. The second must evict nobody else (low-b would do, on
    the other node) and place high on the nominated node once low-a is gone."""
    await add_nodes(client, pool, count=2, shape=NodeShape(gpus=1))
    ns = pool.namespace
    low_a = whole_gpu_pod(pool, "low-a", priority=priorities["low"])
    low_a.metadata.finalizers = ["gpufrac.test/keep"]
    async with running(client, pool.config(), identity="first") as first:
        await client.create(low_a)
        await client.create(whole_gpu_pod(pool, "low-b", priority=priorities["mid"]))
        await wait_bound(client, ns, 2, timeout=20)
        await client.create(whole_gpu_pod(pool, "high", priority=priorities["high"]))

        async def evicted_and_nominated() -> bool:
            victim = await client.get(Pod, "low-a", namespace=ns)
            high = await client.get(Pod, "high", namespace=ns)
            return victim.metadata.deletionTimestamp is not None and bool(
                high.status and high.status.nominatedNodeName
            )

        await wait_for(evicted_and_nominated, timeout=30, what="low-a evicted and high nominated")
        assert first.preemptions is not None and first.preemptions.evictions == 1
    node_a = (await client.get(Pod, "low-a", namespace=ns)).spec.nodeName
    high_uid = (await client.get(Pod, "high", namespace=ns)).metadata.uid
    async with running(client, pool.config(), identity="second") as second:
        preemptions = second.preemptions
        assert preemptions is not None

        async def plan_taken_up() -> bool:
            return preemptions.open_plan(high_uid) is not None

        await wait_for(plan_taken_up, timeout=30, what="the second scheduler waiting on the first's plan")
        plan = preemptions.open_plan(high_uid)
        assert plan is not None and plan.victims == (
            (await client.get(Pod, "low-a", namespace=ns)).metadata.uid,
        )
        await client.patch(
            Pod, "low-a", {"metadata": {"finalizers": None}}, namespace=ns, patch_type=PatchType.MERGE
        )

        async def high_bound() -> bool:
            return bool((await client.get(Pod, "high", namespace=ns)).spec.nodeName)

        await wait_for(high_bound, timeout=30, what="the high-priority pod bound")
        assert (await client.get(Pod, "high", namespace=ns)).spec.nodeName == node_a
        assert await exists(client, ns, "low-b")
        assert preemptions.evictions == 0
        assert [e.involvedObject.name for e in await events(client, ns, "Preempted")] == ["low-a"]
        assert (await audit_pool(client, pool)).ok


def test_a_cycle_searches_for_victims_until_its_budget_is_spent_then_defers_the_rest() -> None:
    """A burst of preemptors on a big cluster must not hold the event loop (lease renewals, binds) for
    seconds: once a cycle's search budget is spent, its other pods wait for the next cycle, unreported;
    the first search of a cycle always runs, so every pod gets its turn."""
    engine = Engine(policy="binpack")
    gpus = tuple(GpuDevice(f"g{i}", i, 16000) for i in range(2))
    engine.add_node(NodeSpec(name="n", cpu_milli=64_000, memory_bytes=1 << 38, gpus=gpus))
    whole = PodGpuRequest((ContainerGpuRequest("app", None, None, exclusive=True),))
    for i in range(2):
        low = PendingPod(namespace="ns", name=f"low-{i}", uid=f"low-{i}", gpu=whole, priority=0)
        assert isinstance(engine.place(low), Placement)
    spawned: list[str] = []
    preemptions = _preemptions(engine, spawned, [], search_budget_s=0.0)
    high = [
        PendingPod(namespace="ns", name=f"high-{i}", uid=f"high-{i}", gpu=whole, priority=10)
        for i in range(2)
    ]
    nowhere = Unschedulable("x", 1, (("not enough whole free GPUs", 1),))
    preemptions.new_cycle()
    first = preemptions.consider(high[0], Pod.from_dict({"metadata": {"name": "high-0"}}), nowhere)
    assert first is not None and "Preempting 1 pod(s) on node n" in first
    assert preemptions.consider(high[1], Pod.from_dict({"metadata": {"name": "high-1"}}), nowhere) is None
    assert preemptions.deferred == 1
    # Deferred pods come back spread out by what a search cost, the first soonest.
    assert 0 < preemptions.deferral_s() < preemptions.deferral_s()
    # A pod with a plan of its own is always answered: its message says what it waits for.
    again = preemptions.consider(high[0], Pod.from_dict({"metadata": {"name": "high-0"}}), nowhere)
    assert again is not None and "Preempting" in again
    preemptions.new_cycle()
    second = preemptions.consider(high[1], Pod.from_dict({"metadata": {"name": "high-1"}}), nowhere)
    assert second is not None and "Preempting 1 pod(s) on node n" in second
    assert spawned == ["_execute", "_execute"]


def _whole() -> PodGpuRequest:
    return PodGpuRequest((ContainerGpuRequest("app", None, None, exclusive=True),))


def _mib(mib: int) -> PodGpuRequest:
    return PodGpuRequest((ContainerGpuRequest("app", GpuMemory(mib=mib), None),))


def _one_gpu_nodes(pods: dict[str, list[tuple[str, PodGpuRequest, int]]]) -> Engine:
    """One node of one 16,000 MiB GPU per key, holding its (uid, request, priority) pods."""
    engine = Engine(policy="binpack")
    for name, held in pods.items():
        gpu = GpuDevice(f"{name}-gpu", 0, 16000)
        engine.add_node(NodeSpec(name=name, cpu_milli=64_000, memory_bytes=1 << 38, gpus=(gpu,)))
        for uid, gpu_request, priority in held:
            pod = PendingPod(namespace="ns", name=uid, uid=uid, gpu=gpu_request, priority=priority)
            placed = engine.place(replace(pod, nominated_node=name))
            assert isinstance(placed, Placement) and placed.node == name
    return engine


def _preemptions(engine: Engine, spawned: list[str], placed_now: list[Pod], **options: Any) -> Preemptions:
    return preemptions_without_io(
        engine,
        victim_pod=lambda uid: Pod.from_dict({"metadata": {"name": uid, "namespace": "ns", "uid": uid}}),
        started=spawned,
        release=engine.forget,
        place_now=placed_now.append,
        **options,
    )


def _nominated(name: str, node: str | None) -> Pod:
    return Pod.from_dict(
        {"metadata": {"name": name, "namespace": "ns", "uid": name}, "status": {"nominatedNodeName": node}}
    )


NOWHERE = Unschedulable("high", 2, (("not enough whole free GPUs", 2),))


def test_the_free_part_of_a_preemptors_room_is_held_while_its_victim_leaves() -> None:
    """A whole-GPU pod evicts a half-GPU pod: the other half, free already, is held for it, so a small
    pod arriving while the victim terminates goes elsewhere instead of taking it and being preempted in
    its turn (no thrash)."""
    engine = _one_gpu_nodes({"n": [("low", _mib(8000), 0)], "m": [("keep", _whole(), 100)]})
    engine.add_node(
        NodeSpec(
            name="spare", cpu_milli=64_000, memory_bytes=1 << 38, gpus=(GpuDevice("spare-gpu", 0, 8000),)
        )
    )
    spawned: list[str] = []
    placed_now: list[Pod] = []
    preemptions = _preemptions(engine, spawned, placed_now)
    high = PendingPod(namespace="ns", name="high", uid="high", gpu=_whole(), priority=10)
    message = preemptions.consider(high, _nominated("high", None), NOWHERE)
    assert message is not None and "Preempting 1 pod(s) on node n: ns/low." in message
    assert spawned == ["_execute"]
    hold = engine.held(f"{HOLD_PREFIX}high")
    assert hold is not None and hold.node == "n"
    assert [d.request_mib for c in hold.containers for d in c.devices] == [8000]
    # The room is no pod: not booked as one, so no preemption search can take it for a victim.
    assert engine.bound_pod(f"{HOLD_PREFIX}high") is None
    assert sorted(engine.bound_uids) == ["keep", "low"]
    # binpack would put a 4,000 MiB pod on the fuller GPU, n's; the hold sends it to the spare node.
    small = engine.place(PendingPod(namespace="ns", name="small", uid="small", gpu=_mib(4000)))
    assert isinstance(small, Placement) and small.node == "spare"
    assert preemptions.deleted("low")
    assert placed_now == [placed_now[0]] and placed_now[0].metadata.name == "high"
    assert engine.held(f"{HOLD_PREFIX}high") is None
    placed = engine.place(high)
    assert isinstance(placed, Placement) and placed.node == "n"


def test_after_a_restart_a_nominated_pod_waits_for_the_leaving_pods_instead_of_a_new_victim() -> None:
    """The scheduler before this one evicted two pods on node n for ``high`` and set its
    nominatedNodeName; they are still terminating. A fresh scheduler must not pick a new victim (one
    pod on m would be the cheaper plan): it files the old plan again and places ``high`` on n first
    when they are gone."""
    engine = _one_gpu_nodes(
        {"n": [("low-1", _mib(8000), 0), ("low-2", _mib(8000), 0)], "m": [("other", _whole(), 0)]}
    )
    spawned: list[str] = []
    placed_now: list[Pod] = []
    preemptions = _preemptions(engine, spawned, placed_now)
    for uid in ("low-1", "low-2"):
        preemptions.leaving(uid)
    high = PendingPod(namespace="ns", name="high", uid="high", gpu=_whole(), priority=10)
    message = preemptions.consider(high, _nominated("high", "n"), NOWHERE)
    assert message is not None and "Preempting 2 pod(s) on node n" in message
    assert spawned == [], "nothing is evicted again"
    plan = preemptions.open_plan("high")
    assert plan is not None and sorted(plan.victims) == ["low-1", "low-2"]
    assert preemptions.deleted("low-1") and placed_now == []
    assert preemptions.deleted("low-2")
    assert [p.metadata.name for p in placed_now] == ["high"]
    assert preemptions.open_plan("high") is None
    assert engine.placement_of("other") is not None


def test_a_nominated_pod_whose_leaving_neighbours_are_not_enough_searches_as_usual() -> None:
    """Only half of n's GPU is leaving and the other half belongs to a pod it may not evict: waiting
    would never be enough, so the usual search runs (and takes the pod on m)."""
    engine = _one_gpu_nodes(
        {"n": [("low", _mib(8000), 0), ("keep", _mib(8000), 100)], "m": [("other", _whole(), 0)]}
    )
    spawned: list[str] = []
    preemptions = _preemptions(engine, spawned, [])
    preemptions.leaving("low")
    high = PendingPod(namespace="ns", name="high", uid="high", gpu=_whole(), priority=10)
    message = preemptions.consider(high, _nominated("high", "n"), NOWHERE)
    assert message is not None and "Preempting 1 pod(s) on node m: ns/other." in message
    assert spawned == ["_execute"]


def test_a_preemptor_of_another_mode_gets_the_gpu_in_its_mode_once_the_victim_and_the_hold_are_gone() -> None:
    """An sm-sharing pod evicts a time-slicing pod from half a GPU: the free half is held while the
    GPU keeps its time-slicing mode; once the victim is gone the pod gets the GPU in its own mode."""
    engine = _one_gpu_nodes({"n": [("low", _mib(8000), 0)]})
    placed_now: list[Pod] = []
    preemptions = _preemptions(engine, [], placed_now)
    sm = PodGpuRequest((ContainerGpuRequest("app", GpuMemory(mib=12000), None, mode=ComputeMode.SM_SHARING),))
    high = PendingPod(namespace="ns", name="high", uid="high", gpu=sm, priority=10)
    message = preemptions.consider(high, _nominated("high", None), NOWHERE)
    assert message is not None and "Preempting 1 pod(s) on node n: ns/low." in message
    [gpu] = engine.ledger("n")
    assert (gpu.free_mib, gpu.mode) == (0, TIME_SLICING)
    assert preemptions.deleted("low") and [p.metadata.name for p in placed_now] == ["high"]
    placed = engine.place(high)
    assert isinstance(placed, Placement) and placed.containers[0].mode is ComputeMode.SM_SHARING


def test_after_a_restart_a_nominated_gang_waits_for_the_pods_leaving_its_members_nodes() -> None:
    """The same for a gang of two whole-GPU pods nominated to nodes a and b, whose four victims are
    still terminating: no new victim (the pod on c would be a cheaper second GPU), no eviction again,
    and the gang is placed when the last of the four is gone."""
    leaving = {"a": ["a-1", "a-2"], "b": ["b-1", "b-2"]}
    engine = _one_gpu_nodes(
        {node: [(uid, _mib(8000), 0) for uid in uids] for node, uids in leaving.items()}
        | {"c": [("other", _whole(), 0)]}
    )
    spawned: list[str] = []
    placed_now: list[Pod] = []
    preemptions = _preemptions(engine, spawned, placed_now)
    for uids in leaving.values():
        for uid in uids:
            preemptions.leaving(uid)
    members = [
        (
            PendingPod(namespace="ns", name=f"g-{i}", uid=f"g-{i}", gpu=_whole(), priority=10),
            _nominated(f"g-{i}", n),
        )
        for i, n in enumerate(("a", "b"))
    ]
    note = preemptions.consider_gang("ns/g", members, 2)
    assert note is not None and "Preempting 4 pod(s) on nodes a, b" in note
    assert spawned == [], "nothing is evicted again"
    for uid in ("a-1", "a-2", "b-1"):
        assert preemptions.deleted(uid) and placed_now == []
    assert preemptions.deleted("b-2")
    assert [p.metadata.name for p in placed_now] == ["g-0"]
    assert preemptions.open_plan("ns/g") is None and engine.placement_of("other") is not None


def test_what_open_plans_will_book_follows_each_plan_filed_and_closed() -> None:
    """Every decision's queue books count what the open plans will book as held (``planned``), kept
    between decisions: a plan filed is counted at once, and one closed (its victims gone, or its pod
    gone) no longer is, so a queue is not charged for a pod twice or for one that left."""
    engine = _one_gpu_nodes({"n": [("low", _whole(), 0)], "m": [("low2", _whole(), 0)]})
    placed_now: list[Pod] = []
    preemptions = _preemptions(engine, [], placed_now)
    assert preemptions.planned() == {}
    for uid in ("high", "high2"):
        preemptor = PendingPod(namespace="ns", name=uid, uid=uid, gpu=_whole(), priority=10)
        assert preemptions.consider(preemptor, _nominated(uid, None), NOWHERE) is not None
        assert uid in preemptions.planned()
    whole_gpu = preemptions.planned()["high"].amount
    assert (whole_gpu.mib, whole_gpu.gpus) == (16000, 1)
    assert sorted(preemptions.planned()) == ["high", "high2"]
    victim = "low" if preemptions.open_plan("high").victims == ("low",) else "low2"
    assert preemptions.deleted(victim)  # the last victim of high's plan left: placed now, plan closed
    assert [p.metadata.name for p in placed_now] == ["high"]
    assert sorted(preemptions.planned()) == ["high2"]
    assert not preemptions.deleted("high2")  # the preemptor itself went away: its plan is given up
    assert preemptions.planned() == {}
