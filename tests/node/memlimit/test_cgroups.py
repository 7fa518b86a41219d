"""A container's cgroup path from what the runtime tells NRI: its process first, its cgroups_path else."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.node.memlimit.cgroups import CgroupNotFound, container_cgroup, systemd_path

SCOPE = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podu1.slice/cri-containerd-abc.scope"


def v2_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    (root / SCOPE).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    return root


def proc_with(tmp_path: Path, pid: int, text: str, own: str = "0::/\n") -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(text)
    (proc / "self").mkdir(exist_ok=True)
    (proc / "self" / "cgroup").write_text(own)
    return proc


def test_the_process_decides_on_cgroup_v2(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    proc = proc_with(tmp_path, 42, f"0::/{SCOPE}\n")
    # the runtime's cgroups_path says something else: the process is where the workload runs
    got = container_cgroup(pid=42, cgroups_path="/elsewhere", cgroup_root=root, proc_root=proc)
    assert got == str(root / SCOPE)


def test_a_path_relative_to_the_agent_s_cgroup_namespace(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    proc = proc_with(
        tmp_path, 42, f"0::/../../../{SCOPE}\n", own="0::/kubepods.slice/kubepods-besteffort.slice/agent\n"
    )
    assert container_cgroup(pid=42, cgroups_path="", cgroup_root=root, proc_root=proc) == str(root / SCOPE)


def test_cgroup_v1_uses_the_memory_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "memory" / "kubepods" / "podu1" / "abc").mkdir(parents=True)
    proc = proc_with(tmp_path, 7, "12:cpu,cpuacct:/kubepods/podu1/abc\n4:memory:/kubepods/podu1/abc\n")
    assert container_cgroup(pid=7, cgroups_path="", cgroup_root=root, proc_root=proc) == str(
        root / "memory" / "kubepods" / "podu1" / "abc"
    )


def test_systemd_driver_paths_nest_their_slices() -> None:
    assert systemd_path("kubepods-burstable-podu1.slice:cri-containerd:abc") == "/" + SCOPE
    assert systemd_path("system.slice:docker:abc") == "/system.slice/docker-abc.scope"
    assert systemd_path("/kubepods/podu1/abc") is None


def test_without_a_process_the_cgroups_path_decides(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    got = container_cgroup(
        pid=0, cgroups_path="kubepods-burstable-podu1.slice:cri-containerd:abc", cgroup_root=root
    )
    assert got == str(root / SCOPE)
    (root / "kubepods" / "podu1" / "def").mkdir(parents=True)
    assert container_cgroup(pid=0, cgroups_path="/kubepods/podu1/def", cgroup_root=root) == str(
        root / "kubepods" / "podu1" / "def"
    )


def test_a_missing_cgroup_says_what_was_tried(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    with pytest.raises(CgroupNotFound, match=r"cgroup .*/kubepods/podu1/nope does not exist"):
        container_cgroup(pid=0, cgroups_path="/kubepods/podu1/nope", cgroup_root=root)
    with pytest.raises(CgroupNotFound, match="neither a process nor a cgroups path"):
        container_cgroup(pid=0, cgroups_path="", cgroup_root=root)
    with pytest.raises(CgroupNotFound, match="/proc/99/cgroup unreadable"):
        container_cgroup(pid=99, cgroups_path="", cgroup_root=root, proc_root=tmp_path / "noproc")
