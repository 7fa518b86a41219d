"""Nodes whose agent fell silent: their readiness condition marked Unknown, as the node lifecycle
controller marks a silent kubelet's node.

A node agent that is OOM-killed, SIGKILLed or hung cannot say so: its Node keeps the last thing it
wrote, usually ``gpu-fractioning.nvidia.com/Ready=True``. The scheduler already stops placing there once
the agent's heartbeat (its Lease, ``gpufrac.kube.heartbeat``) expires, but a person reading the Node, an
alert on the condition, or another scheduler that reads only the condition (KAI Scheduler) sees True. So
the operator, which watches every node agent's Lease anyway, writes what it knows: status ``Unknown``,
reason ``NodeAgentHeartbeatExpired``, and since when the agent has been silent. The agent overwrites it
with its own word as soon as it publishes again (that reason is gpufrac's, so the agent does not take it
for another node stack).

Only nodes whose condition carries one of gpufrac's reasons are touched (another node stack's condition
is its own), only on managed nodes, only by the leader, and only once per silence (a condition already
Unknown is not written again). The expiry is the operator's ``node_heartbeat_expiry_s``, judged on the
operator's own clock, as the scheduler judges it.
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
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, api_errors
from gpufrac.kube.heartbeat import AgentHeartbeats, latest_heartbeat, lease_renewed
from gpufrac.kube.informer import Informer

log = logging.getLogger(__name__)


def _agent_condition(node: Node) -> Any | None:
    for c in (node.status.conditions if node.status else None) or []:
        if c.type == keys.NODE_READY_CONDITION:
            return c
    return None


def _condition_heartbeat(node: Node) -> datetime | None:
    c = _agent_condition(node)
    stamp = c.lastHeartbeatTime if c is not None else None
    if stamp is None:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


class SilentAgents:
    """Marks managed nodes Unknown while their agents' heartbeats are expired; run as a task."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        nodes: Informer[Node],
        leases: Informer[Lease],
        expiry_s: float,
        is_leader: Callable[[], bool],
    ) -> None:
        self._client = client
        self._nodes = nodes
        self._leases = leases
        self._is_leader = is_leader
        self.heartbeats = AgentHeartbeats(expiry_s=expiry_s)
        self._wake = asyncio.Event()
        self.marked = 0  # conditions set Unknown
        self.left_alone = 0  # expired nodes whose condition another node stack writes

    def changed(self) -> None:
        """A Node or a Lease changed: look again."""
        self._wake.set()

    def _observe(self, node: Node, *, now: float, wall_now: datetime) -> None:
        name = node.metadata.name
        lease = self._leases.store.get(f"{keys.NODE_LEASE_NAMESPACE}/{name}")
        stamp = latest_heartbeat(
            lease_renewed(lease) if lease is not None else None, _condition_heartbeat(node)
        )
        self.heartbeats.observe(name, stamp, now=now, wall_now=wall_now)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        await self._nodes.synced.wait()
        await self._leases.synced.wait()
        while True:
            self._wake.clear()
            now, wall_now = loop.time(), datetime.now(UTC)
            for node in self._nodes.store:
                if (node.metadata.labels or {}).get(keys.MANAGED_LABEL) != "true":
                    continue
                self._observe(node, now=now, wall_now=wall_now)
                if self.heartbeats.expired(node.metadata.name, now=now) and self._is_leader():
                    try:
                        await self._mark_unknown(node)
                    except KubeError as error:
                        log.warning("could not mark node %s Unknown: %s", node.metadata.name, error)
            due = self.heartbeats.next_expiry(now=loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(None if due is None else due):
                    await self._wake.wait()

    async def _mark_unknown(self, node: Node) -> None:
        condition = _agent_condition(node)
        if condition is None or condition.status == "Unknown":
            return
        if condition.reason not in keys.NODE_AGENT_REASONS:
            self.left_alone += 1  # another node stack's condition: not ours to judge
            return
        name = node.metadata.name
        last = self.heartbeats.last_seen(name)
        since = last.strftime("%Y-%m-%dT%H:%M:%SZ") if last is not None else "never"
        expiry = self.heartbeats.expiry_s or math.inf
        patch = {
            "status": {
                "conditions": [
                    {
                        "type": keys.NODE_READY_CONDITION,
                        "status": "Unknown",
                        "reason": keys.NODE_REASON_AGENT_HEARTBEAT_EXPIRED,
                        "message": (
                            f"the gpufrac node agent has not renewed its Lease since {since} (expiry "
                            f"{expiry:g}s): it was killed, hangs or cannot reach the API server; it last "
                            f"said {condition.status} ({condition.reason}); no new GPU pods are placed here"
                        ),
                        "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    }
                ]
            }
        }
        with api_errors():
            await self._client.patch(Node.Status, name, patch, patch_type=PatchType.STRATEGIC)
        self.marked += 1
        log.warning("node %s: its agent fell silent (last heartbeat %s); marked Unknown", name, since)
