"""Gangs through the real API server: PodGroups of scheduler-plugins and KAI, all-or-nothing, reasons."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import ReplicaSet
from lightkube.resources.core_v1 import Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget
from sched_harness import Pool, add_nodes, audit_pool, condition, gpu_pod, running, wait_bound, wait_for
from test_consolidation import fraction_pod, node_of
from test_preemption import events, exists, mark_running, whole_gpu_pod

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, api_errors
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.gangs import (
    FORGET_AFTER_S,
    POD_GROUPS,
    REFRESH_S,
    SCHEDULER_PLUGINS,
    GangKey,
    Gangs,
    GangSpec,
    _Read,
    spec_of,
)

FRACTION = {"gpu-fraction": "0.6"}


@pytest.fixture
async def podgroup_crd(client: AsyncClient) -> None:
    """scheduler-plugins' PodGroup CRD (schema-less: the scheduler reads spec.minMember only)."""
    crd = CustomResourceDefinition.from_dict(
        {
            "metadata": {"name": "podgroups.scheduling.x-k8s.io"},
            "spec": {
                "group": "scheduling.x-k8s.io",
                "scope": "Namespaced",
                "names": {"plural": "podgroups", "singular": "podgroup", "kind": "PodGroup"},
                "versions": [
                    {
                        "name": "v1alpha1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
    )
    try:
        with api_errors():
            await client.create(crd)
    except Conflict:
        pass
    for _ in range(100):
        got = await client.get(CustomResourceDefinition, "podgroups.scheduling.x-k8s.io")
        if any(c.type == "Established" and c.status == "True" for c in (got.status.conditions or [])):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("PodGroup CRD not established")


async def pod_group(client: AsyncClient, pool: Pool, name: str, min_member: int) -> None:
    group = POD_GROUPS[SCHEDULER_PLUGINS](metadata=ObjectMeta(name=name, namespace=pool.namespace))
    group["spec"] = {"minMember": min_member}
    await client.create(group)


def member(pool: Pool, name: str, group: str) -> Pod:
    return gpu_pod(pool, name, FRACTION, labels={keys.POD_GROUP_LABEL: group})


async def reported(client: AsyncClient, pool: Pool, name: str, text: str) -> None:
    last: list[str | None] = [None]

    async def says() -> bool:
        status, _, last[0] = condition(await client.get(Pod, name, namespace=pool.namespace))
        return status == "False" and text in (last[0] or "")

    try:
        await wait_for(says, timeout=20, what=f"{name} reporting {text!r}")
    except AssertionError as error:  # what it said instead, if anything
        raise AssertionError(f"{error}; it said {last[0]!r}") from None


async def test_a_gang_of_fractions_waits_for_its_min_member_then_starts_together_across_nodes(
    client: AsyncClient, pool: Pool, podgroup_crd: None
) -> None:
    # Three nodes of one GPU: 0.6 of a GPU each, so the gang spreads over all three.
    await add_nodes(client, pool, count=3, shape=NodeShape(gpus=1))
    await pod_group(client, pool, "train", 3)
    ns = pool.namespace
    async with running(client, pool.config()):
        for i in range(2):
            await client.create(member(pool, f"w-{i}", "train"))
        for i in range(2):
            await reported(client, pool, f"w-{i}", f"waiting for gang {ns}/train: 2 of its minMember 3 pods")
        assert not any(
            p.spec.nodeName for p in [await client.get(Pod, f"w-{i}", namespace=ns) for i in range(2)]
        )
        await client.create(member(pool, "w-2", "train"))
        pods = await wait_bound(client, ns, 3, timeout=30)
        assert len({p.spec.nodeName for p in pods}) == 3
        assert (await audit_pool(client, pool)).ok


async def test_a_gang_that_cannot_fit_whole_places_none_of_its_pods_and_says_why(
    client: AsyncClient, pool: Pool, podgroup_crd: None
) -> None:
    await add_nodes(client, pool, count=2, shape=NodeShape(gpus=1))
    await pod_group(client, pool, "big", 3)
    ns = pool.namespace
    async with running(client, pool.config()):
        for i in range(3):
            await client.create(member(pool, f"b-{i}", "big"))
        for i in range(3):
            await reported(
                client, pool, f"b-{i}", f"gang {ns}/big: 0/2 nodes are available: gang of 3 needs 3"
            )
        assert not any(
            p.spec.nodeName for p in [await client.get(Pod, f"b-{i}", namespace=ns) for i in range(3)]
        )


async def test_a_kai_pod_group_that_does_not_exist_keeps_its_pods_pending_with_that_reason(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1)
    ns = pool.namespace
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "k", {**FRACTION, keys.KAI_POD_GROUP_ANNOTATION: "kai-group"}))
        await reported(
            client,
            pool,
            "k",
            f"PodGroup {ns}/kai-group (scheduling.run.ai/v2alpha2) not found: the API serves no "
            "scheduling.run.ai/v2alpha2 PodGroups",
        )


def test_a_pod_group_with_an_unusable_min_member_is_named_in_the_error() -> None:
    key = GangKey(SCHEDULER_PLUGINS, "ns", "g")
    group = POD_GROUPS[SCHEDULER_PLUGINS](metadata=ObjectMeta(name="g", namespace="ns"))
    group["spec"] = {"minMember": 0}
    with pytest.raises(
        ValueError, match=r"PodGroup ns/g spec.minMember=0 must be a whole number of at least 1"
    ):
        spec_of(group, key)
    group["spec"] = {"minMember": 2, "scheduleTimeoutSeconds": "soon"}
    with pytest.raises(ValueError, match=r"spec.scheduleTimeoutSeconds='soon' must be a positive number"):
        spec_of(group, key)
    group["spec"] = {"minMember": 2, "scheduleTimeoutSeconds": 30}
    assert spec_of(group, key) == GangSpec(2, 30.0)


def test_a_gang_times_out_once_after_its_pod_groups_timeout() -> None:
    now = [100.0]
    gangs = Gangs(client=None, spawn=lambda coro: coro.close(), retry=lambda: None, clock=lambda: now[0])  # type: ignore[arg-type]
    key = GangKey(SCHEDULER_PLUGINS, "ns", "g")
    gangs._reads[key] = _Read(GangSpec(3, 30.0), at=now[0])
    assert gangs.waited(key) == (0.0, False)
    now[0] += 31
    assert gangs.waited(key) == (31.0, True) and gangs.timed_out(key)
    now[0] += 1
    assert gangs.waited(key) == (32.0, False), "the timeout is announced once"
    gangs.placed(key)
    assert not gangs.timed_out(key)


async def wait_all_bound(client: AsyncClient, namespace: str, names: list[str]) -> None:
    async def bound() -> bool:
        return all([(await client.get(Pod, n, namespace=namespace)).spec.nodeName for n in names])

    await wait_for(bound, timeout=30, what=f"{', '.join(names)} bound")


def high_member(pool: Pool, name: str, group: str, priority: str) -> Pod:
    pod = whole_gpu_pod(pool, name, priority=priority)
    pod.metadata.labels = {**(pod.metadata.labels or {}), keys.POD_GROUP_LABEL: group}
    return pod


async def test_a_high_priority_gang_evicts_a_victim_on_each_node_once_and_starts_whole(
    client: AsyncClient, pool: Pool, podgroup_crd: None, priorities: dict[str, str]
) -> None:
    names = await add_nodes(client, pool, count=2, shape=NodeShape(gpus=1))
    await pod_group(client, pool, "urgent", 2)
    ns = pool.namespace
    async with running(client, pool.config()) as service:
        for i in range(2):
            await client.create(whole_gpu_pod(pool, f"low-{i}", priority=priorities["low"]))
        await wait_bound(client, ns, 2, timeout=20)
        for i in range(2):
            await mark_running(client, ns, f"low-{i}")
        # One member alone could preempt on either node; the gang needs both nodes or nothing.
        for i in range(2):
            await client.create(high_member(pool, f"g-{i}", "urgent", priorities["high"]))

        await wait_all_bound(client, ns, ["g-0", "g-1"])
        members = [await client.get(Pod, f"g-{i}", namespace=ns) for i in range(2)]
        assert {p.spec.nodeName for p in members} == set(names)
        assert not any([await exists(client, ns, f"low-{i}") for i in range(2)])
        preempted = await events(client, ns, "Preempted")
        assert sorted(e.involvedObject.name for e in preempted) == ["low-0", "low-1"]
        assert all(f"by gang {ns}/urgent" in e.message for e in preempted)
        preempting = await events(client, ns, "Preempting")
        assert sorted(e.involvedObject.name for e in preempting) == ["g-0", "g-1"]
        assert service.preemptions is not None and service.preemptions.evictions == 2
        assert (await audit_pool(client, pool)).ok


async def test_no_pod_is_evicted_for_a_gang_that_would_still_not_fit(
    client: AsyncClient, pool: Pool, podgroup_crd: None, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=2, shape=NodeShape(gpus=1))
    await pod_group(client, pool, "urgent", 2)
    ns = pool.namespace
    async with running(client, pool.config()) as service:
        # One node's GPU is held by a pod as important as the gang: a victim exists for one member only.
        await client.create(whole_gpu_pod(pool, "low", priority=priorities["low"]))
        await client.create(whole_gpu_pod(pool, "peer", priority=priorities["high"]))
        await wait_bound(client, ns, 2, timeout=20)
        for i in range(2):
            await client.create(high_member(pool, f"g-{i}", "urgent", priorities["high"]))
        for i in range(2):
            await reported(client, pool, f"g-{i}", f"gang {ns}/urgent: 0/2 nodes are available: gang of 2")
        await asyncio.sleep(1.0)
        assert await exists(client, ns, "low")
        assert service.preemptions is not None and service.preemptions.evictions == 0
        assert not await events(client, ns, "Preempting")


async def test_a_budget_refusal_for_a_gang_moves_its_plan_to_other_victims(
    client: AsyncClient, pool: Pool, podgroup_crd: None, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=3, shape=NodeShape(gpus=1))
    await pod_group(client, pool, "urgent", 2)
    ns = pool.namespace
    budget = PodDisruptionBudget.from_dict(
        {
            "metadata": {"name": "keep", "namespace": ns},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "protected"}}},
        }
    )
    await client.create(budget)
    async with running(client, pool.config()) as service:
        # The cheapest victim (lowest priority) is protected by the budget.
        protected = whole_gpu_pod(pool, "protected", priority=priorities["low"])
        protected.metadata.labels = {"app": "protected"}
        await client.create(protected)
        for i in range(2):
            await client.create(whole_gpu_pod(pool, f"mid-{i}", priority=priorities["mid"]))
        await wait_bound(client, ns, 3, timeout=20)
        for name in ("protected", "mid-0", "mid-1"):
            await mark_running(client, ns, name)
        for i in range(2):
            await client.create(high_member(pool, f"g-{i}", "urgent", priorities["high"]))

        await wait_all_bound(client, ns, ["g-0", "g-1"])
        assert await exists(client, ns, "protected")
        assert sorted(e.involvedObject.name for e in await events(client, ns, "Preempted")) == [
            "mid-0",
            "mid-1",
        ]
        blocked = await events(client, ns, "PreemptionBlocked")
        assert sorted(e.involvedObject.name for e in blocked) == ["g-0", "g-1"]
        assert service.preemptions is not None and service.preemptions.evictions == 2
        assert (await audit_pool(client, pool)).ok


