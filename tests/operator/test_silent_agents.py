"""A node whose agent fell silent is marked Unknown by the operator (real API server).

The agent is OOM-killed: its Node still says ``gpu-fractioning.nvidia.com/Ready=True``, which a person,
an alert or another scheduler reads as "fine". Its Lease stops moving; the operator writes Unknown with
the reason, and the scheduler (which needs True) places nothing there either.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from gfc_harness import eventually, running
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node
from lightkube.types import PatchType

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, api_errors
from gpufrac.node.heartbeat import NodeLease
from gpufrac.scheduler.objects import node_spec


@pytest.fixture
async def agent_node(akube: AsyncClient, tag: str) -> AsyncIterator[str]:
    """A managed node whose agent said Ready just now; the node Leases' namespace exists."""
    with contextlib.suppress(Conflict), api_errors():
        await akube.create(Namespace(metadata=ObjectMeta(name=keys.NODE_LEASE_NAMESPACE)))
    name = f"silent-{tag}"
    await akube.create(Node(metadata=ObjectMeta(name=name, labels={keys.MANAGED_LABEL: "true"})))
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": keys.NODE_READY_CONDITION,
        "status": "True",
        "reason": keys.NODE_REASON_READY,
        "message": "1 GPU(s)",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    await akube.patch(
        Node.Status, name, {"status": {"conditions": [condition]}}, patch_type=PatchType.STRATEGIC
    )
    yield name
    await akube.delete(Node, name)


def agent_condition(node: Node) -> tuple[str, str]:
    (c,) = [c for c in node.status.conditions or [] if c.type == keys.NODE_READY_CONDITION]
    return c.status, c.reason


async def test_the_operator_marks_a_silent_agents_node_unknown(akube: AsyncClient, agent_node: str) -> None:
    renewer = NodeLease(client=akube, node_name=agent_node, renew_s=0.5)
    renewing = asyncio.create_task(renewer.run())
    try:
        async with running(akube, node_heartbeat_expiry_s=3) as op:
            while renewer.renewals < 8:  # four seconds of renewals: past the expiry, still True
                await asyncio.sleep(0.1)
            assert agent_condition(await akube.get(Node, agent_node)) == ("True", keys.NODE_REASON_READY)
            assert op.operator.silent_agents.marked == 0

            renewing.cancel()  # OOM-killed
            await asyncio.gather(renewing, return_exceptions=True)
            stopped = time.monotonic()

            async def unknown() -> Node | None:
                node = await akube.get(Node, agent_node)
                return node if agent_condition(node)[0] == "Unknown" else None

            node = await eventually(unknown, timeout=20, what="the condition Unknown")
            print(f"silent agent marked Unknown {time.monotonic() - stopped:.1f}s after its last renewal")
            assert agent_condition(node) == ("Unknown", keys.NODE_REASON_AGENT_HEARTBEAT_EXPIRED)
            # The scheduler needs True: an Unknown node is not placeable, whatever its Lease says later.
            assert not node_spec(node).ready
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)


async def test_another_node_stacks_condition_is_left_alone(akube: AsyncClient, agent_node: str) -> None:
    await akube.patch(
        Node.Status,
        agent_node,
        {"status": {"conditions": [{"type": keys.NODE_READY_CONDITION, "reason": "FractiondReady"}]}},
        patch_type=PatchType.STRATEGIC,
    )
    async with running(akube, node_heartbeat_expiry_s=1) as op:
        # Expired within a second (no Lease): wait until the operator judged it, then see it wrote nothing.
        async def judged() -> bool:
            return op.operator.silent_agents.left_alone > 0

        await eventually(judged, timeout=20, what="the node judged and left alone")
        assert agent_condition(await akube.get(Node, agent_node)) == ("True", "FractiondReady")
        assert op.operator.silent_agents.marked == 0
