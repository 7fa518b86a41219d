"""Consolidation through the scheduler: who may be moved, the configuration, and a move through the real
API server.

The control plane runs no controller manager and no kubelet: the tests play the ReplicaSet controller
(they create the replacement of a moved pod, with the same template and owner), and a pod with a zero
termination grace period is deleted by its eviction at once, as a kubelet would finish it.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from lightkube import AsyncClient
from lightkube.resources.apps_v1 import ReplicaSet
from lightkube.resources.core_v1 import Event, Pod
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
from gpufrac.placement.consolidation import MoveBudget
from gpufrac.placement.decision import ContainerPlacement, DeviceAssignment, Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import GpuDevice, ModePolicy, NodeSpec, PendingPod
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.objects import movable, pending_pod
from gpufrac.scheduler.preemption import HOLD_PREFIX, Preemptions
from gpufrac.scheduler.preemption_pacing import NO_PLAN_BACKOFF_MAX_S, NO_PLAN_BACKOFF_S, REFUSAL_MEMORY_S

TS = ComputeMode.TIME_SLICING

# -- who may be moved ---------------------------------------------------------------------------------------


def api_pod(*, annotations: dict[str, str] | None = None, owners: list[dict[str, Any]] | None = None) -> Pod:
    return Pod.from_dict(
        {
            "metadata": {
                "name": "p",
                "namespace": "ns",
                "uid": "u",
                "annotations": annotations or {},
                "ownerReferences": owners or [],
            },
            "spec": {"containers": [{"name": "app", "image": "busybox"}]},
        }
    )


def owner(*, controller: bool | None) -> dict[str, Any]:
    ref: dict[str, Any] = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "rs-uid"}
    if controller is not None:
        ref["controller"] = controller
    return ref


OPTED_IN = {keys.MOVABLE_ANNOTATION: "true"}


def test_a_pod_is_movable_only_when_it_opted_in_and_a_controller_owns_it() -> None:
    assert movable(api_pod(annotations=OPTED_IN, owners=[owner(controller=True)]))
    assert not movable(api_pod(annotations=OPTED_IN)), "a bare pod: nothing would recreate it"
    assert not movable(api_pod(annotations=OPTED_IN, owners=[owner(controller=False)]))
    assert not movable(api_pod(annotations=OPTED_IN, owners=[owner(controller=None)]))
    assert not movable(api_pod(owners=[owner(controller=True)])), "owned but did not opt in"
    assert not movable(api_pod(annotations={keys.MOVABLE_ANNOTATION: "yes"}, owners=[owner(controller=True)]))
    pending = pending_pod(
        api_pod(annotations=OPTED_IN, owners=[owner(controller=True)]),
        gpu=PodGpuRequest(),
        arrival=0,
        default_queue="default",
        mode_policy=ModePolicy.REQUIRED,
    )
    assert pending.movable


def test_the_consolidation_settings_are_validated_by_name() -> None:
    config = SchedulerConfig.model_validate({"consolidation": {"enabled": True, "max_moves_per_minute": 2}})
    assert config.consolidation.enabled and config.consolidation.max_moves_per_minute == 2
    assert not SchedulerConfig().consolidation.enabled, "off unless asked for"
    with pytest.raises(pydantic.ValidationError) as error:
        SchedulerConfig.model_validate({"consolidation": {"max_moves_per_minute": 0}})
    text = str(error.value)
    assert "consolidation.max_moves_per_minute" in text and "input_value=0" in text
    assert "greater than or equal to 1" in text
    with pytest.raises(pydantic.ValidationError, match=r"consolidation\.max_moves"):
        SchedulerConfig.model_validate({"consolidation": {"max_moves": 3}})


# -- the bound on moves, in the scheduler's own step -------------------------------------------------------


def mib_request(mib: int) -> PodGpuRequest:
    return PodGpuRequest((ContainerGpuRequest("app", GpuMemory(mib=mib), None),))


def two_fragmented_pairs() -> tuple[Engine, dict[str, Pod]]:
    """Four one-GPU nodes of 16000 MiB. a and c: a movable 8000 MiB pod and a fixed 4000; b and d: a
    fixed 8000. A 10000 MiB pod fits nowhere, and fits on a (or c) once its movable pod is on b (or d)."""
    engine = Engine(policy="binpack")
    owned = api_pod(annotations=OPTED_IN, owners=[owner(controller=True)])
    pods: dict[str, Pod] = {}
    for name in "abcd":
        gpu = GpuDevice(f"{name}-gpu", 0, 16000)
        engine.add_node(NodeSpec(name=name, cpu_milli=64_000, memory_bytes=1 << 38, gpus=(gpu,)))
        here = [("fixed", 8000, False)] if name in "bd" else [("mover", 8000, True), ("fixed", 4000, False)]
        for kind, mib, can_move in here:
            uid = f"{kind}-{name}"
            booked = PendingPod(namespace="ns", name=uid, uid=uid, gpu=mib_request(mib), movable=can_move)
            engine.assume(
                booked,
                Placement(
                    uid,
                    name,
                    (ContainerPlacement("app", TS, False, (DeviceAssignment(gpu.uuid, 0, mib, mib, None),)),),
                ),
            )
            pods[uid] = owned
    return engine, pods


def test_a_move_the_per_minute_bound_cannot_pay_for_waits_and_says_so() -> None:
    engine, pods = two_fragmented_pairs()
    now = [0.0]
    started: list[Any] = []
    retries: list[int] = []

    def spawn(coro: Any) -> None:
        started.append(coro.cr_code.co_name)
        coro.close()  # the evictions (and the refill timer) are not run here: the decision is tested

    preemptions = Preemptions(
        client=None,  # type: ignore[arg-type]
        engine=engine,
        events=None,  # type: ignore[arg-type]
        victim_pod=pods.get,
        release=lambda uid: True,
        place_now=lambda pod: None,
        retry=lambda: retries.append(1),
        spawn=spawn,
        clock=lambda: now[0],
        preempt=False,
        moves=MoveBudget(1, now=0.0),
    )
    first, second = (
        PendingPod(namespace="ns", name=n, uid=n, gpu=mib_request(10000)) for n in ("first", "second")
    )
    for p in (first, second):
        assert not isinstance(engine.place(p), Placement)
    nowhere = Unschedulable("x", 4, (("insufficient GPU memory", 4),))
    message = preemptions.consider(first, api_pod(), nowhere)
    assert message.startswith("0/4 nodes are available: 4 insufficient GPU memory. Moving 1 pod(s) on node")
    assert started == ["_execute"]
    # The other movable pod would do for the second pod, but the minute's one move is spent.
    message = preemptions.consider(second, api_pod(), nowhere)
    assert message.endswith(
        "insufficient GPU memory. Consolidation: deferred by consolidation.max_moves_per_minute=1."
    )
    assert started == ["_execute", "later"], "a retry is due once the bucket has refilled"
    now[0] = 59.0
    assert "deferred" in preemptions.consider(second, api_pod(), nowhere)
    now[0] = 60.0
    assert "Moving 1 pod(s) on node" in preemptions.consider(second, api_pod(), nowhere)
    assert started[-1] == "_execute"


# -- through the API server --------------------------------------------------------------------------------


def fraction_pod(
    pool: Pool,
    name: str,
    portion: str,
    *,
    node: str | None = None,
    movable_by: ReplicaSet | None = None,
    opt_in: bool = True,
) -> Pod:
    annotations = {keys.GPU_FRACTION: portion}
    if opt_in:
        annotations |= OPTED_IN
    pod = gpu_pod(pool, name, annotations, labels={"app": "serve"} if movable_by else None)
    pod.spec.terminationGracePeriodSeconds = 0
    if node is not None:
        pod.spec.nodeSelector = {"kubernetes.io/hostname": node}
    if movable_by is not None:
        meta = movable_by.metadata
        pod.metadata.ownerReferences = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": meta.name,
                "uid": meta.uid,
                "controller": True,
            }
        ]
    return pod


async def node_of(client: AsyncClient, namespace: str, name: str) -> str | None:
    return (await client.get(Pod, name, namespace=namespace)).spec.nodeName


async def events(client: AsyncClient, namespace: str, reason: str) -> list[Event]:
    return [e async for e in client.list(Event, namespace=namespace) if e.reason == reason]


async def fragment(client: AsyncClient, pool: Pool, *, owner: ReplicaSet | None) -> tuple[str, str]:
    """Two one-GPU nodes. a: a fixed quarter and the half that may move (a quarter free); b: a fixed
    half (half free). A 0.6 pod then fits on neither, and on a once the half is on b."""
    a, b = sorted(await add_nodes(client, pool, count=2, shape=NodeShape(gpus=1)))
    ns = pool.namespace
    await client.create(fraction_pod(pool, "fixed-a", "0.25", node=a, opt_in=False))
    await client.create(fraction_pod(pool, "fixed-b", "0.5", node=b, opt_in=False))
    await client.create(fraction_pod(pool, "filler", "0.25", node=b, opt_in=False))
    await wait_bound(client, ns, 3, timeout=20)
    # b is three quarters full, so the half can only go to a; then the filler leaves.
    await client.create(fraction_pod(pool, "mover", "0.5", movable_by=owner))
    await wait_bound(client, ns, 4, timeout=20)
    assert await node_of(client, ns, "mover") == a
    await client.delete(Pod, "filler", namespace=ns)
    return a, b


async def test_a_fragmented_cluster_moves_a_movable_pod_and_binds_the_pending_one(
    client: AsyncClient, pool: Pool, replicaset: ReplicaSet
) -> None:
    ns = pool.namespace
    config = pool.config(consolidation={"enabled": True, "max_moves_per_minute": 4})
    async with running(client, config) as service:
        a, b = await fragment(client, pool, owner=replicaset)
        mover_uid = (await client.get(Pod, "mover", namespace=ns)).metadata.uid
        await client.create(fraction_pod(pool, "pending", "0.6", opt_in=False))

        async def mover_gone() -> bool:
            return "mover" not in [p.metadata.name async for p in client.list(Pod, namespace=ns)]

        await wait_for(mover_gone, timeout=30, what="the movable pod evicted")
        # The ReplicaSet controller's part: the same template, the same owner, a new name.
        await client.create(fraction_pod(pool, "mover-2", "0.5", movable_by=replicaset))

        async def both_bound() -> bool:
            return bool(await node_of(client, ns, "pending")) and bool(await node_of(client, ns, "mover-2"))

        await wait_for(both_bound, timeout=30, what="the pending pod and the replacement bound")
        assert await node_of(client, ns, "pending") == a
        assert await node_of(client, ns, "mover-2") == b, "the replacement is not placed on the freed room"
        moved = await events(client, ns, "Moved")
        assert [(e.involvedObject.name, e.involvedObject.uid) for e in moved] == [("mover", mover_uid)]
        assert f"room for {ns}/pending on node {a}" in moved[0].message
        consolidating = await events(client, ns, "Consolidating")
        assert [e.involvedObject.name for e in consolidating] == ["pending"]
        assert f"{ns}/mover" in consolidating[0].message
        assert service.preemptions is not None and service.preemptions.moved == 1
        assert (await audit_pool(client, pool)).ok


async def test_without_movable_pods_the_pod_stays_pending_and_says_why(
    client: AsyncClient, pool: Pool
) -> None:
    ns = pool.namespace
    config = pool.config(consolidation={"enabled": True})
    async with running(client, config) as service:
        # The half opted in but is a bare pod: nothing would recreate it, so it is not moved.
        await fragment(client, pool, owner=None)
        await client.create(fraction_pod(pool, "pending", "0.6", opt_in=False))

        async def reported() -> bool:
            status, _, message = condition(await client.get(Pod, "pending", namespace=ns))
            return status == "False" and "may be moved" in (message or "")

        await wait_for(reported, timeout=30, what="the pending pod reported unschedulable")
        _, reason, message = condition(await client.get(Pod, "pending", namespace=ns))
        assert reason == "Unschedulable"
        assert "Consolidation: no pod on the nodes that could take it may be moved" in (message or "")
        assert not await node_of(client, ns, "pending")
        assert "mover" in [p.metadata.name async for p in client.list(Pod, namespace=ns)]
        assert service.preemptions is not None and service.preemptions.moved == 0


def test_the_pending_pods_room_is_held_while_the_moved_pod_leaves() -> None:
    engine, pods = two_fragmented_pairs()
    placed_now: list[Pod] = []
    preemptions = preemptions_without_io(
        engine,
        victim_pod=pods.get,
        release=engine.forget,
        place_now=placed_now.append,
        preempt=False,
        moves=MoveBudget(4, now=0.0),
    )
    pending = PendingPod(namespace="ns", name="first", uid="first", gpu=mib_request(10000))
    waiting = api_pod()
    nowhere = Unschedulable("first", 4, (("insufficient GPU memory", 4),))
    assert "Moving 1 pod(s)" in preemptions.consider(pending, waiting, nowhere)
    hold = engine.held(f"{HOLD_PREFIX}first")
    assert hold is not None, "the free part of the room is booked for the pending pod"
    node = hold.node
    # A 3000 MiB pod would fit best in the 4000 MiB already free there; it goes elsewhere.
    intruder = engine.place(PendingPod(namespace="ns", name="small", uid="small", gpu=mib_request(3000)))
    assert isinstance(intruder, Placement) and intruder.node != node
    # The moved pod is gone: the hold is released and the pending pod placed at once.
    assert preemptions.deleted(f"mover-{node}")
    assert placed_now == [waiting]
    assert engine.held(f"{HOLD_PREFIX}first") is None
    assert engine.placement_of(f"mover-{node}") is None
    assert isinstance(engine.place(pending), Placement)


def one_gpu_nodes(held: dict[str, list[tuple[str, int, bool]]], gpu_mib: int) -> Engine:
    """One node of one ``gpu_mib`` GPU per key, holding its (uid, MiB, movable) pods."""
    engine = Engine(policy="binpack")
    for name, pods in held.items():
        gpu = GpuDevice(f"{name}-gpu", 0, gpu_mib)
        engine.add_node(NodeSpec(name=name, cpu_milli=64_000, memory_bytes=1 << 38, gpus=(gpu,)))
        for uid, mib, can_move in pods:
            booked = PendingPod(namespace="ns", name=uid, uid=uid, gpu=mib_request(mib), movable=can_move)
            device = DeviceAssignment(gpu.uuid, 0, mib, mib, None)
            engine.assume(booked, Placement(uid, name, (ContainerPlacement("app", TS, False, (device,)),)))
    return engine


def decisions_only(
    engine: Engine, *, moves: MoveBudget, clock: Any = None, started: list[str] | None = None
) -> Preemptions:
    """Preemptions whose evictions are not run (the decision is what is tested); ``started`` collects
    the names of the tasks it starts. Every pod is movable and owned by a controller."""
    owned = api_pod(annotations=OPTED_IN, owners=[owner(controller=True)])
    return preemptions_without_io(
        engine,
        victim_pod=lambda uid: owned,
        started=started,
        preempt=False,
        moves=moves,
        **({"clock": clock} if clock is not None else {}),
    )


def test_a_plan_of_more_moves_than_a_minute_allows_is_never_started() -> None:
    # a: two movable 5000 MiB pods and a fixed 4000 (2000 free); b: a fixed 6000 (10000 free). A 12000
    # MiB pod fits once both movable pods are on b: two moves, and the bound allows one a minute.
    engine = one_gpu_nodes(
        {"a": [("m1", 5000, True), ("m2", 5000, True), ("f", 4000, False)], "b": [("g", 6000, False)]}, 16000
    )
    started: list[str] = []
    preemptions = decisions_only(engine, moves=MoveBudget(1, now=0.0), started=started)
    big = PendingPod(namespace="ns", name="big", uid="big", gpu=mib_request(12000))
    assert not isinstance(engine.place(big), Placement)
    message = preemptions.consider(big, api_pod(), Unschedulable("big", 2, (("insufficient GPU memory", 2),)))
    assert message.endswith(
        "Consolidation would move 2 pod(s) off node a, more than consolidation.max_moves_per_minute=1 allows."
    )
    assert started == [], "nothing is evicted, and no retry would help"


def test_a_pod_without_a_plan_is_not_searched_again_until_its_backoff_ends() -> None:
    # a: a movable 8000 MiB pod and a fixed 6000 (6000 free); b: a fixed 16000 (4000 free). A 10000 MiB
    # pod fits nowhere, and the movable pod has nowhere to go: no plan.
    engine = one_gpu_nodes(
        {"a": [("mover", 8000, True), ("f", 6000, False)], "b": [("g", 16000, False)]}, 20000
    )
    now = [0.0]
    preemptions = decisions_only(engine, moves=MoveBudget(4, now=0.0), clock=lambda: now[0])
    big = PendingPod(namespace="ns", name="big", uid="big", gpu=mib_request(10000))
    nowhere = Unschedulable("big", 2, (("insufficient GPU memory", 2),))
    first = preemptions.consider(big, api_pod(), nowhere)
    assert "Consolidation: no set of the 1 movable pod(s)" in first
    # b's pod shrinks to 11000 MiB: the movable pod would now fit there, and the big pod on a after it.
    engine.forget("g")
    smaller = PendingPod(namespace="ns", name="g", uid="g", gpu=mib_request(11000))
    device = DeviceAssignment("b-gpu", 0, 11000, 11000, None)
    engine.assume(smaller, Placement("g", "b", (ContainerPlacement("app", TS, False, (device,)),)))
    assert not isinstance(engine.place(big), Placement)
    now[0] = NO_PLAN_BACKOFF_S - 1
    assert preemptions.consider(big, api_pod(), nowhere) == first, "not searched again yet"
    now[0] = NO_PLAN_BACKOFF_S
    assert "Moving 1 pod(s) on node a" in preemptions.consider(big, api_pod(), nowhere)


def test_backoffs_of_pods_no_longer_tried_are_forgotten() -> None:
    # Many pods without a plan, each tried once and then never again (placed elsewhere later, or gone
    # without the scheduler being told): a scheduler that runs for months must not remember them all.
    engine = one_gpu_nodes(
        {"a": [("mover", 8000, True), ("f", 6000, False)], "b": [("g", 16000, False)]}, 20000
    )
    now = [0.0]
    preemptions = decisions_only(engine, moves=MoveBudget(4, now=0.0), clock=lambda: now[0])
    nowhere = Unschedulable("x", 2, (("insufficient GPU memory", 2),))
    for i in range(50):
        big = PendingPod(namespace="ns", name=f"big-{i}", uid=f"big-{i}", gpu=mib_request(10000))
        # Each in a cycle of its own: 50 searches in one cycle would outrun its wall-clock search budget
        # on a loaded machine and defer the rest (preemption_pacing.CycleBudget).
        preemptions.new_cycle()
        assert "no set of the 1 movable pod(s)" in preemptions.consider(big, api_pod(), nowhere)
    assert preemptions.remembered == 50
    # One pod keeps being tried; the others' backoffs have long ended.
    live = PendingPod(namespace="ns", name="live", uid="live", gpu=mib_request(10000))
    now[0] = NO_PLAN_BACKOFF_S + NO_PLAN_BACKOFF_MAX_S + REFUSAL_MEMORY_S + 1
    preemptions.consider(live, api_pod(), nowhere)
    assert preemptions.remembered == 1