async def test_a_gang_of_fractions_gets_room_by_one_move_and_starts_whole(
    client: AsyncClient, pool: Pool, podgroup_crd: None, replicaset: ReplicaSet
) -> None:
    """Three one-GPU nodes: a and b each hold a movable half, c is free. A gang of two 0.6 pods fits only
    once one half joins the other; the gang's room on c is held while the moved half leaves."""
    names = sorted(await add_nodes(client, pool, count=3, shape=NodeShape(gpus=1)))
    ns = pool.namespace
    config = pool.config(consolidation={"enabled": True, "max_moves_per_minute": 4})
    async with running(client, config) as service:
        # Keep c full while the halves are placed, and the first half's GPU full while the second is.
        await client.create(fraction_pod(pool, "block-c", "0.9", node=names[2], opt_in=False))
        await wait_bound(client, ns, 1, timeout=20)
        await client.create(fraction_pod(pool, "half-1", "0.5", movable_by=replicaset))
        await wait_bound(client, ns, 2, timeout=20)
        first = await node_of(client, ns, "half-1")
        await client.create(fraction_pod(pool, "block-half", "0.5", node=first, opt_in=False))
        await client.create(fraction_pod(pool, "half-2", "0.5", movable_by=replicaset))
        await wait_bound(client, ns, 4, timeout=20)
        assert {first, await node_of(client, ns, "half-2")} == set(names[:2])
        for blocker in ("block-c", "block-half"):
            await client.delete(Pod, blocker, namespace=ns)
        await pod_group(client, pool, "pair", 2)
        for i in range(2):
            await client.create(member(pool, f"g-{i}", "pair"))

        async def one_half_gone() -> bool:
            left = [p.metadata.name async for p in client.list(Pod, namespace=ns)]
            return "half-1" not in left or "half-2" not in left

        await wait_for(one_half_gone, timeout=30, what="one movable half evicted")
        # The ReplicaSet controller's part: a replacement with the same template and owner.
        await client.create(fraction_pod(pool, "half-3", "0.5", movable_by=replicaset))

        await wait_all_bound(client, ns, ["g-0", "g-1", "half-3"])
        gang_nodes = {await node_of(client, ns, f"g-{i}") for i in range(2)}
        assert names[2] in gang_nodes and len(gang_nodes) == 2
        assert await node_of(client, ns, "half-3") not in gang_nodes, (
            "the replacement kept off the gang's room"
        )
        moved = await events(client, ns, "Moved")
        assert len(moved) == 1 and f"room for gang {ns}/pair" in moved[0].message
        consolidating = await events(client, ns, "Consolidating")
        assert sorted(e.involvedObject.name for e in consolidating) == ["g-0", "g-1"]
        assert service.preemptions is not None and service.preemptions.moved == 1
        assert (await audit_pool(client, pool)).ok


