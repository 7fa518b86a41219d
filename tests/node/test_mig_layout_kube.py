"""MIG layout changes on a real API server: the scheduler's half (``gpufrac.io/gpu-layout`` on the Node)
written, the node agent (SIMULATED GPUs and MIG control) changes its idle GPUs and its half says so: the new
slices in ``gpufrac.io/gpus`` by the time ``gpufrac.io/gpu-layout-status`` says Applied."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.kube.patch import merge_patch
from gpufrac.node.agent import NodeAgent
from gpufrac.node.config import load_settings
from gpufrac.node.inventory.simulated import simulated_uuid
from gpufrac.node.mapping import AllocationRecord

LAYOUT = ["3g.40gb@0", "2g.20gb@4", "1g.10gb@6"]


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await akube.create(Node(metadata=ObjectMeta(name=name)))
    yield name
    await akube.delete(Node, name)


async def annotations(akube: AsyncClient, node: str) -> dict[str, Any]:
    got = await akube.get(Node, node)
    raw = (got.metadata.annotations if got.metadata else None) or {}
    return {k: json.loads(v) for k, v in raw.items() if k.startswith("gpufrac.io/")}


async def status_of(akube: AsyncClient, node: str, generation: int) -> dict[str, Any]:
    """Both annotations from one read of the Node, once the status is of ``generation`` and settled."""
    deadline = time.monotonic() + 30
    while True:
        seen = await annotations(akube, node)
        status = seen.get(keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION) or {}
        states = {g["state"] for g in status.get("gpus", {}).values()}
        if status.get("generation") == generation and states and "Pending" not in states:
            return seen
        assert time.monotonic() < deadline, f"no settled status of generation {generation}: {status}"
        await asyncio.sleep(0.05)


async def test_a_layout_written_on_the_node_is_applied_and_published_before_it_says_applied(
    akube: AsyncClient, node_name: str, tmp_path: Path
) -> None:
    settings = load_settings(
        None,
        node_name=node_name,
        backend="simulated",
        sim_gpus="2xA100-80GB",
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        publish_interval_s=0.2,
        taint=False,
        mig={"allow_gpu_reset": True},
    )
    agent = NodeAgent(settings=settings, client=akube)
    assert agent.publisher is not None and agent.layouts is not None
    assert agent.recorder is not None and agent.upgrades is not None
    tasks = [
        asyncio.create_task(agent.publisher.run()),
        asyncio.create_task(agent.upgrades.run()),  # the own-node informer the executor reads the Node from
        asyncio.create_task(agent.layouts.run()),
        asyncio.create_task(agent.recorder.run()),
    ]
    gpu0, gpu1 = simulated_uuid(node_name, 0), simulated_uuid(node_name, 1)
    try:
        layout = {"generation": 7, "gpus": {gpu0: {"mode": "mig", "slices": LAYOUT}, gpu1: {"mode": "whole"}}}
        await merge_patch(
            akube,
            Node,
            name=node_name,
            patch={"metadata": {"annotations": {keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(layout)}}},
        )
        seen = await status_of(akube, node_name, 7)
        status = seen[keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION]
        assert status["gpus"] == {
            gpu0: {"state": "Applied", "message": "mig: 3g.40gb@0, 2g.20gb@4, 1g.10gb@6"},
            gpu1: {"state": "Applied", "message": "whole"},
        }
        # In the same read of the Node as Applied: the inventory already shows the change.
        first, second = seen[keys.NODE_GPUS_ANNOTATION]
        assert (first["mode"], second["mode"]) == ("mig", "whole")
        assert [f"{s['profile']}@{s['start']}" for s in first["mig"]] == LAYOUT
        assert all(s["uuid"].startswith("MIG-") for s in first["mig"])

        # The agent took the new slices when it published them: a container the scheduler binds to one
        # right after Applied is created on it, not refused as "not in this node's GPU inventory" until
        # the agent's next inventory pass (that loop does not even run here).
        new_slice = first["mig"][2]["uuid"]
        pod = api.PodSandbox(
            id="sb-1",
            name="isolated-1",
            namespace="team-a",
            uid="uid-2",
            annotations={
                keys.mig_key("cuda", keys.MIG_PROFILE): "1g.10gb",
                keys.devices_key("cuda"): new_slice,
            },
        )
        cuda = api.Container(id="d" * 64, pod_sandbox_id="sb-1", name="cuda")
        await agent.injector.create_container(pod=pod, container=cuda)
        assert agent.store.get("d" * 64) is not None
        await agent.injector.remove_container(pod=pod, container=cuda)

        # A slice the model cannot hold: that GPU is refused, named with the key, the value and the rule.
        bad = {"generation": 8, "gpus": {gpu0: {"mode": "mig", "slices": ["3g.40gb@2"]}}}
        await merge_patch(
            akube,
            Node,
            name=node_name,
            patch={"metadata": {"annotations": {keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(bad)}}},
        )
        seen = await status_of(akube, node_name, 8)
        refused = seen[keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION]["gpus"][gpu0]
        assert refused["state"] == "Refused"
        assert refused["message"].startswith(
            f'gpufrac.io/gpu-layout gpus["{gpu0}"].slices=["3g.40gb@2"] is invalid'
        )
        assert "valid starts: 0, 4" in refused["message"]
        assert len(seen[keys.NODE_GPUS_ANNOTATION][0]["mig"]) == 3  # untouched

        # A container on one of GPU 0's slices: GPU 0 is not idle, its change is Refused naming it, and
        # the passes that follow (every 0.2 s) leave the Node alone: no Pending/Refused flapping.
        slice_uuid = seen[keys.NODE_GPUS_ANNOTATION][0]["mig"][0]["uuid"]
        agent.store.put(
            AllocationRecord(
                container_id="c" * 64,
                pod_namespace="team-a",
                pod_name="isolated-0",
                pod_uid="uid-1",
                container_name="cuda",
                devices=(f"nvidia.com/gpu={slice_uuid}",),
                request_mib=40192,
                limit_mib=40192,
                mode="mig",
                portion=None,
            )
        )
        back = {"generation": 9, "gpus": {gpu0: {"mode": "fractions"}}}
        await merge_patch(
            akube,
            Node,
            name=node_name,
            patch={"metadata": {"annotations": {keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(back)}}},
        )
        seen = await status_of(akube, node_name, 9)
        busy = seen[keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION]["gpus"][gpu0]
        assert busy["state"] == "Refused" and "team-a/isolated-0/cuda" in busy["message"]
        version = (await akube.get(Node, node_name)).metadata.resourceVersion  # type: ignore[union-attr]
        await asyncio.sleep(1.0)
        assert (await akube.get(Node, node_name)).metadata.resourceVersion == version  # type: ignore[union-attr]
        agent.store.remove("c" * 64)  # the pod is gone: the next pass changes the GPU
        seen = await status_of(akube, node_name, 9)
        deadline = time.monotonic() + 10
        while seen[keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION]["gpus"][gpu0]["state"] != "Applied":
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.05)
            seen = await status_of(akube, node_name, 9)
        assert seen[keys.NODE_GPUS_ANNOTATION][0]["mode"] == "fractions"

        # kubectl describe node tells the same: an Event per outcome.
        async def reasons() -> set[str]:
            return {
                e.reason or ""
                async for e in akube.list(Event, namespace="default")
                if e.involvedObject.name == node_name
            }

        deadline = time.monotonic() + 10
        while not {"GpuLayoutApplied", "GpuLayoutRefused"} <= await reasons():
            assert time.monotonic() < deadline, await reasons()
            await asyncio.sleep(0.1)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        agent.store.close()
