"""The scheduler service through an API server that answers 429 and 5xx, loses answers and cuts watches.

The scheduler's client goes through tests/apiproxy.py (a proxy in front of the real API server that plays
a fixed script of faults); the test reads and writes directly. Each scenario fills its GPUs exactly, so a
double booking cannot hide: it would leave a pod without room, or the booking audit (every bound pod's
``gpus.devices`` and MiB against each GPU's memory, as the API holds them) would find a GPU over its
memory. Every scenario also checks that its faults were played, so a script that stopped matching the
scheduler's requests fails instead of passing quietly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Pod
from sched_harness import Pool, add_nodes, audit_pool, gpu_pod, pods_of, running, wait_bound, wait_for
from test_binder_conflicts import placed_half
from test_preemption import exists, mark_running, whole_gpu_pod

from apiproxy import (
    FaultProxy,
    Rule,
    answer,
    binds,
    cut_watch,
    evictions,
    lose_answer,
    proxied_client,
    watches,
)
from gpufrac.contract import keys
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.binder import Binder, BindMode, Outcome
from gpufrac.scheduler.booking_cache import BookingState

pytestmark = pytest.mark.kube

HALF = {keys.GPU_FRACTION: "0.5"}


@pytest.fixture
async def proxy(controlplane: ControlPlane) -> AsyncIterator[FaultProxy]:
    async with FaultProxy.for_controlplane(controlplane, max_requests=3000, lifetime_s=120) as p:
        yield p
    assert p.refused_over_budget == 0, "the scheduler made more requests than the scenario allows"


@pytest.fixture
async def through(proxy: FaultProxy) -> AsyncIterator[AsyncClient]:
    client = proxied_client(proxy)
    try:
        yield client
    finally:
        await client.close()


async def all_played(proxy: FaultProxy) -> bool:
    return all(rule.used_up for rule in proxy.rules if not rule.name.startswith("read-back"))


async def test_binds_and_watches_answered_429_and_5xx_lose_no_pod_and_double_book_no_gpu(
    client: AsyncClient, pool: Pool, proxy: FaultProxy, through: AsyncClient
) -> None:
    await add_nodes(client, pool, count=2, shape=NodeShape(gpus=2))
    own_pods = f"spec.schedulerName={pool.scheduler_name},"  # the scheduler's own pod informer
    proxy.rules += [
        Rule("binds", binds, [answer(429, retry_after=1), answer(503), None, answer(500), answer(504)]),
        Rule(
            "pod watch",
            watches("pods", fields=own_pods),
            [cut_watch(after_lines=3), answer(503), answer(429, retry_after=1)],
        ),
        Rule("node watch", watches("nodes"), [answer(500)]),
    ]
    async with running(through, pool.config()):
        for i in range(8):  # 8 halves fill the 4 GPUs exactly
            await client.create(gpu_pod(pool, f"p{i}", HALF))
        await wait_bound(client, pool.namespace, 8, timeout=60)
        await wait_for(lambda: all_played(proxy), timeout=30, what="every fault played")

        async def failed_bindings() -> list[str]:
            events = [e async for e in client.list(Event, namespace=pool.namespace)]
            return [e.message for e in events if e.reason == "FailedBinding"]

        async def all_reported() -> bool:
            messages = " ".join(await failed_bindings())
            return all(code in messages for code in ("503", "500", "504"))

        # A 5xx may have landed: the bind fails (and is recognised or retried); a throttling 429 did not
        # run at all and is sent again after its Retry-After, as client-go does: no FailedBinding for it.
        await wait_for(all_reported, timeout=20, what="FailedBinding Events for the 5xx answers")
        assert not [m for m in await failed_bindings() if "429" in m or "TooManyRequests" in m]
    report = await audit_pool(client, pool)
    assert report.ok, report.problems
    assert report.placed_pods == 8
    played = {rule: [str(i.fault) for i in proxy.faults_of(rule)] for rule in ("binds", "pod watch")}
    assert played == {
        "binds": ["429 Retry-After 1", "503", "500", "504"],
        "pod watch": ["cut after 3 events", "503", "429 Retry-After 1"],
    }
    assert proxy.watches_cut == 1


@pytest.mark.parametrize("bind_mode", ["atomic", "patch-then-bind"])
@pytest.mark.parametrize("read_backs_refused", [0, 3], ids=["read-back-answers", "read-back-fails-too"])
async def test_a_binding_whose_answer_is_lost_is_recognised_and_its_gpu_not_given_twice(
    client: AsyncClient,
    pool: Pool,
    proxy: FaultProxy,
    through: AsyncClient,
    read_backs_refused: int,
    bind_mode: str,
) -> None:
    """The first Binding lands, its answer is lost (connection reset), the pod watch is cut at the same
    moment and, in the second case, reading the pod back fails too: the scheduler does not know whether
    the pod is bound. Three halves compete for one GPU (two fit): handing the first pod's half to the
    third before the API says what happened would put three halves on it."""
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1))
    lost = lose_answer(reset=True, cut_watches="pods", refuse_reads=read_backs_refused)
    proxy.rules.append(Rule("binds", binds, [lost]))
    async with running(through, pool.config(bind_mode=bind_mode)) as service:
        for name in ("a", "b", "c"):
            await client.create(gpu_pod(pool, name, HALF))

        async def settled() -> bool:
            """Three pods bound (the lost one's half given twice), or two bound, every refused read-back
            played and the scheduler's books confirmed by the watch for both (the lost answer recognised,
            the cut watch back)."""
            pods = await pods_of(client, pool.namespace)
            bound = [p for p in pods if p.spec.nodeName]
            if len(bound) == 3:
                return True
            bookings = [service.cache.booking(p.metadata.uid) for p in bound]
            read_backs = [i for i in proxy.injected if i.rule.startswith("read-back")]
            return (
                len(bound) == 2
                and len(read_backs) == read_backs_refused
                and all(b is not None and b.state is BookingState.CONFIRMED for b in bookings)
            )

        await wait_for(settled, timeout=30, what="the scheduler settled after the lost answer")
        assert len(proxy.faults_of("binds")) == 1
        report = await audit_pool(client, pool)
        assert report.ok, report.problems
        pods = await pods_of(client, pool.namespace)
        assert sorted(bool(p.spec.nodeName) for p in pods) == [False, True, True]
        unbound = next(p for p in pods if not p.spec.nodeName)
        # The pod left over waits for room, as the scheduler says.
        await wait_for(
            lambda: _unschedulable(client, pool.namespace, unbound.metadata.name),
            timeout=20,
            what="the third pod reported unschedulable",
        )


async def _unschedulable(client: AsyncClient, namespace: str, name: str) -> bool:
    pod = await client.get(Pod, name, namespace=namespace)
    if pod.spec.nodeName:
        return False
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in (pod.status.conditions or [])
    )


async def test_evictions_answered_429_and_503_still_make_room_for_the_higher_priority_pod(
    client: AsyncClient, pool: Pool, proxy: FaultProxy, through: AsyncClient, priorities: dict[str, str]
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1))
    ns = pool.namespace
    proxy.rules.append(
        Rule("evictions", evictions, [answer(429, retry_after=1), answer(503), lose_answer(reset=True)])
    )
    async with running(through, pool.config()):
        await client.create(whole_gpu_pod(pool, "low", priority=priorities["low"]))
        await wait_bound(client, ns, 1, timeout=20)
        await mark_running(client, ns, "low")
        await client.create(whole_gpu_pod(pool, "high", priority=priorities["high"]))

        async def high_bound() -> bool:
            return bool((await client.get(Pod, "high", namespace=ns)).spec.nodeName)

        await wait_for(high_bound, timeout=30, what="the high-priority pod bound")
    assert not await exists(client, ns, "low")
    report = await audit_pool(client, pool)
    assert report.ok, report.problems
    assert report.placed_pods == 1
    assert [str(i.fault) for i in proxy.faults_of("evictions")] == [
        "429 Retry-After 1",
        "503",
        "answer lost (reset)",
    ]


@pytest.mark.parametrize("mode", [BindMode.ATOMIC, BindMode.PATCH_THEN_BIND])
async def test_a_lost_binding_the_binder_could_not_read_back_is_recognised_when_bound_again(
    client: AsyncClient, pool: Pool, proxy: FaultProxy, through: AsyncClient, mode: BindMode
) -> None:
    """The API server stays unreadable past the binder's read-back: the bind reports failure (unknown),
    and its retry is answered 409 (already bound); that answer, read back, is the first bind landing with
    exactly these devices, so the retry is BOUND and nothing is written twice."""
    pod, placement = await placed_half(client, pool, "lost")
    request = parse_pod(pod.metadata.annotations, [ContainerSpec(name="app")])
    proxy.rules.append(Rule("binds", binds, [lose_answer(reset=True, refuse_reads=1000)]))
    binder = Binder(client=through, fence=lambda: True, mode=mode, read_back_s=0.3)
    first = await binder.bind(pod, request=request, placement=placement)
    assert first.outcome is Outcome.FAILED
    landed = await client.get(Pod, "lost", namespace=pool.namespace)
    assert landed.spec.nodeName == placement.node  # it did land
    proxy.rules[:] = [rule for rule in proxy.rules if not rule.name.startswith("read-back")]  # readable again

    again = await binder.bind(pod, request=request, placement=placement)
    assert again.outcome is Outcome.BOUND, again
    stored = await client.get(Pod, "lost", namespace=pool.namespace)
    assert stored.metadata.resourceVersion == landed.metadata.resourceVersion  # the retry wrote nothing
    assert stored.metadata.annotations[keys.devices_key("app")] == placement.containers[0].uuids[0]
