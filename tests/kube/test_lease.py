"""Leader election on a real Lease: one leader at a time, hand-over on release, stepping down when fenced."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from gpufrac.kube.lease import LeaderElector, LeadershipLost, LeaseTiming

pytestmark = pytest.mark.kube

FAST = LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.25)


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


def elector(client: AsyncClient, name: str, identity: str) -> LeaderElector:
    return LeaderElector(client=client, name=name, namespace="default", identity=identity, timing=FAST)


async def test_a_leader_keeps_its_lease_over_many_renewals_and_a_rival_never_leads(
    client: AsyncClient,
) -> None:
    """Renewal is a periodic event: the leader must stay leader across many of them, past several lease
    durations (measured by the lease's own renewTime, as every candidate measures it), while a rival
    keeps trying."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = elector(client, name, "a"), elector(client, name, "b")
    task_a = asyncio.create_task(a.run())
    await asyncio.wait_for(a.leading.wait(), 5)
    task_b = asyncio.create_task(b.run())
    try:
        first = await client.get(Lease, name, namespace="default")
        renewals = {first.spec.renewTime}
        until = first.spec.renewTime + timedelta(seconds=3 * FAST.lease_duration)
        latest = first
        while latest.spec.renewTime < until:
            assert not task_a.done() and not task_b.done()
            assert a.is_leader and not b.leading.is_set()
            assert latest.spec.holderIdentity == "a" and latest.spec.leaseTransitions == 0
            assert latest.spec.acquireTime == first.spec.acquireTime
            await asyncio.sleep(FAST.retry_period / 2)
            latest = await client.get(Lease, name, namespace="default")
            renewals.add(latest.spec.renewTime)
        # Three lease durations at one renewal per retry period: dozens of renewals, one holder.
        assert len(renewals) >= 6
        assert latest.spec.holderIdentity == "a" and not b.leading.is_set()
    finally:
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)


async def test_a_release_hands_the_lease_over_at_once(client: AsyncClient) -> None:
    # A lease of a minute: b can lead within the test's few seconds only because a released it.
    slow = LeaseTiming(lease_duration=60.0, renew_deadline=40.0, retry_period=0.25)
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = (
        LeaderElector(client=client, name=name, namespace="default", identity=who, timing=slow)
        for who in ("a", "b")
    )
    task_a = asyncio.create_task(a.run())
    await asyncio.wait_for(a.leading.wait(), 5)
    task_b = asyncio.create_task(b.run())
    try:
        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        assert not a.is_leader
        await asyncio.wait_for(b.leading.wait(), 10)
        lease = await client.get(Lease, name, namespace="default")
        assert lease.spec.holderIdentity == "b" and lease.spec.leaseTransitions == 1
    finally:
        for task in (task_a, task_b):
            task.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)
    lease = await client.get(Lease, name, namespace="default")
    assert lease.spec.holderIdentity == ""


async def test_a_dead_leaders_lease_is_taken_after_it_expires(client: AsyncClient) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    now = datetime.now(UTC)
    await client.create(
        Lease.from_dict(
            {
                "metadata": {"name": name, "namespace": "default"},
                "spec": {
                    "holderIdentity": "crashed",
                    "leaseDurationSeconds": 2,
                    "acquireTime": now.isoformat(),
                    "renewTime": now.isoformat(),
                },
            }
        )
    )
    b = elector(client, name, "b")
    started = time.monotonic()
    task = asyncio.create_task(b.run())
    try:
        await asyncio.wait_for(b.leading.wait(), 10)
        waited = time.monotonic() - started
        assert waited >= 2.0  # never before the holder's lease duration has passed on our clock
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires(client: AsyncClient) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a = elector(client, name, "a")
    task = asyncio.create_task(a.run())
    await asyncio.wait_for(a.leading.wait(), 5)
    # Someone else takes the lease over (as an operator or a partitioned peer would).
    lease = await client.get(Lease, name, namespace="default")
    lease.spec.holderIdentity = "intruder"
    lease.spec.renewTime = datetime.now(UTC)
    await client.replace(lease)
    stolen_at = time.monotonic()
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(task, 10)
    assert not a.is_leader
    assert time.monotonic() - stolen_at <= FAST.renew_deadline + FAST.retry_period + 0.5
    lease = await client.get(Lease, name, namespace="default")
    assert lease.spec.holderIdentity == "intruder"  # a loser does not release what it does not hold
