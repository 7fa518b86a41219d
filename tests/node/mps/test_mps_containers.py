"""Per-container MPS through the ContainerHooks seam, against the STAND-IN daemon process.

A stand-in CUDA client started with the container's CUDA_MPS_PIPE_DIRECTORY (the host side of its mount)
shows which namespace and thread ceiling a process in that container would get.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from mps_harness import RecordingSink, started, until

from gpufrac.contract.request import ComputeMode
from gpufrac.node.mps.containers import ContainerGpu, MpsContainerHooks, namespace_name, thread_ceiling
from gpufrac.node.mps.events import REASON_WEDGED
from gpufrac.node.mps.supervisor import MpsUnavailable, SupervisorState

CID_A = "a" * 64
CID_B = "b" * 64
CID_T = "c" * 64


def sm(cid: str, portion: float, limit_mib: int = 4096) -> ContainerGpu:
    return ContainerGpu(
        container_id=cid, mode=ComputeMode.SM_SHARING, compute_portion=portion, limit_mib=limit_mib
    )


def test_thread_ceiling_floors_to_whole_percent_with_a_minimum_of_one() -> None:
    assert [thread_ceiling(p) for p in (0.257, 0.29, 0.5, 0.999, 1.0, 0.004, None)] == [
        25,
        29,
        50,
        99,
        100,
        1,
        100,
    ]


async def test_sm_sharing_container_gets_its_own_namespace_directory_and_ceiling(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor)

    adjustment = await hooks.on_create(sm(CID_A, 0.257, limit_mib=3000))
    time_slicing = await hooks.on_create(
        ContainerGpu(container_id=CID_T, mode=ComputeMode.TIME_SLICING, compute_portion=None, limit_mib=2048)
    )

    ns = namespace_name(CID_A)
    host_dir = mps_env.root / "pipe" / "shared" / ns
    assert adjustment.env == {"CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps"}
    assert [(m.source, m.destination) for m in adjustment.mounts] == [(str(host_dir), "/run/nvidia/mps")]
    assert time_slicing.env == {} and time_slicing.mounts == ()
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
    await hooks.on_create(sm(CID_A, 0.5))
    await hooks.on_create(sm(CID_B, 0.25))
    await hooks.on_remove(CID_B)  # gone while the daemon ran: deleted at once
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
    await hooks.on_create(sm(CID_A, 0.5))
    await hooks.on_create(sm(CID_B, 0.5))
    mine = [await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A))) for _ in range(2)]
    other, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_B)))

    await hooks.on_stop(CID_A)

    assert [await asyncio.wait_for(p.wait(), 5) for p, _ in mine] == [3, 3]  # 3: terminated by the server
    assert hooks.last_drain is not None and not hooks.last_drain.wedged
    assert other.returncode is None  # the neighbour keeps running
    await hooks.on_remove(CID_A)
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
    await hooks.on_create(sm(CID_A, 0.3))
    await hooks.on_create(sm(CID_B, 0.3))
    client, _ = await mps_env.client(supervisor.namespace_dir(namespace_name(CID_A)))
    old_pid = supervisor.daemon_pid
    mps_env.arm("hang-on-terminate")

    loop = asyncio.get_running_loop()
    began = loop.time()
    await hooks.on_stop(CID_A)
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
        await hooks.on_create(sm(CID_A, 0.5))
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
    adjustment = await hooks.on_create(
        ContainerGpu(
            container_id=CID_A,
            mode=ComputeMode.SM_SHARING,
            compute_portion=0.333,
            limit_mib=1024,
            device_count=2,
        )
    )
    nothing = await hooks.on_create(
        ContainerGpu(container_id=CID_T, mode=ComputeMode.TIME_SLICING, compute_portion=None, limit_mib=1024)
    )

    assert adjustment.env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M,1=1024M",
    }
    assert [(m.source, m.destination) for m in adjustment.mounts] == [
        (str(mps_env.root / "pipe"), "/run/nvidia/mps")
    ]
    assert nothing.env == {} and nothing.mounts == ()
    assert supervisor.capability().enforceable == {ComputeMode.SM_SHARING}
    # Classic drain through get_server_list / get_client_list / terminate_client.
    client, greeting = await mps_env.client(mps_env.root / "pipe")
    assert greeting.startswith("connected ")
    clients = await supervisor.control.list_clients()
    assert [c.pid for c in clients] == [client.pid]
    await supervisor.control.terminate_client(clients[0], timeout_s=5)
    assert await asyncio.wait_for(client.wait(), 5) == 3
