"""Per-container MPS through the ContainerHooks seam, against the STAND-IN daemon process.

A stand-in CUDA client started with the container's CUDA_MPS_PIPE_DIRECTORY (the host side of its mount)
shows which namespace and thread ceiling a process in that container would get.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from mps_harness import RecordingSink, started, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import InjectionPlan, pipe_leaf, plan_container
from gpufrac.node.mps.containers import (
    MpsAdjustment,
    MpsContainerHooks,
    apply_adjustment,
    namespace_name,
    thread_ceiling,
)
from gpufrac.node.mps.events import REASON_RESTARTED, REASON_WEDGED
from gpufrac.node.mps.supervisor import MpsUnavailable, SupervisorState

CID_A = "a" * 64
CID_B = "b" * 64
CID_T = "c" * 64
LEAVES = "/run/gpufrac/mps-leaves"


def planned(
    cid: str, *, mode: str = "sm-sharing", portion: float | None = 0.5, limit: str = "4Gi"
) -> InjectionPlan:
    prefix = "nvidia.com/container.main."
    annotations = {
        prefix + "gpu-memory.request": "1Gi",
        prefix + "gpu-memory.limit": limit,
        prefix + "gpu-compute.mode": mode,
        prefix + "gpus.devices": "GPU-0000-1111",
    }
    if portion is not None:
        annotations[prefix + "gpu-compute.portion"] = str(portion)
    plan, _ = plan_container(
        annotations=annotations, container="main", pipe_source=pipe_leaf(root=LEAVES, container_id=cid)
    )
    assert plan is not None
    return plan


def sm(cid: str, portion: float) -> InjectionPlan:
    return planned(cid, portion=portion)


def mounts(plan: InjectionPlan) -> list[tuple[str, str]]:
    return [(m.source, m.destination) for m in plan.mounts]


def test_thread_ceiling_floors_to_whole_percent_with_a_minimum_of_one() -> None:
    portions = (0.257, 0.29, 0.5, 0.999, 1.0, 0.004, None)
    assert [thread_ceiling(p) for p in portions] == [25, 29, 50, 99, 100, 1, 100]


async def test_sm_sharing_container_gets_its_own_namespace_directory_and_ceiling(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor)

    plan_a = planned(CID_A, portion=0.257, limit="3000Mi")
    plan_t = planned(CID_T, mode="time-slicing", portion=None)
    created = apply_adjustment(plan_a, await hooks.on_create(plan_a, container_id=CID_A))
    adjustment_t = await hooks.on_create(plan_t, container_id=CID_T)

    ns = namespace_name(CID_A)
    host_dir = mps_env.root / "pipe" / "shared" / ns
    assert mounts(created) == [(str(host_dir), "/run/nvidia/mps")]  # its only MPS directory
    assert created.env_map["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia/mps"
    assert adjustment_t == MpsAdjustment()  # time-slicing keeps its empty private leaf: no MPS client
    assert mounts(apply_adjustment(plan_t, adjustment_t)) == [(f"{LEAVES}/{CID_T}", "/run/nvidia/mps")]
    settings = await supervisor.control.namespace_settings(server="shared", name=ns)
    assert settings == {"active_thread_percentage": "25", "pinned_memory_limit": "3000M"}
    # A process inside the container reaches its namespace and only that (its only MPS directory).
    client, greeting = await mps_env.client(host_dir)
    assert greeting == f"connected shared {ns} 25"
    assert [(c.pid, c.namespace) for c in await supervisor.control.list_clients()] == [(client.pid, ns)]
    client.kill()
    await client.wait()


async def test_namespaces_survive_a_daemon_restart_in_the_same_directory_and_orphans_go(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink))
    hooks = MpsContainerHooks(supervisor=supervisor)
    await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.25), container_id=CID_B)
    await hooks.on_remove(container_id=CID_B)  # gone while the daemon ran: deleted at once
    dir_a = supervisor.namespace_dir(namespace_name(CID_A))
    inode = dir_a.stat().st_ino
    assert not supervisor.namespace_dir(namespace_name(CID_B)).exists()

    await supervisor.control.create_namespace(server="shared", name="ctr-stale", settings={})
    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)

    assert sorted(await supervisor.control.list_namespaces(server="shared")) == ["ctr-" + "a" * 20, "default"]
    assert (await supervisor.control.namespace_settings(server="shared", name=namespace_name(CID_A)))[
        "active_thread_percentage"
    ] == "50"
    # The very directory a running container has bind-mounted serves again (same inode, fresh socket).
    assert dir_a.stat().st_ino == inode
    client, greeting = await mps_env.client(dir_a)
    assert greeting == f"connected shared {namespace_name(CID_A)} 50"
    client.kill()
    await client.wait()

    # A namespace no live container owns (left by anyone) is deleted by the reconcile after a restart.
    await supervisor.control.create_namespace(server="shared", name="ctr-orphan", settings={})
    await supervisor.reconcile()
    assert "ctr-orphan" not in await supervisor.control.list_namespaces(server="shared")


async def test_stop_drains_the_containers_clients_and_remove_deletes_its_namespace(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor)
    await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.5), container_id=CID_B)
    mine = [await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A))) for _ in range(2)]
    other, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_B)))

    await hooks.on_stop(container_id=CID_A)

    assert [await asyncio.wait_for(p.wait(), 5) for p, _ in mine] == [3, 3]  # 3: terminated by the server
    assert hooks.last_drain is not None and not hooks.last_drain.wedged
    assert other.returncode is None  # the neighbour keeps running
    await hooks.on_remove(container_id=CID_A)
    assert namespace_name(CID_A) not in await supervisor.control.list_namespaces(server="shared")
    assert not supervisor.namespace_dir(namespace_name(CID_A)).exists()
    other.kill()
    await other.wait()


async def test_hanging_terminate_means_wedged_drain_is_bounded_and_daemon_restarts(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink, terminate_timeout_s=0.5, drain_timeout_s=3.0))
    hooks = MpsContainerHooks(supervisor=supervisor)
    await hooks.on_create(sm(CID_A, 0.3), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.3), container_id=CID_B)
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    old_pid = supervisor.daemon_pid
    mps_env.arm("hang-on-terminate")

    loop = asyncio.get_running_loop()
    began = loop.time()
    await hooks.on_stop(container_id=CID_A)
    took = loop.time() - began

    assert took < 3.0, f"StopContainer's drain took {took:.1f}s"
    assert hooks.last_drain is not None and hooks.last_drain.wedged
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert supervisor.daemon_pid != old_pid
    assert sink.reasons() == [REASON_WEDGED]
    assert await asyncio.wait_for(client.wait(), 5) == 2  # its server went away with the killed daemon
    # The neighbour's namespace is back on the new daemon.
    assert namespace_name(CID_B) in await supervisor.control.list_namespaces(server="shared")


async def test_create_fails_closed_when_the_daemon_cannot_serve(make_supervisor, mps_env) -> None:
    supervisor = make_supervisor(
        create_wait_s=0.3, ready_timeout_s=0.5, backoff={"initial_s": 30, "max_s": 30}
    )
    mps_env.arm("slow-start=5")
    await supervisor.start()
    hooks = MpsContainerHooks(supervisor=supervisor)
    try:
        await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    except MpsUnavailable as error:
        assert "not serving" in str(error)
    else:
        raise AssertionError("an sm-sharing container was created without its MPS namespace")
    assert supervisor.live_namespaces() == ()


async def test_classic_mode_gives_env_limits_and_time_slicing_nothing(make_supervisor, mps_env) -> None:
    supervisor = await started(make_supervisor(driver="580.65.06"))
    hooks = MpsContainerHooks(supervisor=supervisor)

    cmdline = Path(f"/proc/{supervisor.daemon_pid}/cmdline").read_bytes().split(b"\0")
    assert b"-p" not in cmdline and b"-f" in cmdline
    plan_a = planned(CID_A, portion=0.333, limit="1Gi")
    plan_t = planned(CID_T, mode="time-slicing", portion=None)
    created = apply_adjustment(plan_a, await hooks.on_create(plan_a, container_id=CID_A))
    adjustment_t = await hooks.on_create(plan_t, container_id=CID_T)

    assert mounts(created) == [(str(mps_env.root / "pipe"), "/run/nvidia/mps")]
    assert created.env_map["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"
    assert created.env_map["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    assert adjustment_t == MpsAdjustment()
    assert supervisor.capability().enforceable == {ComputeMode.SM_SHARING}
    # Classic drain through get_server_list / get_client_list / terminate_client.
    client, greeting = await mps_env.client(mps_env.root / "pipe")
    assert greeting.startswith("connected ")
    clients = await supervisor.control.list_clients()
    assert [c.pid for c in clients] == [client.pid]
    await supervisor.control.terminate_client(clients[0], timeout_s=5)
    assert await asyncio.wait_for(client.wait(), 5) == 3


async def test_daemon_crashing_on_namespace_create_fails_that_container_and_recovers(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink))
    hooks = MpsContainerHooks(supervisor=supervisor)
    mps_env.arm("crash-on=namespace create")

    with pytest.raises(MpsUnavailable, match="ctr-a"):
        await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)

    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert sink.reasons() == [REASON_RESTARTED]
    assert namespace_name(CID_A) not in await supervisor.control.list_namespaces(server="shared")  # not kept
    await hooks.on_create(sm(CID_B, 0.5), container_id=CID_B)  # the next container is served again
    assert namespace_name(CID_B) in await supervisor.control.list_namespaces(server="shared")
