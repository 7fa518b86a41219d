"""Fixtures for usage tests: a /proc-style tree on disk and the node's mapping store.

The proc tree is real files in the layout the kernel uses (``<root>/<pid>/cgroup``, ``<root>/<pid>/comm``)
so attribution reads exactly what it reads on a node.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.node.mapping import AllocationRecord, MappingStore

GIB = 1024**3


class ProcTree:
    """Writes /proc/<pid>/cgroup files for containers under a temp root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def containerd_v2(self, *, pid: int, container_id: str, pod_uid: str = "0a1b") -> None:
        slice_ = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
        self.write(
            pid=pid,
            cgroup=f"0::/kubepods.slice/kubepods-burstable.slice/{slice_}/cri-containerd-{container_id}.scope\n",
        )

    def crio_v1(self, *, pid: int, container_id: str, pod_uid: str = "0a1b") -> None:
        path = f"/kubepods.slice/kubepods-pod{pod_uid}.slice/crio-{container_id}.scope"
        self.write(
            pid=pid,
            cgroup="".join(f"{n}:{c}:{path}\n" for n, c in ((12, "pids"), (11, "memory"), (4, "cpu,cpuacct")))
            + "1:name=systemd:/system.slice/crio.service\n",
        )

    def cgroupfs_v1(self, *, pid: int, container_id: str, pod_uid: str = "0a1b") -> None:
        self.write(pid=pid, cgroup=f"10:memory:/kubepods/burstable/pod{pod_uid}/{container_id}\n")

    def host(self, *, pid: int, comm: str = "python3") -> None:
        self.write(pid=pid, cgroup="0::/user.slice/user-1000.slice/session-3.scope\n", comm=comm)

    def write(self, *, pid: int, cgroup: str, comm: str = "python3") -> None:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(cgroup)
        (d / "comm").write_text(comm + "\n")


@pytest.fixture
def proc(tmp_path: Path) -> ProcTree:
    return ProcTree(tmp_path / "proc")


@pytest.fixture
def allocations(tmp_path: Path) -> MappingStore:
    """The node agent's real mapping store, in a temp state directory."""
    return MappingStore(directory=tmp_path / "state")


@pytest.fixture
def record():
    """Builds the record the NRI plugin writes for a fractional container."""

    def make(*, container_id: str, pod_name: str, devices, request_mib: int, **fields) -> AllocationRecord:
        fields.setdefault("limit_mib", request_mib)
        fields.setdefault("pod_namespace", "team-a")
        fields.setdefault("container_name", "main")
        fields.setdefault("pod_uid", f"uid-{pod_name}")
        fields.setdefault("mode", "time-slicing")
        fields.setdefault("portion", None)
        return AllocationRecord(
            container_id=container_id,
            pod_name=pod_name,
            devices=tuple(devices),
            request_mib=request_mib,
            **fields,
        )

    return make
