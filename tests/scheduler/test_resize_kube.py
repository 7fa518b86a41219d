"""Resizing a running fraction through the real API server with the scheduler running (issue #38): the
user writes a resize request, the scheduler decides on the pod's own GPU and writes the new amounts."""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Pod
from sched_harness import (
    Pool,
    add_nodes,
    audit_pool,
    condition,
    gpu_pod,
    metric,
    running,
    scrape,
    wait_bound,
    wait_for,
)

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.booking_audit import books_disagree
from gpufrac.scheduler.service import SchedulerService

ONE_GPU = NodeShape(gpus=1, gpu_mib=16384)
REQ, LIM = keys.memory_request_key("app"), keys.memory_limit_key("app")
RESIZE = keys.resize_key("app", keys.RESIZE_MEMORY_REQUEST)
PENDING = keys.POD_RESIZE_PENDING_CONDITION


async def ask(client: AsyncClient, pool: Pool, name: str, **annotations: str | None) -> None:
    body = {"metadata": {"annotations": annotations or {RESIZE: None}}}
    await client.patch(Pod, name, body, namespace=pool.namespace)


async def annotations(client: AsyncClient, pool: Pool, name: str) -> dict[str, str]:
    return dict((await client.get(Pod, name, namespace=pool.namespace)).metadata.annotations or {})


async def wait_amount(client: AsyncClient, pool: Pool, name: str, mib: int, *, timeout: float = 20) -> None:
    async def resized() -> bool:
        found = await annotations(client, pool, name)
        return found.get(REQ) == f"{mib}Mi" and RESIZE not in found

    await wait_for(resized, timeout=timeout, what=f"{name} resized to {mib} MiB")


async def wait_pending(client: AsyncClient, pool: Pool, name: str, reason: str) -> str:
    message = ""

    async def pending() -> bool:
        nonlocal message
        status, found, message = condition(await client.get(Pod, name, namespace=pool.namespace), PENDING)
        return (status, found) == ("True", reason)

    await wait_for(pending, timeout=20, what=f"{name} {reason}")
    return message or ""


async def events(client: AsyncClient, pool: Pool, reason: str) -> list[Event]:
    return [e async for e in client.list(Event, namespace=pool.namespace) if e.reason == reason]


async def books_match(client: AsyncClient, pool: Pool, service: SchedulerService) -> None:
    """The booking audit: no GPU over capacity, and the scheduler's books are what the pods say."""
    report = await audit_pool(client, pool)
    assert report.ok, report.problems
    ledgers = [ledger for node in service.cache.nodes for ledger in service.cache.engine.ledger(node)]
    assert books_disagree(report, ledgers) == []


async def two_pods(client: AsyncClient, pool: Pool, amount: str, extra: dict[str, str] | None = None) -> None:
    for name in ("a", "b"):
        await client.create(gpu_pod(pool, name, {REQ: amount, **(extra or {})}))
    await wait_bound(client, pool.namespace, 2, timeout=30)


async def test_a_grow_that_fits_and_a_shrink_change_the_pod_and_the_books(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1, shape=ONE_GPU)
    async with running(client, pool.config()) as service:
        await two_pods(client, pool, "4Gi")
        devices = (await annotations(client, pool, "a"))[keys.devices_key("app")]
        await ask(client, pool, "a", **{RESIZE: "8Gi"})
        await wait_amount(client, pool, "a", 8192)
        after = await annotations(client, pool, "a")
        assert after[LIM] == "8192Mi" and after[keys.devices_key("app")] == devices  # never a move
        await books_match(client, pool, service)
        (resized,) = await events(client, pool, keys.EVENT_REASON_RESIZED)
        assert "request 4096 -> 8192 MiB, limit 4096 -> 8192 MiB" in (resized.message or "")

        await ask(
            client, pool, "a", **{RESIZE: "2Gi", keys.resize_key("app", keys.RESIZE_MEMORY_LIMIT): "6Gi"}
        )
        await wait_amount(client, pool, "a", 2048)
        assert (await annotations(client, pool, "a"))[LIM] == "6144Mi"
        await books_match(client, pool, service)
        assert condition(await client.get(Pod, "a", namespace=pool.namespace), PENDING)[0] is None


async def test_a_grow_waits_for_room_and_one_larger_than_the_gpu_is_infeasible(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1, shape=ONE_GPU)
    async with running(client, pool.config()) as service:
        await two_pods(client, pool, "8Gi")
        await ask(client, pool, "a", **{RESIZE: "12Gi"})
        message = await wait_pending(client, pool, "a", keys.POD_REASON_RESIZE_DEFERRED)
        assert "has 8192 MiB beside its other bookings; the pod would need 12288 MiB" in message
        assert f"{pool.namespace}/b 8192 MiB" in message
        assert (await annotations(client, pool, "a"))[REQ] == "8192Mi"
        await books_match(client, pool, service)

        await client.delete(Pod, "b", namespace=pool.namespace, grace_period=0)
        await wait_amount(client, pool, "a", 12288)
        await wait_for(
            lambda: _no_condition(client, pool, "a"), timeout=10, what="the pending condition removed"
        )
        await books_match(client, pool, service)

        await ask(client, pool, "a", **{RESIZE: "20Gi"})
        message = await wait_pending(client, pool, "a", keys.POD_REASON_RESIZE_INFEASIBLE)
        assert "has 16384 MiB in all; the pod would need 20480 MiB of it" in message
        (warning,) = await events(client, pool, keys.EVENT_REASON_RESIZE_INFEASIBLE)
        assert warning.type == "Warning" and "16384 MiB in all" in (warning.message or "")
        # Each answer counted once (Deferred once, however often it was decided again); the decision time
        # once per request, at its first answer: the 12Gi one's Deferred and the 20Gi one's Infeasible.
        text = await scrape(service.probe_port)
        answers = {
            outcome: metric(text, "gpufrac_scheduler_resizes_total", outcome=outcome)
            for outcome in ("resized", "deferred", "infeasible")
        }
        assert answers == {"resized": 1, "deferred": 1, "infeasible": 1}
        assert metric(text, "gpufrac_scheduler_resize_decision_duration_seconds_count") == 2
        assert 0 < metric(text, "gpufrac_scheduler_resize_decision_duration_seconds_sum") < 20
        await ask(client, pool, "a")  # withdrawn: the condition goes, the amounts stay
        await wait_for(lambda: _no_condition(client, pool, "a"), timeout=10, what="withdrawn")
        assert (await annotations(client, pool, "a"))[REQ] == "12288Mi"


