"""Time-slicing containers as MPS clients of the default server (``time_slicing_clients``), against the
STAND-IN daemon: the second memory guard where the toolkit's memory-limit hook is missing (docs/mps.md).

A stand-in CUDA client started with the container's injected variables and the host side of its MPS
mount shows what a process in that container gets: which server, and the pinned-memory limit it runs
under (memacct).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from mps_harness import memory_limit, started, until
from test_mps_containers import CID_A, CID_T, planned

from gpufrac.node.inject import CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
from gpufrac.node.mps.containers import MpsAdjustment, MpsContainerHooks, apply_adjustment
from gpufrac.node.mps.default_socket import CLIENTS_DIR
from gpufrac.node.mps.names import namespace_name
from gpufrac.node.mps.supervisor import SupervisorState

CID_T2 = "d" * 64


def host_mps_dir(plan) -> Path:
    (mount,) = plan.mounts
    return Path(mount.source)


async def test_a_time_slicing_container_is_a_default_server_client_capped_at_its_limit(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor(time_slicing_clients=True, recycle_when_idle=False))
    hooks = MpsContainerHooks(supervisor=supervisor, proc_root=mps_env.proc_root)
    sm_plan = planned(CID_A, portion=0.5)
    await hooks.on_create(sm_plan, container_id=CID_A)
    ts_plan = planned(CID_T, mode="time-slicing", portion=None, limit="3000Mi")
    created = apply_adjustment(ts_plan, await hooks.on_create(ts_plan, container_id=CID_T))

    directory = host_mps_dir(created)
    assert directory == mps_env.root / "pipe" / CLIENTS_DIR / namespace_name(CID_T)
    # Its only MPS directory holds the default socket and nothing else: no way to another tenant's namespace.
    assert sorted(p.name for p in directory.iterdir()) == ["control"]
    client, greeting = await mps_env.client(directory, env=created.env_map)
    assert greeting == "connected default default 100"  # its own server: no context shared with anyone
    assert await memory_limit(client) == "3000M"  # the container's limit, from its injected variable
    assert created.env_map[CUDA_MPS_PINNED_DEVICE_MEM_LIMIT] == "0=3000M"
    mps_env.in_container(client.pid, CID_T)
    listed = {c.pid: c.server for c in await supervisor.control.list_clients()}
    assert listed == {client.pid: "default"}  # memacct sees it by PID

    # StopContainer drains it as it drains sm-sharing clients (a client killed mid-work can wedge MPS).
    await hooks.on_stop(container_id=CID_T)
    assert await asyncio.wait_for(client.wait(), 15) == 3
    await hooks.on_remove(container_id=CID_T)
    assert not directory.exists()


async def test_the_link_follows_the_daemon_across_a_restart_and_synchronize(make_supervisor, mps_env) -> None:
    supervisor = await started(make_supervisor(time_slicing_clients=True))
    hooks = MpsContainerHooks(supervisor=supervisor)
    plan = planned(CID_T, mode="time-slicing", portion=None)
    directory = host_mps_dir(apply_adjustment(plan, await hooks.on_create(plan, container_id=CID_T)))
    inode = directory.stat().st_ino

    os.kill(supervisor.daemon_pid, signal.SIGKILL)
    await until(lambda: supervisor.restarts == 1 and supervisor.state is SupervisorState.READY)

    assert directory.stat().st_ino == inode  # the directory the container has mounted, relinked in place
    client, greeting = await mps_env.client(directory, env=plan.env_map)
    assert greeting == "connected default default 100"
    client.kill()
    await client.wait()

    # After an agent restart the runtime's live containers are the set; a gone one's directory goes.
    await hooks.on_synchronize([(CID_T2, planned(CID_T2, mode="time-slicing", portion=None))])
    assert not directory.exists()
    survivor = mps_env.root / "pipe" / CLIENTS_DIR / namespace_name(CID_T2)
    client, greeting = await mps_env.client(survivor)
    assert greeting == "connected default default 100"
    client.kill()
    await client.wait()


async def test_a_container_synchronized_while_linked_leaves_no_directory_at_remove(make_supervisor) -> None:
    """A Synchronize relinks every live container to the socket it is already linked to (rename(2) of two
    links to one inode does nothing): nothing of that may stay behind, or RemoveContainer could not
    remove the directory and it would leak."""
    supervisor = await started(make_supervisor(time_slicing_clients=True))
    hooks = MpsContainerHooks(supervisor=supervisor)
    plan = planned(CID_T, mode="time-slicing", portion=None)
    directory = host_mps_dir(apply_adjustment(plan, await hooks.on_create(plan, container_id=CID_T)))
    await hooks.on_synchronize([(CID_T, plan)])
    assert [p.name for p in directory.iterdir()] == ["control"]
    await hooks.on_remove(container_id=CID_T)
    assert not directory.exists()


async def test_off_by_default_time_slicing_stays_off_mps_and_the_default_socket_is_context_shared(
    make_supervisor, mps_env
) -> None:
    supervisor = await started(make_supervisor())
    hooks = MpsContainerHooks(supervisor=supervisor)
    plan = planned(CID_T, mode="time-slicing", portion=None)
    assert await hooks.on_create(plan, container_id=CID_T) == MpsAdjustment()
    assert 'default_socket = "on"' in (mps_env.root / "state" / "mps-v3.toml").read_text()
    assert not (mps_env.root / "pipe" / CLIENTS_DIR).exists()
