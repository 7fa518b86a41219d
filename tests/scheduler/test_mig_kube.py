"""MIG slices through the scheduler on the real API server (docs/mig.md): a MIG pod is bound to a free
slice of its profile with the slice's MIG UUID as its device and no memory keys, a fraction never lands on
a MIG GPU, and with dynamic layouts a waiting 3g pod makes the scheduler ask a node for an idle GPU laid
out for it, book nothing there meanwhile, and bind the pod once the node (here the test, as its agent)
publishes the slice."""

from __future__ import annotations

import json

import pytest
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node
from sched_harness import (
    Pool,
    add_nodes,
    audit_pool,
    condition,
    gpu_pod,
    metric,
    nodes_of,
    pods_of,
    running,
    scrape,
    wait_bound,
    wait_for,
)

from gpufrac.contract import keys
from gpufrac.kube.patch import set_annotations
from gpufrac.local.simnodes import NodeShape, mig_layout
from gpufrac.mig.geometry import Slice
from gpufrac.node.inventory.simulated import simulated_mig_uuid
from gpufrac.placement.model import GpuMode
from gpufrac.scheduler.objects import node_inventory

pytestmark = pytest.mark.kube

MIG_3G = {keys.mig_key("app", keys.MIG_PROFILE): "3g.40gb"}
FRACTION = {keys.memory_request_key("app"): "10Gi"}


async def _waiting_message(client: AsyncClient, pool: Pool, name: str, says: str) -> str:
    found = ""

    async def reported() -> bool:
        nonlocal found
        pods = {p.metadata.name: p for p in await pods_of(client, pool.namespace)}
        found = condition(pods[name])[2] or "" if name in pods else ""
        return says in found

    await wait_for(reported, timeout=20, what=f"{name} saying {says!r}")
    return found


async def test_mig_pods_take_free_slices_and_fractions_stay_off_the_mig_gpu(
    client: AsyncClient, pool: Pool
) -> None:
    shape = NodeShape(gpus=2, mig=((0, ("3g.40gb@0", "3g.40gb@4")),))
    await add_nodes(client, pool, count=1, shape=shape)
    async with running(client, pool.config(mig={"dynamic": False})) as service:
        for name in ("a", "b"):
            await client.create(gpu_pod(pool, name, MIG_3G))
        await client.create(gpu_pod(pool, "f", FRACTION))
        pods = {p.metadata.name: p for p in await wait_bound(client, pool.namespace, 3, timeout=30)}
        (node,) = await nodes_of(client, pool)
        mig_gpu, fraction_gpu = node_inventory(node)
        assert mig_gpu.mode is GpuMode.MIG and fraction_gpu.mode is GpuMode.FRACTIONS
        held = {pods[n].metadata.annotations[keys.devices_key("app")] for n in ("a", "b")}
        assert held == {s.uuid for s in mig_gpu.mig}  # each its own slice, by MIG UUID
        for n in ("a", "b"):
            assert keys.memory_request_key("app") not in pods[n].metadata.annotations
            assert keys.memory_limit_key("app") not in pods[n].metadata.annotations
        assert pods["f"].metadata.annotations[keys.devices_key("app")] == fraction_gpu.uuid

        await client.create(gpu_pod(pool, "c", MIG_3G))
        message = await _waiting_message(client, pool, "c", "MIG slice")
        assert "1 node(s) had no free MIG slice of 3g.40gb" in message
        report = await audit_pool(client, pool)
        assert report.ok, report.problems
        assert report.gpus[mig_gpu.uuid].slice_mib == 2 * 40448
        text = await scrape(service.probe_port)
        name = node.metadata.name
        assert (
            metric(text, "gpufrac_scheduler_gpu_memory_allocated_mib", node=name, gpu=mig_gpu.uuid)
            == 2 * 40448
        )


