"""Per-container MPS through the ContainerHooks seam, against the STAND-IN daemon process.

A stand-in CUDA client started with the container's CUDA_MPS_PIPE_DIRECTORY (the host side of its mount)
shows which namespace and thread ceiling a process in that container would get.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from mps_harness import RecordingSink, processes_of, started, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import InjectionPlan, pipe_leaf, plan_container
from gpufrac.node.mps.containers import (
    MpsAdjustment,
    MpsContainerHooks,
    apply_adjustment,
    thread_ceiling,
)
from gpufrac.node.mps.events import REASON_RECYCLED, REASON_RESTARTED, REASON_WEDGED
from gpufrac.node.mps.names import MAX_PIPE_DIR_BYTES, namespace_name
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


async def field(supervisor, name: str, what: str) -> str:
    return await supervisor.control.namespace_field(server="shared", name=name, field=what)


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
    assert await field(supervisor, ns, "active_thread_percentage") == "25"
    assert await field(supervisor, ns, "pinned_memory_limit") == "3000M"
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

    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)

    assert sorted(await supervisor.control.list_namespaces(server="shared")) == [
        "default",
        namespace_name(CID_A),
    ]
    assert await field(supervisor, namespace_name(CID_A), "active_thread_percentage") == "50"
    # The very directory a running container has bind-mounted serves again (same inode, fresh socket).
    assert dir_a.stat().st_ino == inode
    client, greeting = await mps_env.client(dir_a)
    assert greeting == f"connected shared {namespace_name(CID_A)} 50"
    client.kill()
    await client.wait()

    # A namespace of gpufrac's that no live container owns is deleted by the reconcile; one that is not
    # gpufrac's (an operator's, another tool's) is left alone, and the table's header is no namespace.
    orphan = namespace_name("0" * 64)
    await supervisor.control.create_namespace(server="shared", name=orphan)
    await supervisor.control.create_namespace(server="shared", name="someone_elses")
    await supervisor.reconcile()
    assert sorted(await supervisor.control.list_namespaces(server="shared")) == [
        "default",
        namespace_name(CID_A),
        "someone_elses",
    ]


class ClientAttachingOnCreate:
    """The real control, except that a client attaches to each namespace right after its ``create``:
    what a running container's process can do while a restarted daemon's namespaces are made again."""

    def __init__(self, control, mps_env) -> None:
        self._control, self._env = control, mps_env
        self.early: list[tuple[asyncio.subprocess.Process, str]] = []

    def __getattr__(self, name: str):
        return getattr(self._control, name)

    async def create_namespace(self, *, server: str, name: str) -> None:
        await self._control.create_namespace(server=server, name=name)
        pipe = self._env.root / "pipe" / server / name
        self.early.append(await self._env.client(pipe))


async def test_a_client_attached_before_its_namespaces_limits_are_set_is_terminated_then_capped(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    racing = ClientAttachingOnCreate(supervisor.control, mps_env)
    supervisor.control = racing
    hooks = MpsContainerHooks(supervisor=supervisor)
    await hooks.on_create(sm(CID_A, 0.25), container_id=CID_A)
    ns = namespace_name(CID_A)

    (early, greeting) = racing.early[0]
    assert greeting == f"connected shared {ns} 100"  # attached with the daemon's defaults: uncapped
    assert await asyncio.wait_for(early.wait(), 5) == 3  # terminated, as a drain terminates
    assert await field(supervisor, ns, "active_thread_percentage") == "25"
    supervisor.control = racing._control
    client, greeting = await mps_env.client(supervisor.namespace_dir(ns))
    assert greeting == f"connected shared {ns} 25"
    client.kill()
    await client.wait()


async def test_every_command_is_issued_in_the_r615_grammar(make_supervisor, mps_env) -> None:
    supervisor = await started(make_supervisor(recycle_when_idle=False))
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    plan = planned(CID_A, portion=0.5, limit="4Gi")
    await hooks.on_create(plan, container_id=CID_A)
    ns = namespace_name(CID_A)
    client, _ = await mps_env.client(supervisor.namespace_dir(ns))
    mps_env.in_container(client.pid, CID_A)
    await hooks.on_stop(container_id=CID_A)
    await hooks.drained(container_id=CID_A)
    await hooks.on_remove(container_id=CID_A)
    await supervisor.stop()

    issued = [c for c in mps_env.commands() if not c.startswith("--mps-client")]
    issued = [c for i, c in enumerate(issued) if i == 0 or c != issued[i - 1]]  # readiness probes repeat
    config = mps_env.root / "state" / "mps-v3.toml"
    assert issued == [
        f"-p 3 -m -f -a {config}",
        "-p 3 server list",
        "-p 3 namespace list --server=shared",
        f"-p 3 namespace create {ns} --server=shared",
        f"-p 3 namespace set {ns} --server=shared --active-thread-percentage=50 --pinned-memory-limit=4096M",
        f"-p 3 namespace get {ns} shared pipe_directory",
        "-p 3 client list --format=csv,noheader",
        f"-p 3 client terminate {client.pid}",
        f"-p 3 namespace delete {ns} --server=shared",
        "-p 3 server list",  # at stop, before `quit` on the daemon's stdin
    ]
    assert await client.wait() == 3


async def test_stop_drains_the_containers_clients_by_pid_and_remove_deletes_its_namespace(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.5), container_id=CID_B)
    mine = [await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A))) for _ in range(2)]
    other, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_B)))
    for process, _ in mine:
        mps_env.in_container(process.pid, CID_A)
    mps_env.in_container(other.pid, CID_B)

    await hooks.on_stop(container_id=CID_A)
    result = await hooks.drained(container_id=CID_A) or hooks.last_drain

    assert [await asyncio.wait_for(p.wait(), 15) for p, _ in mine] == [3, 3]  # 3: terminated by the server
    assert result is not None and sorted(result.terminated) == sorted(p.pid for p, _ in mine)
    assert not result.wedged and not result.recycled  # the neighbour is still attached
    assert other.returncode is None  # the neighbour keeps running
    await hooks.on_remove(container_id=CID_A)
    assert namespace_name(CID_A) not in await supervisor.control.list_namespaces(server="shared")
    assert not supervisor.namespace_dir(namespace_name(CID_A)).exists()
    other.kill()
    await other.wait()


async def test_a_slow_terminate_is_a_drain_not_a_wedge_and_it_runs_once_in_the_background(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink))  # terminate_timeout_s: the default 30 s
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    await hooks.on_create(sm(CID_A, 0.3), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.3), container_id=CID_B)
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    neighbour, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_B)))
    mps_env.in_container(client.pid, CID_A)
    mps_env.in_container(neighbour.pid, CID_B)
    daemon = supervisor.daemon_pid
    mps_env.arm("slow-terminate=3")  # its GPU work takes 3 s to drain

    await hooks.on_stop(container_id=CID_A)  # returns after drain_timeout_s; the drain goes on
    assert client.returncode is None
    await hooks.on_stop(container_id=CID_A)  # the runtime asks again: it joins the drain in flight
    result = await hooks.drained(container_id=CID_A) or hooks.last_drain

    assert result is not None and result.terminated == (client.pid,) and not result.wedged
    assert await asyncio.wait_for(client.wait(), 15) == 3
    assert [c for c in mps_env.commands() if "client terminate" in c] == [
        f"-p 3 client terminate {client.pid}"
    ]
    # Not a wedge: no restart, and the neighbour on the same server keeps running.
    assert sink.reasons() == [] and supervisor.daemon_pid == daemon
    assert neighbour.returncode is None
    neighbour.kill()
    await neighbour.wait()


async def test_at_shutdown_a_slow_drain_gets_its_grace_then_is_cancelled_leaving_no_command(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    await hooks.on_create(sm(CID_A, 0.3), container_id=CID_A)
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    mps_env.in_container(client.pid, CID_A)
    mps_env.arm("slow-terminate=30")
    await hooks.on_stop(container_id=CID_A)

    await hooks.close(timeout_s=0.2)  # the agent is stopping: it does not wait out a 30 s drain

    assert await hooks.drained(container_id=CID_A) is None  # nothing in flight any more
    commands = []
    for pid in processes_of(mps_env.root / "pipe"):
        with contextlib.suppress(OSError):  # exited meanwhile
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes())
    assert not [c for c in commands if b"terminate" in c]  # the terminate's control process is gone
    client.kill()
    await client.wait()


async def test_a_terminate_hanging_past_its_timeout_is_a_wedge_and_the_daemon_restarts(
    make_supervisor, mps_env
) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink, terminate_timeout_s=0.5))
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    await hooks.on_create(sm(CID_A, 0.3), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.3), container_id=CID_B)
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    mps_env.in_container(client.pid, CID_A)
    old_pid = supervisor.daemon_pid
    mps_env.arm("hang-on-terminate")

    await hooks.on_stop(container_id=CID_A)
    result = await hooks.drained(container_id=CID_A) or hooks.last_drain

    assert result is not None and result.wedged and result.remaining == (client.pid,)
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert supervisor.daemon_pid != old_pid
    assert sink.reasons() == [REASON_WEDGED]
    assert await asyncio.wait_for(client.wait(), 15) == 2  # its server went away with the killed daemon
    # The neighbour's namespace is back on the new daemon.
    assert namespace_name(CID_B) in await supervisor.control.list_namespaces(server="shared")


async def test_mps_is_recycled_once_a_drain_leaves_no_client(make_supervisor, mps_env) -> None:
    sink = RecordingSink()
    supervisor = await started(make_supervisor(sink=sink))
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    await hooks.on_create(sm(CID_B, 0.25), container_id=CID_B)  # created, no process yet
    dir_b = supervisor.namespace_dir(namespace_name(CID_B))
    inode = dir_b.stat().st_ino
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    mps_env.in_container(client.pid, CID_A)
    old_pid = supervisor.daemon_pid

    await hooks.on_stop(container_id=CID_A)
    result = await hooks.drained(container_id=CID_A) or hooks.last_drain

    assert result is not None and result.recycled
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert supervisor.daemon_pid != old_pid
    assert [(kind, reason) for kind, reason, _ in sink.events] == [("Normal", REASON_RECYCLED)]
    assert supervisor.capability().labels()["gpufrac.io/mps"] == "v3"
    # The container that has not started yet finds its namespace, in the same directory, on the new daemon.
    assert dir_b.stat().st_ino == inode
    late, greeting = await mps_env.client(dir_b)
    assert greeting == f"connected shared {namespace_name(CID_B)} 25"
    late.kill()
    await late.wait()


async def test_a_pipe_directory_too_long_for_a_socket_fails_the_container_with_a_clear_reason(
    make_supervisor, mps_env
) -> None:
    # 60 bytes: the daemon's own sockets fit; a namespace's (<pipe>/shared/<41>/control) would not.
    pipe = mps_env.root / ("p" * (60 - len(str(mps_env.root)) - 1))
    supervisor = await started(make_supervisor(pipe_dir=pipe))
    hooks = MpsContainerHooks(supervisor=supervisor)

    with pytest.raises(MpsUnavailable) as failed:
        await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)

    directory = str(supervisor.namespace_dir(namespace_name(CID_A)))
    assert directory in str(failed.value) and f"{MAX_PIPE_DIR_BYTES}-byte limit" in str(failed.value)
    assert await supervisor.control.list_namespaces(server="shared") == ["default"]


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


async def test_a_create_refused_while_mps_started_is_served_on_the_retry(make_supervisor, mps_env) -> None:
    # CreateContainer arrives while the daemon starts: the startup reconcile takes its namespace in, but
    # the wait (create_wait_s) ends first, so the container fails and the reconcile deletes the namespace
    # as an orphan. The kubelet's retry must get a working namespace, not the deleted one's directory.
    mps_env.arm("slow-on=0.5 namespace list", "slow-on=3 namespace create")
    supervisor = make_supervisor(create_wait_s=1.0)
    hooks = MpsContainerHooks(supervisor=supervisor)
    await supervisor.start()
    await until(lambda: "-p 3 namespace list --server=shared" in mps_env.commands())
    with pytest.raises(MpsUnavailable, match="not serving"):
        await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    assert await supervisor.wait_ready(timeout_s=20)
    assert namespace_name(CID_A) not in await supervisor.control.list_namespaces(server="shared")

    retried = apply_adjustment(sm(CID_A, 0.5), await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A))

    client, greeting = await mps_env.client(Path(retried.mounts[0].source))
    assert greeting == f"connected shared {namespace_name(CID_A)} 50"
    client.kill()
    await client.wait()


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

    with pytest.raises(MpsUnavailable, match=namespace_name(CID_A)):
        await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)

    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)
    assert sink.reasons() == [REASON_RESTARTED]
    assert namespace_name(CID_A) not in await supervisor.control.list_namespaces(server="shared")  # not kept
    await hooks.on_create(sm(CID_B, 0.5), container_id=CID_B)  # the next container is served again
    assert namespace_name(CID_B) in await supervisor.control.list_namespaces(server="shared")


async def test_a_live_resize_changes_an_idle_namespace_and_says_why_an_attached_one_keeps_its_settings(
    make_supervisor, mps_env
) -> None:
    """A resize of a running sm-sharing container (gpufrac.node.resize): with no client attached the
    namespace takes the new ceiling and pinned-memory limit; with one attached MPS refuses ``namespace set``
    (a client's settings are fixed when it connects), the answer says so, and the live set holds the new
    settings, so the namespace is made with them again after a daemon restart."""
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor)
    await hooks.on_create(sm(CID_A, 0.5), container_id=CID_A)
    ns = namespace_name(CID_A)

    assert await hooks.on_resize(planned(CID_A, portion=0.3, limit="6Gi").bound, container_id=CID_A) is None
    assert await field(supervisor, ns, "active_thread_percentage") == "30"
    assert await field(supervisor, ns, "pinned_memory_limit") == "6144M"

    client, greeting = await mps_env.client(supervisor.namespace_dir(ns))
    assert greeting == f"connected shared {ns} 30"
    kept = await hooks.on_resize(planned(CID_A, portion=0.6, limit="8Gi").bound, container_id=CID_A)
    assert kept is not None and "clients attached now" in kept
    assert (
        await field(supervisor, ns, "active_thread_percentage") == "30"
    )  # the running client's, as MPS keeps it
    (spec,) = [s for s in supervisor.live_namespaces() if s.name == ns]
    assert (spec.active_thread_percentage, spec.pinned_memory_limit) == (60, "8192M")
    # A time-slicing container has no namespace: nothing to do.
    assert (
        await hooks.on_resize(planned(CID_T, mode="time-slicing", portion=None).bound, container_id=CID_T)
        is None
    )
    client.kill()
    await client.wait()