async def test_an_sm_sharing_compute_resize_rewrites_the_portion_beside_the_gpus_other_portions(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1, shape=ONE_GPU)
    compute, portion = keys.resize_key("app", keys.RESIZE_COMPUTE_REQUEST), keys.compute_portion_key("app")
    async with running(client, pool.config()) as service:
        await two_pods(client, pool, "4Gi", {keys.compute_mode_key("app"): "sm-sharing"})
        assert (await annotations(client, pool, "a"))[portion] == "0.25"
        await ask(client, pool, "a", **{compute: "0.75"})

        async def rewritten() -> bool:
            found = await annotations(client, pool, "a")
            return found.get(portion) == "0.75" and compute not in found

        await wait_for(rewritten, timeout=20, what="a's compute portion rewritten")
        assert (await annotations(client, pool, "a"))[REQ] == "4096Mi"  # the memory stays as bound
        (resized,) = await events(client, pool, keys.EVENT_REASON_RESIZED)
        assert "compute portion 0.25 -> 0.75" in (resized.message or "")
        await books_match(client, pool, service)

        await ask(client, pool, "b", **{compute: "0.5"})
        message = await wait_pending(client, pool, "b", keys.POD_REASON_RESIZE_DEFERRED)
        assert "has a compute portion of 0.25 beside its other sm-sharing bookings" in message
        assert f"{pool.namespace}/a 0.75" in message
        await client.delete(Pod, "a", namespace=pool.namespace, grace_period=0)
        await wait_for(
            lambda: _portion_is(client, pool, "b", "0.5"), timeout=20, what="b's compute portion rewritten"
        )
        await books_match(client, pool, service)


async def _portion_is(client: AsyncClient, pool: Pool, name: str, value: str) -> bool:
    found = await annotations(client, pool, name)
    return found.get(keys.compute_portion_key("app")) == value and not any(".resize." in k for k in found)


async def _no_condition(client: AsyncClient, pool: Pool, name: str) -> bool:
    return condition(await client.get(Pod, name, namespace=pool.namespace), PENDING)[0] is None


async def test_a_scheduler_stopped_or_failing_between_books_and_patch_ends_in_one_state(
    client: AsyncClient, pool: Pool
) -> None:
    await add_nodes(client, pool, count=1, shape=ONE_GPU)
    config = pool.config()
    async with running(client, config) as service:
        await two_pods(client, pool, "4Gi")

        # A shrink whose patch lands but whose answer is lost: the books (still the old, larger amount,
        # the safe side) follow the pod once it shows the new binding.
        real = service.resizes._patch

        async def lost_answer(pod: Pod, written: dict[str, Any]) -> Pod:
            await real(pod, written)
            raise TimeoutError("injected: the answer was lost")

        service.resizes.write = lost_answer
        await ask(client, pool, "b", **{RESIZE: "2Gi"})
        await wait_for(lambda: _is(_held(service, "b"), 2048), timeout=15, what="the books following b")
        assert (await annotations(client, pool, "b"))[keys.memory_request_key("app")] == "2048Mi"
        await books_match(client, pool, service)

        held_while_writing: list[int] = []

        async def failing(pod: Pod, written: dict[str, Any]) -> Pod:
            if pod.metadata.name == "a":
                held_while_writing.append(_held(service, "a"))
            raise KubeError("injected: refused by a policy", code=403)

        service.resizes.write = failing
        await ask(client, pool, "a", **{RESIZE: "8Gi"})
        await wait_for(lambda: _any(held_while_writing), timeout=10, what="a refused write")
        assert held_while_writing[0] == 8192  # the books held the grow before the write
        assert _held(service, "a") == 4096  # and were rolled back
        assert (await annotations(client, pool, "a"))[REQ] == "4096Mi"
        await books_match(client, pool, service)

        stuck = asyncio.Event()

        async def hanging(pod: Pod, written: dict[str, Any]) -> Pod:
            stuck.set()
            await asyncio.Event().wait()  # killed here, after the books changed, before the patch
            raise AssertionError("unreachable")

        service.resizes.write = hanging
        service.resizes.observe(await client.get(Pod, "a", namespace=pool.namespace))
        await asyncio.wait_for(stuck.wait(), timeout=15)
        assert _held(service, "a") == 8192
    # Stopped mid-resize: the pod still says 4096 MiB and asks for 8 GiB. A new scheduler books what the
    # pods say and decides the request again.
    assert (await annotations(client, pool, "a"))[REQ] == "4096Mi"
    async with running(client, config) as restarted:
        await wait_amount(client, pool, "a", 8192)
        await books_match(client, pool, restarted)


def _held(service: SchedulerService, name: str) -> int:
    for booking in service.cache:
        if booking.pod.metadata.name == name:
            return booking.placement.containers[0].devices[0].request_mib
    raise AssertionError(f"{name} is not booked")


async def _is(value: int, expected: int) -> bool:
    return value == expected


async def _any(found: list[int]) -> bool:
    return bool(found)
