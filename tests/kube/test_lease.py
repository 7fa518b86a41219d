"""Leader election on a real Lease: one leader at a time, hand-over on release, stepping down when fenced."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

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


async def test_one_leader_at_a_time_and_a_release_hands_over_at_once(client: AsyncClient) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = elector(client, name, "a"), elector(client, name, "b")
    task_a = asyncio.create_task(a.run())
    await asyncio.wait_for(a.leading.wait(), 5)
    task_b = asyncio.create_task(b.run())
    try:
        # b keeps trying for longer than a lease duration: a renews, so b never leads.
        for _ in range(int(FAST.lease_duration / 0.1) + 5):
            assert not (a.is_leader and b.is_leader)
            assert not b.leading.is_set()
            await asyncio.sleep(0.1)
        lease = await client.get(Lease, name, namespace="default")
        assert lease.spec.holderIdentity == "a"

        task_a.cancel()
        await asyncio.gather(task_a, return_exceptions=True)
        released_at = time.monotonic()
        await asyncio.wait_for(b.leading.wait(), 5)
        # released, so b did not have to wait for the lease to expire
        assert time.monotonic() - released_at < FAST.lease_duration
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
