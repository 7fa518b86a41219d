"""A live resize through a REAL API server: the node agent's watch of its node's pods sees the scheduler's
patch of a bound pod's amounts, sets them on the running container's cgroup (SIMULATED driver), and the
pod's ``gpufrac.io/GpuResizeInProgress`` condition says what holds, then goes away.

The scheduler's patch is played by an admin merge patch of the binder-written annotations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType
from test_node_resize import CGROUP, CID, agent, binding, record, started

from gpufrac.node.resize import REASON_WAITING_FOR_USAGE, RESIZE_CONDITION, PodResizeWatch

pytestmark = pytest.mark.kube


async def until(check: Callable[[], Any], *, what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_patched_binding_is_applied_live_and_the_condition_follows(
    akube: AsyncClient, namespace: str, tmp_path: Path
) -> None:
    root = tmp_path / "cgroupfs"
    (root / CGROUP.lstrip("/")).mkdir(parents=True)
    (root / "cgroup.controllers").touch()
    node_name = f"gpu-{namespace[-6:]}"
    pod = await akube.create(
        Pod(
            metadata=ObjectMeta(name="infer", annotations=binding(request=4096, limit=8192)),
            spec=PodSpec(nodeName=node_name, containers=[Container(name="app", image="x")]),
        ),
        namespace=namespace,
    )
    assert pod.metadata is not None and pod.metadata.uid is not None
    node = agent(root, tmp_path / "state")
    started(
        node, replace(record(request=4096, limit=8192), pod_uid=pod.metadata.uid, pod_namespace=namespace)
    )
    watch = PodResizeWatch(client=akube, node_name=node_name, tracker=node.tracker)
    running = asyncio.create_task(watch.run())

    async def patch(annotations: dict[str, str]) -> None:
        await akube.patch(
            Pod,
            "infer",
            {"metadata": {"annotations": annotations}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )

    async def condition() -> Any:
        now = await akube.get(Pod, "infer", namespace=namespace)
        found = [c for c in (now.status.conditions or []) if c.type == RESIZE_CONDITION] if now.status else []
        return found[0] if found else None

    try:
        await until(lambda: watch.informer.synced.is_set(), what="the watch to list the node's pods")
        await patch(binding(request=8192, limit=16384))  # the scheduler grants a grow
        await until(lambda: node.held() == {"GPU-aaaa": (8192, 16384)}, what="the grow in force")
        await until(lambda: node.tracker.applied == 1, what="the grow said applied")  # just after read-back
        assert await condition() is None

        node.use(12000)  # the workload now holds 12000 MiB; a shrink to a 10240 MiB limit must wait
        await patch(binding(request=2048, limit=10240))
        waiting = await until(condition, what="GpuResizeInProgress")
        assert (waiting.status, waiting.reason) == ("True", REASON_WAITING_FOR_USAGE)
        assert "GPU-aaaa uses 12000 MiB, above the new limit 10240 MiB" in waiting.message
        assert node.held() == {"GPU-aaaa": (2048, 16384)}  # the request at once, the old hard limit kept

        node.use(3000)
        node.limits.audit()
        await watch.after_audit()
        await until(lambda: node.held() == {"GPU-aaaa": (2048, 10240)}, what="the shrink in force")

        async def removed() -> bool:
            return await condition() is None

        await until(removed, what="the condition removed")
        await until(lambda: node.tracker.applied == 2, what="the shrink said applied")
        (stored,) = node.store.allocations()
        assert (stored.container_id, stored.request_mib, stored.limit_mib) == (CID, 2048, 10240)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
