"""How long the node agent takes to show a failure mode on its Node, at its production intervals.

Runs the REAL inventory publisher (publish every 5 s, GPU stack gate refreshed every 60 s) against the
embedded control plane, with SIMULATED GPUs and a ClusterPolicy written as the GPU Operator writes it,
and measures from the change to the moment the scheduler's reading of the Node (``node_spec``) changes:

- the agent starts on a node whose toolkit is too old: GPUOperandVersionUnsupported (its first publish);
- the GPU Operator upgrades the toolkit: Ready again (bounded by the gate's 60 s refresh);
- a fatal XID on a GPU: the GPU withdrawn (bounded by the 5 s publish interval);
- a GPU falls off the bus: withdrawn;
- the GPU Operator's ClusterPolicy turns notReady: GPUOperatorNotReady (bounded by the gate's refresh).

The baseline in the same run is one forced publish with nothing changed (a read and write round trip).
Last line: a JSON summary. About 2 minutes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from lightkube import AsyncClient
from lightkube.models.core_v1 import NodeCondition, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.node.gpustack import ClusterPolicy, GpuStackGate, GpuStackSettings
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, simulated_uuid
from gpufrac.node.mps.mode import capability_for
from gpufrac.scheduler.objects import node_spec

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterpolicies.nvidia.com"},
    "spec": {
        "group": "nvidia.com",
        "scope": "Cluster",
        "names": {"plural": "clusterpolicies", "singular": "clusterpolicy", "kind": "ClusterPolicy"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def _policy(toolkit: str) -> dict[str, object]:
    return {
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": {"toolkit": {"version": toolkit}, "devicePlugin": {"version": "v0.20.1"}},
    }


async def write_policy(client: AsyncClient, toolkit: str, *, state: str = "ready") -> None:
    """The ClusterPolicy with ``toolkit`` and ``state`` (one not ready gates the node on its own)."""
    await client.apply(ClusterPolicy.from_dict(_policy(toolkit)), field_manager="bench", force=True)
    status = {**_policy(toolkit), "status": {"state": state}}
    await client.apply(ClusterPolicy.Status.from_dict(status), field_manager="bench", force=True)


async def timed(check) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await check():
        await asyncio.sleep(0.05)
    return round(time.monotonic() - start, 2)


async def main(cp: ControlPlane) -> dict[str, float]:
    client = cp.async_client()
    await client.apply(CustomResourceDefinition.from_dict(CRD), field_manager="bench", force=True)
    await asyncio.sleep(2)  # the CRD becomes Established
    await write_policy(client, "v1.17.8")
    name = f"bench-{uuid.uuid4().hex[:6]}"
    await client.create(Node(metadata=ObjectMeta(name=name)))
    await client.patch(
        Node.Status,
        name,
        {"status": NodeStatus(conditions=[NodeCondition(type="Ready", status="True")]).to_dict()},
    )
    backend = SimulatedInventory(node_name=name, spec=parse_flag("2xH100-80GB"))
    publisher = InventoryPublisher(
        client=client,
        node_name=name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        taint=False,
        stack_gate=GpuStackGate(client=client, node_name=name, settings=GpuStackSettings()),
    )

    async def reason() -> str | None:
        node = await client.get(Node, name)
        return next(
            (c.reason for c in node.status.conditions or [] if c.type == keys.NODE_READY_CONDITION), None
        )

    async def offered() -> list[str]:
        return [g.uuid for g in node_spec(await client.get(Node, name)).gpus]

    # The agent's first publish already carries the gate's verdict: its duration is the detection at start.
    started = time.monotonic()
    await publisher.publish_once(force=True)
    result = {"gate_at_start_s": round(time.monotonic() - started, 2)}
    assert await reason() == "GPUOperandVersionUnsupported"
    started = time.monotonic()
    await publisher.publish_once(force=True)
    result["baseline_publish_s"] = round(time.monotonic() - started, 2)  # nothing changed: a write round trip
    task = asyncio.create_task(publisher.run())
    await write_policy(client, "v1.20.1")
    result["gate_after_upgrade_s"] = await timed(lambda: _is(reason(), keys.NODE_REASON_READY))
    backend.set_xid(0, 48)
    result["xid_s"] = await timed(lambda: _is(offered(), [simulated_uuid(name, 1)]))
    backend.reset_gpu(0)
    await timed(lambda: _is(offered(), [simulated_uuid(name, 0), simulated_uuid(name, 1)]))
    backend.set_lost(1)
    result["off_the_bus_s"] = await timed(lambda: _is(offered(), [simulated_uuid(name, 0)]))
    await write_policy(client, "v1.20.1", state="notReady")
    result["operator_not_ready_s"] = await timed(
        lambda: _is(reason(), keys.NODE_REASON_GPU_OPERATOR_NOT_READY)
    )
    task.cancel()
    await client.delete(ClusterPolicy, "cluster-policy")
    return result


async def _is(got, expected) -> bool:  # type: ignore[no-untyped-def]
    return await got == expected


if __name__ == "__main__":
    with ControlPlane() as plane:
        summary = asyncio.run(main(plane))
    print("intervals: publish 5 s, gate refresh 60 s")
    print(json.dumps(summary))
