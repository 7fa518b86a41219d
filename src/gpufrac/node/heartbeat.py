"""The node agent's heartbeat: a Lease per node, renewed, instead of a Node write every minute.

The kubelet proves it is alive by renewing ``kube-node-lease/<node>``; the node agent does the same in
``keys.NODE_LEASE_NAMESPACE`` (``gpufrac-node-lease``). A renewal is a PUT of a small object that only
the scheduler and the operator watch, where re-writing the Node's condition made every Node watcher in
the cluster decode the whole Node again, for nothing that changed. The Node itself is written when what
it says changes (``InventoryPublisher``).

The Lease names the node as its holder and is owned by the Node (an ownerReference), so deleting a Node
lets the garbage collector take its Lease too. Each renewal is a PUT carrying the resourceVersion just
read; a conflict (someone else wrote it) is simply retried at the next period. The renewer never gives up:
a failed renewal is logged and retried, and the observers' expiry (``gpufrac.kube.heartbeat``) decides
what an agent that cannot renew means.

What the agent does not do is renew while it cannot do its job: ``alive`` is asked before each renewal
(the agent's event loop answering is the minimum; a hung loop renews nothing either).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime

import httpx2
from lightkube import AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, KubeError, NotFound, api_errors

log = logging.getLogger(__name__)


class NodeLease:
    """Renews ``<namespace>/<node>`` every ``renew_s`` until cancelled."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        node_name: str,
        renew_s: float,
        namespace: str = keys.NODE_LEASE_NAMESPACE,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self._client = client
        self._node = node_name
        self._renew_s = renew_s
        self._namespace = namespace
        self._alive = alive
        self.renewals = 0
        self.last_error: str | None = None

    @property
    def duration_s(self) -> int:
        """What the Lease says its holder promises (four renewals, as the kubelet's 10 s / 40 s)."""
        return max(1, math.ceil(4 * self._renew_s))

    async def run(self) -> None:
        while True:
            if self._alive():
                try:
                    await self.renew_once()
                except (KubeError, httpx2.HTTPError, OSError) as error:
                    if self.last_error != str(error):
                        log.warning(
                            "heartbeat: could not renew lease %s/%s: %s", self._namespace, self._node, error
                        )
                    self.last_error = str(error)
            await asyncio.sleep(self._renew_s)

    async def renew_once(self) -> Lease:
        now = datetime.now(UTC)
        try:
            with api_errors():
                lease = await self._client.get(Lease, self._node, namespace=self._namespace)
        except NotFound:
            created = await self._create(now)
            if created is not None:
                return created
            with api_errors():  # created by an earlier agent between the read and the create
                lease = await self._client.get(Lease, self._node, namespace=self._namespace)
        spec = lease.spec or LeaseSpec()
        lease.spec = LeaseSpec(
            holderIdentity=self._node,
            leaseDurationSeconds=self.duration_s,
            acquireTime=spec.acquireTime or now,
            renewTime=now,
            leaseTransitions=spec.leaseTransitions,
        )
        with api_errors():
            renewed = await self._client.replace(lease)
        self._renewed()
        return renewed

    async def _create(self, now: datetime) -> Lease | None:
        owner: list[OwnerReference] | None = None
        with contextlib.suppress(NotFound), api_errors():
            node = await self._client.get(Node, self._node)
            if node.metadata is not None and node.metadata.uid:
                owner = [OwnerReference(apiVersion="v1", kind="Node", name=self._node, uid=node.metadata.uid)]
        fresh = Lease(
            metadata=ObjectMeta(name=self._node, namespace=self._namespace, ownerReferences=owner),
            spec=LeaseSpec(
                holderIdentity=self._node,
                leaseDurationSeconds=self.duration_s,
                acquireTime=now,
                renewTime=now,
            ),
        )
        try:
            with api_errors():
                created = await self._client.create(fresh)
        except Conflict as error:
            if error.already_exists:
                return None
            raise
        self._renewed()
        return created

    def _renewed(self) -> None:
        if self.last_error is not None:
            log.info("heartbeat: lease %s/%s renewed again", self._namespace, self._node)
        self.last_error = None
        self.renewals += 1
