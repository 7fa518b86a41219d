"""Leader election on a coordination.k8s.io Lease, with client-go's timing rules.

Two scheduler replicas must never both bind. The rules are client-go's, because they are what make
that true without synchronised clocks:

- A candidate trusts only its own monotonic clock: a lease held by someone else counts as expired when
  its record has not CHANGED for ``lease_duration`` since this candidate last saw it change, whatever
  ``renewTime`` says.
- The leader renews every ``retry_period`` and gives up when it could not renew for ``renew_deadline``
  (< ``lease_duration``), so it stops acting before any other candidate may take over.
- Every write is a PUT carrying the resourceVersion read just before, so two candidates racing for an
  expired lease cannot both win: the second gets 409.

``is_leader`` is the fence callers check right before each write: it turns false as soon as the renew
deadline has passed, even while a renew request is still in flight. On a clean stop the leader releases
the lease (empty holder), so a standby takes over at once instead of after ``lease_duration``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx2
from lightkube import AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from gpufrac.kube.errors import Conflict, KubeError, NotFound, api_errors

log = logging.getLogger(__name__)


class LeadershipLost(Exception):
    """The leader could not renew its lease within the renew deadline."""


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("lease timing needs 0 < retry_period < renew_deadline < lease_duration")


class LeaderElector:
    """Acquires, renews and releases one Lease for ``identity``.

    ``run()`` waits until this candidate leads, sets ``leading``, renews until cancelled (then releases
    and returns) or until renewing fails for ``renew_deadline`` (then raises ``LeadershipLost``).
    """

    def __init__(
        self,
        *,
        client: AsyncClient,
        name: str,
        namespace: str,
        identity: str,
        timing: LeaseTiming = LeaseTiming(),
    ) -> None:
        self._client = client
        self._name = name
        self._namespace = namespace
        self.identity = identity
        self._timing = timing
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._valid_until = 0.0
        self.leading = asyncio.Event()
        self.transitions_seen = 0

    @property
    def is_leader(self) -> bool:
        """True while this candidate leads and its last renew is younger than the renew deadline."""
        return self.leading.is_set() and time.monotonic() < self._valid_until

    async def run(self) -> None:
        timing = self._timing
        try:
            while not await self._attempt(timeout=timing.retry_period):
                await asyncio.sleep(timing.retry_period * random.uniform(1.0, 1.2))
            self.leading.set()
            log.info("became leader of lease %s/%s as %s", self._namespace, self._name, self.identity)
            while True:
                await asyncio.sleep(timing.retry_period)
                deadline = self._valid_until
                while not await self._attempt(timeout=max(0.05, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise LeadershipLost(
                            f"could not renew lease {self._namespace}/{self._name} within "
                            f"{timing.renew_deadline:g}s"
                        )
                    await asyncio.sleep(min(timing.retry_period, max(0.0, deadline - time.monotonic())))
        finally:
            was_leader = self.leading.is_set()
            self.leading.clear()
            self._valid_until = 0.0
            if was_leader:
                # Runs on cancellation too: a clean stop hands the lease over at once.
                await self._release()

    async def _attempt(self, *, timeout: float) -> bool:
        started = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that arrives
            # as the attempt completes, and the election loop would then never stop.
            async with asyncio.timeout(timeout):
                won = await self._try_acquire_or_renew()
        except (TimeoutError, KubeError, httpx2.HTTPError, OSError) as error:
            log.debug("lease %s/%s attempt failed: %s", self._namespace, self._name, error)
            return False
        if won:
            self._valid_until = started + self._timing.renew_deadline
        return won

    async def _try_acquire_or_renew(self) -> bool:
        now = datetime.now(UTC)
        duration = round(self._timing.lease_duration)
        try:
            with api_errors():
                lease = await self._client.get(Lease, self._name, namespace=self._namespace)
        except NotFound:
            fresh = Lease(
                metadata=ObjectMeta(name=self._name, namespace=self._namespace),
                spec=LeaseSpec(
                    holderIdentity=self.identity,
                    leaseDurationSeconds=duration,
                    acquireTime=now,
                    renewTime=now,
                    leaseTransitions=0,
                ),
            )
            try:
                with api_errors():
                    created = await self._client.create(fresh)
            except Conflict:
                return False
            self._observe(created.spec)
            return True

        spec = lease.spec or LeaseSpec()
        self._observe(spec)
        holder = spec.holderIdentity or ""
        if holder and holder != self.identity:
            held_for = float(spec.leaseDurationSeconds or self._timing.lease_duration)
            if time.monotonic() < self._observed_at + held_for:
                return False
        taking_over = holder != self.identity
        lease.spec = LeaseSpec(
            holderIdentity=self.identity,
            leaseDurationSeconds=duration,
            acquireTime=now if taking_over else (spec.acquireTime or now),
            renewTime=now,
            leaseTransitions=(spec.leaseTransitions or 0) + (1 if taking_over else 0),
        )
        try:
            with api_errors():
                updated = await self._client.replace(lease)
        except Conflict:
            return False
        if taking_over:
            self.transitions_seen += 1
        self._observe(updated.spec)
        return True

    def _observe(self, spec: LeaseSpec | None) -> None:
        spec = spec or LeaseSpec()
        record = (
            spec.holderIdentity,
            spec.renewTime,
            spec.acquireTime,
            spec.leaseTransitions,
            spec.leaseDurationSeconds,
        )
        if record != self._observed:
            self._observed = record
            self._observed_at = time.monotonic()

    async def _release(self) -> None:
        try:
            with api_errors():
                lease = await self._client.get(Lease, self._name, namespace=self._namespace)
                if lease.spec is None or lease.spec.holderIdentity != self.identity:
                    return
                now = datetime.now(UTC)
                lease.spec = LeaseSpec(
                    holderIdentity="",
                    leaseDurationSeconds=1,
                    acquireTime=now,
                    renewTime=now,
                    leaseTransitions=lease.spec.leaseTransitions,
                )
                await asyncio.wait_for(self._client.replace(lease), timeout=self._timing.retry_period)
            log.info("released lease %s/%s", self._namespace, self._name)
        except (TimeoutError, KubeError, httpx2.HTTPError, OSError) as error:
            log.warning("could not release lease %s/%s: %s", self._namespace, self._name, error)
