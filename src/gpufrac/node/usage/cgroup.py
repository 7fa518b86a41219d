"""Host PID → container id, from ``<proc root>/<pid>/cgroup``.

NVML names processes by host PID; the node agent runs with hostPID and reads the host's /proc (mounted
at a configurable root so tests lay out real /proc-style files in a temp dir). The container id is the
last 64-hex component of the process's cgroup path, in every layout the kubelet's runtimes produce:

- cgroup v2, systemd driver: ``0::/kubepods.slice/…/kubepods-pod<uid>.slice/cri-containerd-<id>.scope``
- cgroup v2/v1, cgroupfs:    ``…:/kubepods/burstable/pod<uid>/<id>``
- CRI-O: ``…/crio-<id>.scope`` (``crio-conmon-<id>.scope`` is its monitor, not the container)
- Docker (cri-dockerd): ``…/docker-<id>.scope``

The unified (v2) line is preferred; on v1 the first controller line that names a container decides.
Components after the container's (a process that moved into a sub-cgroup inside its container) are
skipped. Paths may be relative to the agent's cgroup namespace ("/../.."), which is why only the tail
is trusted. A PID that exited between the NVML read and this one answers None.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_CONTAINER = re.compile(r"^(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-f]{64})(?:\.scope)?$")


def container_id_of(*, pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The container id of host process ``pid``, or None (gone, not in a container, unreadable)."""
    # A plain string path and a binary read: pathlib's joins were 40% of a 500-process cycle (bench/).
    try:
        with open(f"{os.fspath(proc_root)}/{pid}/cgroup", "rb") as file:
            text = file.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    return container_id_in(cgroup_file=text)


def container_id_in(*, cgroup_file: str) -> str | None:
    """The container id named by the text of a ``/proc/<pid>/cgroup`` file."""
    unified: str | None = None
    legacy: list[str] = []
    for line in cgroup_file.splitlines():
        hierarchy, _, rest = line.partition(":")
        _controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not _controllers:
            unified = path
        else:
            legacy.append(path)
    for path in ([unified] if unified is not None else []) + legacy:
        found = _from_path(path)
        if found is not None:
            return found
    return None


def _from_path(path: str) -> str | None:
    for component in reversed(path.split("/")):
        match = _CONTAINER.match(component)
        if match is not None:
            return match.group(1)
    return None
