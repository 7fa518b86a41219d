"""Fixtures for usage tests: a /proc-style tree on disk and an allocation table.

The proc tree is real files in the layout the kernel uses (``<root>/<pid>/cgroup``, ``<root>/<pid>/comm``)
so attribution reads exactly what it reads on a node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

GIB = 1024**3


@dataclass(frozen=True)
class Record:
    container_id: str
    pod_namespace: str
    pod_name: str
    container_name: str
    devices: Sequence[str]
    request_mib: int
    limit_mib: int
    mode: str = "time-slicing"
    portion: float | None = None
    pod_uid: str = "uid"


@dataclass
class Allocations:
    records: list[Record] = field(default_factory=list)

    def allocations(self) -> Iterable[Record]:
        return list(self.records)


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
def allocations() -> Allocations:
    return Allocations()


@pytest.fixture
def record():
    def make(*, container_id: str, pod_name: str, devices, request_mib: int, **fields) -> Record:
        fields.setdefault("limit_mib", request_mib)
        fields.setdefault("pod_namespace", "team-a")
        fields.setdefault("container_name", "main")
        return Record(
            container_id=container_id, pod_name=pod_name, devices=devices, request_mib=request_mib, **fields
        )

    return make
