"""Which cgroup a container lives in, as the full sysfs path the driver's memory limit is keyed by.

The runtime tells NRI two things: the container's ``linux.cgroups_path`` (what it asked runc for) and,
from StartContainer on, the pid of its init process. The pid is the truth: its ``/proc/<pid>/cgroup`` is
the cgroup the workload will run in, whatever the runtime's cgroup driver made of the path. So the path
is read from the process when there is one, and derived from ``cgroups_path`` otherwise:

- cgroup v2: the unified line ``0::/kubepods.slice/.../cri-containerd-<id>.scope``; v1: the ``memory``
  controller's line, under ``<root>/memory``;
- a path relative to the agent's own cgroup namespace (``/../..``) is joined to the agent's cgroup;
- ``cgroups_path`` in the systemd driver's form ``<slice>:<prefix>:<name>``
  (``kubepods-burstable-pod<uid>.slice:cri-containerd:<id>``) becomes
  ``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``,
  as systemd nests slices by their dash-separated prefixes; the cgroupfs driver's form is a plain path.

``cgroup_root`` is where the agent sees the host's cgroup filesystem (``/sys/fs/cgroup`` in its
privileged pod; a directory the simulated runtime fills in the embedded cluster).
"""

from __future__ import annotations

import os
from pathlib import Path


class CgroupNotFound(Exception):
    """The container's cgroup could not be resolved, or it does not exist; the message says what was tried."""


def is_unified(cgroup_root: Path) -> bool:
    """cgroup v2 mounted at ``cgroup_root`` (its root has ``cgroup.controllers``)."""
    return (cgroup_root / "cgroup.controllers").exists()


def path_in_proc(cgroup_file: str, *, unified: bool) -> str | None:
    """The cgroup path of a ``/proc/<pid>/cgroup`` text: the unified line on v2, the memory line on v1."""
    for line in cgroup_file.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if unified and hierarchy == "0" and not controllers:
            return path
        if not unified and "memory" in controllers.split(","):
            return path
    return None


def systemd_path(cgroups_path: str) -> str | None:
    """The cgroup path of the systemd driver's ``slice:prefix:name``; None when it is not of that form."""
    parts = cgroups_path.split(":")
    if len(parts) != 3 or "/" in cgroups_path:
        return None
    slice_name, prefix, name = parts
    nested: list[str] = []
    if slice_name and slice_name != "-.slice":
        if not slice_name.endswith(".slice"):
            return None
        stem = slice_name.removesuffix(".slice")
        pieces = stem.split("-")
        nested = ["-".join(pieces[: i + 1]) + ".slice" for i in range(len(pieces))]
    unit = (
        name
        if name.endswith((".scope", ".slice"))
        else f"{prefix}-{name}.scope"
        if prefix
        else f"{name}.scope"
    )
    return "/" + "/".join([*nested, unit])


def container_cgroup(
    *,
    pid: int,
    cgroups_path: str,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_root: Path = Path("/proc"),
) -> str:
    """The full path of the container's cgroup under ``cgroup_root``; raises ``CgroupNotFound``."""
    unified = is_unified(cgroup_root)
    base = str(cgroup_root) if unified else str(cgroup_root / "memory")
    tried: list[str] = []
    relative: str | None = None
    if pid > 0:
        try:
            text = (proc_root / str(pid) / "cgroup").read_text()
        except OSError as exc:
            tried.append(f"/proc/{pid}/cgroup unreadable ({exc.strerror or exc})")
        else:
            relative = path_in_proc(text, unified=unified)
            if relative is not None and relative.startswith("/.."):
                own = path_in_proc((proc_root / "self" / "cgroup").read_text(), unified=unified) or "/"
                relative = os.path.normpath(f"{own}/{relative}")
            if relative is None:
                tried.append(f"/proc/{pid}/cgroup names no {'unified' if unified else 'memory'} cgroup")
    if relative is None and cgroups_path:
        relative = systemd_path(cgroups_path) or (cgroups_path if cgroups_path.startswith("/") else None)
        if relative is None:
            tried.append(f"cgroups_path {cgroups_path!r} is neither a path nor slice:prefix:name")
    if relative is None:
        raise CgroupNotFound(
            "the runtime gave neither a process nor a cgroups path"
            + (f" ({'; '.join(tried)})" if tried else "")
        )
    full = os.path.normpath(f"{base}/{relative.lstrip('/')}")
    if not os.path.isdir(full):
        raise CgroupNotFound(f"cgroup {full} does not exist" + (f" ({'; '.join(tried)})" if tried else ""))
    return full