async def test_a_waiting_3g_pod_gets_an_idle_gpu_re_partitioned_and_binds_to_the_new_slice(
    client: AsyncClient, pool: Pool
) -> None:
    (name,) = await add_nodes(client, pool, count=1, shape=NodeShape(gpus=2))
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "f0", FRACTION))
        (f0,) = await wait_bound(client, pool.namespace, 1, timeout=30)
        busy = f0.metadata.annotations[keys.devices_key("app")]

        await client.create(gpu_pod(pool, "m", MIG_3G))
        asked: dict = {}

        async def layout_asked() -> bool:
            nonlocal asked
            node = await client.get(Node, name)
            asked = json.loads((node.metadata.annotations or {}).get(keys.NODE_GPU_LAYOUT_ANNOTATION) or "{}")
            return bool(asked)

        await wait_for(layout_asked, timeout=20, what="a layout request on the node")
        assert asked["generation"] == 1
        ((idle, wanted),) = asked["gpus"].items()
        assert idle != busy  # never a GPU with a booking
        # Its 3g.40gb, and the rest of the GPU filled (mig.fill) in the mix asked: another 3g.40gb.
        assert (
            wanted["mode"] == "mig" and [Slice.parse(s).profile for s in wanted["slices"]] == ["3g.40gb"] * 2
        )
        message = await _waiting_message(client, pool, "m", "re-partitioned")
        laid_out = ", ".join(wanted["slices"])
        assert message == f"waiting for node {name}'s GPU {idle} to be re-partitioned to {laid_out}"

        # While the change is pending nothing is booked on that GPU.
        await client.create(gpu_pod(pool, "f1", FRACTION))
        bound = {p.metadata.name: p for p in await wait_bound(client, pool.namespace, 2, timeout=30)}
        assert bound["f1"].metadata.annotations[keys.devices_key("app")] == busy

        # The node agent's answer: the GPU published in mode mig with its slice, and the status.
        node = await client.get(Node, name)
        entries = json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
        entries = [mig_layout(e, tuple(wanted["slices"])) if e["uuid"] == idle else e for e in entries]
        status = {"generation": 1, "gpus": {idle: {"state": "Applied", "message": ""}}}
        await set_annotations(
            client,
            Node,
            name=name,
            annotations={
                keys.NODE_GPUS_ANNOTATION: json.dumps(entries),
                keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION: json.dumps(status),
            },
        )
        pods = {p.metadata.name: p for p in await wait_bound(client, pool.namespace, 3, timeout=30)}
        slice_uuids = {simulated_mig_uuid(idle, Slice.parse(s)) for s in wanted["slices"]}
        assert pods["m"].metadata.annotations[keys.devices_key("app")] in slice_uuids
        report = await audit_pool(client, pool)
        assert report.ok, report.problems


async def test_a_layout_change_found_pending_at_start_fences_its_gpu_until_the_agent_refuses_it(
    client: AsyncClient, pool: Pool
) -> None:
    (name,) = await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1, mig=((0, ("7g.80gb@0",)),)))
    node = await client.get(Node, name)
    (gpu,) = node_inventory(node)
    pending = {"generation": 3, "gpus": {gpu.uuid: {"mode": "fractions"}}}
    await set_annotations(
        client, Node, name=name, annotations={keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(pending)}
    )
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "m", {keys.mig_key("app", keys.MIG_PROFILE): "7g.80gb"}))
        message = await _waiting_message(client, pool, "m", "MIG")
        assert "1 node(s) had no free MIG slice of 7g.80gb" in message  # the slice is free, its GPU fenced
        refused = {"generation": 3, "gpus": {gpu.uuid: {"state": "Refused", "message": "pods on it"}}}
        await set_annotations(
            client, Node, name=name, annotations={keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION: json.dumps(refused)}
        )
        (m,) = await wait_bound(client, pool.namespace, 1, timeout=30)
        assert m.metadata.annotations[keys.devices_key("app")] == gpu.mig[0].uuid


async def test_a_fraction_no_pool_holds_gets_an_idle_mig_gpu_back_to_fractions(
    client: AsyncClient, pool: Pool
) -> None:
    (name,) = await add_nodes(
        client, pool, count=1, shape=NodeShape(gpus=1, mig=((0, ("3g.40gb@0", "3g.40gb@4")),))
    )
    async with running(client, pool.config()):
        await client.create(gpu_pod(pool, "f", FRACTION))
        message = await _waiting_message(client, pool, "f", "re-partitioned")
        node = await client.get(Node, name)
        (gpu,) = node_inventory(node)
        assert message == f"waiting for node {name}'s GPU {gpu.uuid} to be re-partitioned to fractions"
        asked = json.loads(node.metadata.annotations[keys.NODE_GPU_LAYOUT_ANNOTATION])
        assert asked == {"generation": 1, "gpus": {gpu.uuid: {"mode": "fractions"}}}
        entries = [
            mig_layout(e, None) for e in json.loads(node.metadata.annotations[keys.NODE_GPUS_ANNOTATION])
        ]
        await set_annotations(
            client, Node, name=name, annotations={keys.NODE_GPUS_ANNOTATION: json.dumps(entries)}
        )
        (f,) = await wait_bound(client, pool.namespace, 1, timeout=30)
        assert f.metadata.annotations[keys.devices_key("app")] == gpu.uuid
