"""Node watching for the scheduler: managed Nodes, the node agents' Leases, heartbeat expiry, and every
other node as a topology domain.

Three informers feed the booking cache's nodes. Managed nodes (``node_selector``) are read whole
(``objects.node_spec``); every node is also read narrowly (``objects.NodeTopology``: labels and taints),
so that the nodes gpufrac does not manage are topology domains for affinity and spread, as
kube-scheduler counts them. A node that stops being managed (its label went) but still exists becomes a
topology domain again.

Node agents prove they are alive by renewing their node's Lease in ``node_lease_namespace`` (a
heartbeat; the node's agent condition counts too, the newer wins, ``gpufrac.kube.heartbeat``). A node
whose heartbeat is older than ``node_heartbeat_expiry_s`` takes no new pods. An expiry is time passing,
not an API event, so ``run`` re-evaluates nodes as their heartbeats expire, sleeping until the next
one is due (woken early when a newly observed heartbeat expires sooner); a heartbeat that resumes is a
Lease (or Node) update like any other.

``NodeWatch`` receives its collaborators: the booking cache it writes nodes into, ``changed``, called
whenever a node change may let a waiting pod fit (the service wakes its parked pods), and ``observe``,
shown every managed node update (the MIG layout changes, ``mig_layouts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node

from gpufrac.kube.heartbeat import AgentHeartbeats, latest_heartbeat, lease_renewed
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection
from gpufrac.process.controller import Handler
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.objects import NodeTopology, agent_heartbeat, node_spec, topology_node_spec

log = logging.getLogger(__name__)


class NodeWatch:
    """See the module docstring. ``informers`` go to the controller runner; ``run`` is a background task."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        cache: BookingCache,
        changed: Callable[[], None],
        node_selector: str | None,
        lease_namespace: str,
        heartbeat_expiry_s: float | None,
        observe: Callable[[Node], None] | None = None,
    ) -> None:
        self._cache = cache
        self._observe = observe
        self._changed = changed
        self._lease_namespace = lease_namespace
        self.nodes: Informer[Node] = Informer(
            client=client, resource=Node, selection=Selection(labels=node_selector), name="nodes"
        )
        self.topology_nodes: Informer[NodeTopology] = Informer(
            client=client, resource=NodeTopology, name="topology-nodes"
        )
        self.leases: Informer[Lease] = Informer(
            client=client, resource=Lease, selection=Selection(namespace=lease_namespace), name="node-leases"
        )
        self.nodes.add_handler(Handler(changed=self._node_changed, deleted=self._node_deleted))
        self.topology_nodes.add_handler(
            Handler(changed=self._topology_node_changed, deleted=self._topology_node_deleted)
        )
        self.leases.add_handler(Handler(changed=self._lease_changed, deleted=self._lease_deleted))
        self._heartbeats = AgentHeartbeats(expiry_s=heartbeat_expiry_s)
        self._wake = asyncio.Event()
        self._due = math.inf

    @property
    def informers(self) -> tuple[Informer[Any], ...]:
        return (self.nodes, self.topology_nodes, self.leases)

    def expired_count(self) -> int:
        """Managed nodes whose agent's heartbeat has expired (a metric)."""
        return sum(1 for spec in self._cache.nodes.values() if spec.agent_heartbeat_expired)

    async def run(self) -> None:
        """Re-evaluate nodes when their agents' heartbeats expire: time passing is no API event."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for name, spec in list(self._cache.nodes.items()):
                if spec.agent_heartbeat_expired != self._heartbeats.expired(name, now=now):
                    node = self.nodes.store.get(name)
                    if node is not None:
                        self._set_node(node, now=now)
            due = self._heartbeats.next_expiry(now=now)
            self._due = math.inf if due is None else due
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(None if due is None else due):
                    await self._wake.wait()

    # -- informer handlers (synchronous: memory only) -----------------------------------------------------

    def _node_changed(self, old: Node | None, node: Node) -> None:
        """The node's heartbeat (its Lease's or its condition's, the newer) observed; the node re-set."""
        loop = asyncio.get_running_loop()
        name = node.metadata.name
        lease = self.leases.store.get(f"{self._lease_namespace}/{name}")
        stamp = latest_heartbeat(lease_renewed(lease) if lease is not None else None, agent_heartbeat(node))
        expires = self._heartbeats.observe(name, stamp, now=loop.time(), wall_now=datetime.now(UTC))
        if expires < self._due:
            self._wake.set()
        self._set_node(node, now=loop.time())
        if self._observe is not None:
            self._observe(node)  # after the books took the node's new GPUs (MIG layout changes)

    def _lease_changed(self, old: Lease | None, lease: Lease) -> None:
        node = self.nodes.store.get(lease.metadata.name)
        if node is not None:
            self._node_changed(None, node)

    def _lease_deleted(self, lease: Lease) -> None:
        self._lease_changed(None, lease)

    def _set_node(self, node: Node, *, now: float) -> None:
        name = node.metadata.name
        expired = self._heartbeats.expired(name, now=now)
        spec = node_spec(node, agent_heartbeat_expired=expired)
        previous = self._cache.nodes.get(name)
        if expired and (previous is None or not previous.agent_heartbeat_expired):
            log.warning(
                "node %s: the node agent's heartbeat expired (last %s, expiry %.0fs); no new pods go there "
                "until it resumes",
                name,
                self._heartbeats.last_seen(name) or "never",
                self._heartbeats.expiry_s,
                extra={"node": name},
            )
        elif previous is not None and previous.agent_heartbeat_expired and not expired:
            log.info("node %s: the node agent's heartbeat resumed", name, extra={"node": name})
        if self._cache.set_node(spec).changed:
            self._changed()

    def _node_deleted(self, node: Node) -> None:
        name = node.metadata.name
        self._heartbeats.forget(name)
        self._cache.remove_node(name)
        # No longer managed (its label went) but still a node: a topology domain from now on.
        still = self.topology_nodes.store.get(name)
        if still is not None and self._cache.set_topology_node(topology_node_spec(still)):
            self._changed()

    def _topology_node_changed(self, old: NodeTopology | None, node: NodeTopology) -> None:
        # A managed node is the managed informer's (the cache ignores it here); one that has just become
        # managed is dropped as a topology node when that informer adds it.
        if self._cache.set_topology_node(topology_node_spec(node)):
            self._changed()

    def _topology_node_deleted(self, node: NodeTopology) -> None:
        if self._cache.remove_topology_node(node.metadata.name):
            self._changed()


__all__ = ["NodeWatch"]
