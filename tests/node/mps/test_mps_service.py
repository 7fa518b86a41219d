"""The node agent's MPS part: hooks before the driver is known, then the supervisor, then a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid

import pytest
from lightkube.resources.core_v1 import Event
from mps_harness import MpsEnv, RecordingSink, processes_of, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import InjectionPlan, pipe_leaf, plan_container
from gpufrac.node.inventory.backend import InventoryUnavailable
from gpufrac.node.mps.mode import DriverVersion
from gpufrac.node.mps.names import namespace_name
from gpufrac.node.mps.service import MpsService
from gpufrac.node.mps.supervisor import MpsUnavailable, SupervisorState


def sm_plan(cid: str) -> InjectionPlan:
    prefix = "nvidia.com/container.main."
    notes = {
        prefix + "gpu-memory.request": "1Gi",
        prefix + "gpu-compute.mode": "sm-sharing",
        prefix + "gpu-compute.portion": "0.4",
        prefix + "gpus.devices": "GPU-0000-3333",
    }
    plan, _ = plan_container(
        annotations=notes, container="main", pipe_source=pipe_leaf(root="/x", container_id=cid)
    )
    assert plan is not None
    return plan


async def test_service_fails_closed_until_the_driver_is_known_then_serves_and_stops_cleanly(
    mps_env: MpsEnv,
) -> None:
    nvml_answers = asyncio.Event()

    def read_driver() -> str:
        if not nvml_answers.is_set():
            raise InventoryUnavailable("NVML: Driver Not Loaded")
        return "615.20.01"

    pokes: list[bool] = []
    service = MpsService(
        settings=mps_env.settings(),
        events=RecordingSink(),
        read_driver=read_driver,
        on_change=lambda: pokes.append(True),
        retry_s=0.1,
    )
    live = "1" * 64
    task = asyncio.create_task(service.run())
    try:
        await service.hooks.on_synchronize([(live, sm_plan(live))])  # the runtime already runs one
        with pytest.raises(MpsUnavailable, match="not started yet"):
            await service.hooks.on_create(sm_plan("2" * 64), container_id="2" * 64)
        assert ComputeMode.SM_SHARING not in service.capability(DriverVersion.parse("615.20.01")).enforceable

        nvml_answers.set()
        await until(
            lambda: service.supervisor is not None and service.supervisor.state is SupervisorState.READY
        )
        supervisor = service.supervisor
        assert supervisor is not None
        assert namespace_name(live) in await supervisor.control.list_namespaces(server="shared")
        await service.hooks.on_create(sm_plan("2" * 64), container_id="2" * 64)
        assert namespace_name("2" * 64) in await supervisor.control.list_namespaces(server="shared")
        assert ComputeMode.SM_SHARING in service.capability(DriverVersion.parse("615.20.01")).enforceable
        assert pokes  # the publisher was told
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert processes_of(mps_env.root / "pipe") == []
    assert service.supervisor is not None and service.supervisor.state is SupervisorState.STOPPED


async def test_every_restart_is_an_event_on_the_node_in_the_api_server(mps_env: MpsEnv, akube) -> None:
    node = f"gpu-node-{uuid.uuid4().hex[:6]}"
    service = MpsService.for_node(
        node_name=node, client=akube, settings=mps_env.settings(), read_driver=lambda: "615.20.01"
    )
    task = asyncio.create_task(service.run())
    try:
        await until(
            lambda: service.supervisor is not None and service.supervisor.state is SupervisorState.READY
        )
        supervisor = service.supervisor
        assert supervisor is not None
        for n in (1, 2):
            os.kill(supervisor.daemon_pid, signal.SIGKILL)
            await until(lambda n=n: supervisor.restarts == n and supervisor.state is SupervisorState.READY)

        async def node_events() -> list[Event]:
            return [e async for e in akube.list(Event, namespace="default") if e.involvedObject.name == node]

        for _ in range(200):
            events = await node_events()
            if len(events) == 2:
                break
            await asyncio.sleep(0.05)
        assert (
            sorted((e.involvedObject.kind, e.type, e.reason) for e in events)
            == [("Node", "Warning", "MpsDaemonRestarted")] * 2
        )
        assert all("exited with status -9" in e.message for e in events)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
