"""A GPU Operator driver upgrade on a node with the node agent running: the agent lets go of the driver
and comes back by itself (real API server, NRI's real adaptation, the MPS STAND-IN, simulated GPUs).

NVIDIA's GPU-fractioning operator recorded the driver unload failing with EBUSY and the driver DaemonSet
crash-looping while its MPS daemon held the device files. Here the GPU Operator's upgrade-state label
moves on the Node; the agent must say ``DriverUpgradeInProgress``, stop MPS, close NVML (the simulated
backend tracks whether it holds the driver open, as nvmlInit/nvmlShutdown do), and, when the label says
``upgrade-done``, read the GPUs and start MPS again without anyone restarting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node
from lightkube.types import PatchType
from mps_harness import MpsEnv, processes_of

from gpufrac.contract import keys
from gpufrac.contract.gpu_operator import DRIVER_UPGRADE_DONE, DRIVER_UPGRADE_STATE_LABEL
from gpufrac.local.nriruntime import NriRuntime, binary_path
from gpufrac.node.agent import NodeAgent
from gpufrac.node.config import load_settings
from gpufrac.node.inventory.simulated import SimulatedInventory
from gpufrac.scheduler.objects import node_spec


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"upg-{uuid.uuid4().hex[:8]}"
    await akube.create(Node(metadata=ObjectMeta(name=name)))
    kubelet_ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated"}
    await akube.patch(
        Node.Status, name, {"status": {"conditions": [kubelet_ready]}}, patch_type=PatchType.STRATEGIC
    )
    yield name
    await akube.delete(Node, name)


@pytest.fixture
async def lease_namespace(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"leases-{uuid.uuid4().hex[:8]}"
    await akube.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    await akube.delete(Namespace, name)


async def eventually(check: Any, *, timeout_s: float = 30.0, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f}s"
        await asyncio.sleep(0.05)


def agent_condition(node: Node) -> tuple[str, str]:
    for c in (node.status.conditions if node.status else None) or []:
        if c.type == keys.NODE_READY_CONDITION:
            return c.status, c.reason or ""
    return "", ""


async def set_upgrade_state(client: AsyncClient, node: str, state: str) -> None:
    await client.patch(
        Node, node, {"metadata": {"labels": {DRIVER_UPGRADE_STATE_LABEL: state}}}, patch_type=PatchType.MERGE
    )


async def test_a_driver_upgrade_stops_mps_releases_nvml_and_everything_comes_back(
    akube: AsyncClient, node_name: str, lease_namespace: str, mps_env: MpsEnv, tmp_path: Path
) -> None:
    if not binary_path().exists():
        pytest.skip("the NRI runtime driver is not built (bash testenv/nriruntime/build.sh)")
    runtime = NriRuntime(socket_path=mps_env.root / "nri.sock")
    await runtime.start()
    pipe = mps_env.root / "pipe"
    settings = load_settings(
        None,
        node_name=node_name,
        backend="simulated",
        sim_gpus="1xH100-80GB",
        state_dir=tmp_path / "agent",
        nri_socket=str(runtime.socket_path),
        health_port=0,
        usage={"metrics_port": 0, "audit": False},
        publish_interval_s=0.1,
        lease_namespace=lease_namespace,
        mps=True,
        mps_control_bin=str(mps_env.bin),
        mps_pipe_dir=pipe,
        mps_log_dir=mps_env.root / "log",
        mps_handover=False,  # stopping the agent at the end stops MPS too (handover: test_mps_handover.py)
    )
    agent = NodeAgent(settings=settings, client=akube)
    backend = agent.backend
    assert isinstance(backend, SimulatedInventory)
    running = asyncio.create_task(agent.run())

    async def condition_is(status: str, reason: str) -> bool:
        return agent_condition(await akube.get(Node, node_name)) == (status, reason)

    async def mps_running() -> bool:
        return bool(processes_of(pipe)) and (pipe / "control").exists()

    try:
        await eventually(lambda: condition_is("True", keys.NODE_REASON_READY), what="the node Ready")
        await eventually(mps_running, what="MPS serving")
        assert backend.holds_driver
        assert node_spec(await akube.get(Node, node_name)).ready

        started = time.monotonic()
        await set_upgrade_state(akube, node_name, "pod-deletion-required")
        # The scheduler stops placing at once, from the label alone, whatever the agent has done yet.
        assert not node_spec(await akube.get(Node, node_name)).ready
        await eventually(
            lambda: condition_is("False", keys.NODE_REASON_DRIVER_UPGRADE), what="DriverUpgradeInProgress"
        )
        said = time.monotonic() - started

        async def let_go() -> bool:  # MPS stopped first, then NVML closed
            return processes_of(pipe) == [] and not backend.holds_driver

        await eventually(let_go, what="MPS stopped and NVML closed")
        released = time.monotonic() - started
        print(
            f"driver upgrade: Node said so after {said:.2f}s, MPS gone and NVML closed after {released:.2f}s"
        )
        # The agent goes on running through the upgrade without touching the driver: several of its
        # rounds later, nothing of it holds the driver and MPS has not come back.
        rounds = agent.size_passes
        while agent.size_passes < rounds + 5:
            await asyncio.sleep(0.05)
        assert not backend.holds_driver and processes_of(pipe) == []
        assert not running.done()

        started = time.monotonic()
        await set_upgrade_state(akube, node_name, DRIVER_UPGRADE_DONE)
        await eventually(lambda: condition_is("True", keys.NODE_REASON_READY), what="Ready again")
        await eventually(mps_running, what="MPS serving again")
        print(f"driver upgrade done: Ready and MPS back after {time.monotonic() - started:.2f}s")
        assert backend.holds_driver
        assert node_spec(await akube.get(Node, node_name)).ready
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await runtime.stop()
    assert processes_of(pipe) == []


def test_only_a_finished_or_absent_upgrade_leaves_a_node_placeable() -> None:
    from gpufrac.contract.gpu_operator import driver_upgrade_state

    assert driver_upgrade_state({}) is None
    assert driver_upgrade_state({DRIVER_UPGRADE_STATE_LABEL: DRIVER_UPGRADE_DONE}) is None
    for state in ("upgrade-required", "cordon-required", "drain-required", "upgrade-failed"):
        assert driver_upgrade_state({DRIVER_UPGRADE_STATE_LABEL: state}) == state
