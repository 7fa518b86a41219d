"""The MPS daemon leaves the agent's cgroup (gpufrac.node.mps.hostcgroup).

Which hierarchies are the host's, and what is written where, on a /proc and cgroup tree laid out in a
temporary directory as the kernel lays them out; then the supervisor moving the STAND-IN daemon on this
machine's real cgroups (v1 here), and the Event when it cannot. That a daemon so moved survives the
replacement of the agent's pod is test_mps_handover_realnode.py (a real kubelet, containerd and runc).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mps_harness import MpsEnv, RecordingSink, processes_of, remove_cgroup, started, until

from gpufrac.node.mps.events import REASON_IN_AGENT_CGROUP
from gpufrac.node.mps.hostcgroup import (
    Hierarchy,
    HostCgroupError,
    cgroups_of,
    host_hierarchies,
    move_to_own_cgroup,
)
from gpufrac.node.mps.mode import DriverVersion
from gpufrac.node.mps.supervisor import MpsSupervisor

#: PID 1's mounts on a cgroup v1 host (hybrid: the unified hierarchy beside), as /proc/1/mountinfo has them.
HOST_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset,clone_children
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
#: A container's own mounts: runc mounts each v1 hierarchy at the container's cgroup, not at its root.
CONTAINER_MOUNTS = """\
700 690 0:32 /kubepods/pod1/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
701 690 0:33 /kubepods/pod1/abc /sys/fs/cgroup/devices ro,nosuid - cgroup cgroup rw,devices
"""


def _proc(tmp_path: Path, *, pid1: str | None, own: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(own)
    if pid1 is not None:
        (proc / "1").mkdir()
        (proc / "1" / "mountinfo").write_text(pid1)
        for line in pid1.splitlines():
            if " - cgroup" in line:
                (proc / "1" / "root" / line.split()[4].lstrip("/")).mkdir(parents=True)
    return proc


def test_the_hosts_hierarchies_are_pid_1s_not_the_containers_own(tmp_path: Path) -> None:
    proc = _proc(tmp_path, pid1=HOST_MOUNTS, own=CONTAINER_MOUNTS)
    found = {h.name: h for h in host_hierarchies(proc=proc)}
    assert set(found) == {"cpu,cpuacct", "cpuset", "memory", "name=systemd", "unified"}
    assert found["memory"].path == proc / "1" / "root" / "sys/fs/cgroup/memory"
    assert found["memory"].version == 1 and found["unified"].version == 2


def test_without_pid_1s_root_only_a_view_of_a_hierarchys_root_will_do(tmp_path: Path) -> None:
    # PID 1's root unreadable, and the container's own mounts show sub-trees only: nothing to move into.
    proc = _proc(tmp_path, pid1=None, own=CONTAINER_MOUNTS)
    with pytest.raises(HostCgroupError) as refused:
        host_hierarchies(proc=proc)
    message = str(refused.value)
    assert "no host cgroup filesystem in sight" in message
    assert f"{proc}/1/mountinfo" in message and "shows no cgroup hierarchy from its root" in message
    # The agent on the host (or with the host's / mounted): its own mounts show the roots.
    (proc / "self" / "mountinfo").write_text(HOST_MOUNTS)
    (proc / "self" / "root" / "sys/fs/cgroup/memory").mkdir(parents=True)
    assert [h.name for h in host_hierarchies(proc=proc)] == ["memory"]


def test_the_daemon_is_written_into_a_cgroup_of_its_own_in_each_hierarchy(tmp_path: Path) -> None:
    memory = Hierarchy(name="memory", path=tmp_path / "memory", version=1)
    cpuset = Hierarchy(name="cpuset", path=tmp_path / "cpuset", version=1)
    for hierarchy in (memory, cpuset):
        hierarchy.path.mkdir()
    (cpuset.path / "cpuset.cpus").write_text("0-3\n")
    (cpuset.path / "cpuset.mems").write_text("0\n")
    # What the kernel gives a new cpuset cgroup: empty CPUs and memory nodes (tasks are refused so).
    (cpuset.path / "gpufrac-mps").mkdir()
    (cpuset.path / "gpufrac-mps" / "cpuset.cpus").write_text("")
    (cpuset.path / "gpufrac-mps" / "cpuset.mems").write_text("")

    moved = move_to_own_cgroup([4242], name="gpufrac-mps", hierarchies=[memory, cpuset])
    assert moved == [memory.path / "gpufrac-mps", cpuset.path / "gpufrac-mps"]
    assert (memory.path / "gpufrac-mps" / "cgroup.procs").read_text() == "4242\n"
    assert (cpuset.path / "gpufrac-mps" / "cgroup.procs").read_text() == "4242\n"
    assert (cpuset.path / "gpufrac-mps" / "cpuset.cpus").read_text() == "0-3\n"
    assert (cpuset.path / "gpufrac-mps" / "cpuset.mems").read_text() == "0\n"


def test_what_cannot_be_moved_says_where_and_why(tmp_path: Path) -> None:
    not_a_hierarchy = tmp_path / "memory"
    not_a_hierarchy.write_text("")
    broken = Hierarchy(name="memory", path=not_a_hierarchy, version=1)
    with pytest.raises(
        HostCgroupError, match=rf"cannot move pid 4242 into {not_a_hierarchy}/gpufrac-mps \(memory\)"
    ):
        move_to_own_cgroup([4242], name="gpufrac-mps", hierarchies=[broken])
    with pytest.raises(HostCgroupError, match=r"cgroup name '\.\./escape' is not one path component"):
        move_to_own_cgroup([4242], name="../escape", hierarchies=[])
    # 0 in cgroup.procs would move the writer -- the agent itself.
    with pytest.raises(HostCgroupError, match=r"pids \[0\] to move: each must be a process id"):
        move_to_own_cgroup([0], name="gpufrac-mps", hierarchies=[])


@pytest.fixture
async def test_cgroup() -> AsyncIterator[str]:
    """A cgroup name of this test's own on the machine's real hierarchies, removed afterwards."""
    name = f"gpufrac-mps-test-{uuid.uuid4().hex[:8]}"
    yield name
    await remove_cgroup(name)


async def test_the_supervisor_moves_the_daemon_and_its_servers_out_on_this_machine(
    mps_env: MpsEnv, test_cgroup: str
) -> None:
    """The real kernel's cgroups (needs root): the daemon and the server it runs end up in the cgroup of
    their own in every hierarchy, and a server forked afterwards is born there."""
    try:
        hierarchies = host_hierarchies()
    except HostCgroupError as error:
        pytest.skip(f"this machine shows no cgroup hierarchy: {error}")
    sink = RecordingSink()
    supervisor = MpsSupervisor(
        # No active probe: its test client is the agent's child, in the agent's cgroup by design.
        settings=mps_env.settings(handover=True, own_cgroup=test_cgroup, probe_interval_s=None),
        driver=DriverVersion.parse("615.20.01"),
        events=sink,
    )
    try:
        await started(supervisor)
        daemon = supervisor.daemon_pid
        assert daemon is not None
        expected = {h.name: f"/{test_cgroup}" for h in hierarchies}
        where = cgroups_of(daemon)
        assert {name: where.get(name) for name in expected} == expected
        for pid in processes_of(mps_env.root / "pipe"):  # the daemon and its servers
            got = cgroups_of(pid)
            assert {name: got.get(name) for name in expected} == expected, pid
        assert REASON_IN_AGENT_CGROUP not in sink.reasons()
    finally:
        await supervisor.stop()
    await until(lambda: not processes_of(mps_env.root / "pipe"), timeout_s=30)


async def test_a_daemon_that_cannot_leave_says_so_on_the_node_and_still_serves(
    mps_env: MpsEnv, tmp_path: Path
) -> None:
    not_a_hierarchy = tmp_path / "cgroup-file"
    not_a_hierarchy.write_text("")
    sink = RecordingSink()
    supervisor = MpsSupervisor(
        settings=mps_env.settings(handover=True, own_cgroup="gpufrac-mps"),
        driver=DriverVersion.parse("615.20.01"),
        events=sink,
        host_cgroups=lambda: [Hierarchy(name="memory", path=not_a_hierarchy, version=1)],
    )
    try:
        await started(supervisor)
        assert supervisor.daemon_pid is not None  # MPS serves all the same
        (event,) = [e for e in sink.events if e[1] == REASON_IN_AGENT_CGROUP]
        kind, _, message = event
        assert kind == "Warning"
        assert f"MPS control daemon {supervisor.daemon_pid} stays in the node agent's cgroup" in message
        assert "a rolling update" in message and f"cannot move pid {supervisor.daemon_pid} into" in message
    finally:
        await supervisor.stop()
    await until(lambda: not processes_of(mps_env.root / "pipe"), timeout_s=30)