def test_a_gang_not_tried_for_an_hour_is_forgotten_and_its_pod_group_read_again() -> None:
    now = [0.0]
    reads: list[str] = []

    def spawn(coro: Any) -> None:
        reads.append(coro.cr_frame.f_locals["key"].name)
        coro.close()

    gangs = Gangs(client=None, spawn=spawn, retry=lambda: None, clock=lambda: now[0])  # type: ignore[arg-type]
    done, waiting = GangKey(SCHEDULER_PLUGINS, "ns", "done"), GangKey(SCHEDULER_PLUGINS, "ns", "waiting")
    for key in (done, waiting):
        assert gangs.spec(key) is None
        gangs._store(key, _Read(GangSpec(2, 30.0), at=now[0]))
        gangs.waited(key)
    assert reads == ["done", "waiting"] and len(gangs) == 2
    # Only the waiting gang's pods keep being tried (every few minutes, as parked pods are).
    while now[0] <= FORGET_AFTER_S + REFRESH_S:
        now[0] += 25.0
        assert isinstance(gangs.spec(waiting), GangSpec)
    assert len(gangs) == 1
    assert gangs.waited(waiting)[0] > FORGET_AFTER_S, "the waiting gang keeps its waiting time"
    # A pod of the forgotten gang comes back: its PodGroup is read anew.
    assert gangs.spec(done) is None and reads[-1] == "done"
