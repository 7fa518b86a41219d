"""The MPS control daemon leaves the node agent's container cgroup, so that it outlives the container (REAL).

Handover (``MpsSettings.handover``) keeps the daemon alive when the agent *process* stops; a rolling
update of the DaemonSet stops the agent *container*, and a runtime stopping a container kills every
process of its cgroup: containerd's runc shim, for a container without a PID namespace of its own (the
agent runs with ``hostPID``), runs ``runc kill --all`` once the container's first process exits, and runc
finds "all" in the container's cgroup. A daemon still in that cgroup dies with the agent's pod, and every
sm-sharing process loses its server. So, once the daemon runs, its pid is written into a cgroup of its own
in every hierarchy (``<hierarchy root>/<name>``, ``gpufrac-mps`` by default); the MPS servers it forks
later start there too.

Which cgroup filesystem. The one the runtime sees: the mounts of PID 1's mount namespace
(``/proc/1/mountinfo``), reached through ``/proc/1/root`` (the agent is privileged and has the host's PID
namespace). Inside the agent's own container a cgroup v1 hierarchy is mounted at the container's own
cgroup (mountinfo's root field names it), and a cgroup created there would stay inside the container's.
When PID 1's root cannot be read, the agent's own mounts serve if they show a hierarchy from its root
(``/``): the agent runs on the host, or the host's ``/`` is mounted into its container.

- cgroup v1 (these test machines): every mounted hierarchy, named ones (``name=systemd``) included, as
  runc puts a container in all of them and which one it reads "all processes" from is runc's business.
  A new v1 cpuset cgroup has no CPUs or memory nodes and refuses tasks: they are copied from its parent.
- cgroup v2: the unified hierarchy (also next to v1 in the hybrid layout). A leaf directly under the
  root, with no controller enabled, accepts a process. NOT DONE: a v2 container in a cgroup namespace of
  its own (containerd's default on v2) cannot move a process out of that namespace (the kernel answers
  ENOENT); that needs entering PID 1's cgroup namespace first. It is reported, as below.

When the move fails (no rights, no host cgroup filesystem in sight, v2 in a private cgroup namespace)
``HostCgroupError`` says which hierarchy and why; the supervisor logs it and puts a Warning Event
``MpsDaemonInAgentCgroup`` on the Node: MPS then still survives an agent crash, not a pod replacement.
"""

from __future__ import annotations

import contextlib
import errno
import re
from dataclasses import dataclass
from pathlib import Path

#: What a cgroup name may be here: one path component, no dot-files.
CGROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


#: cgroup v1 super options that are not controllers (the rest, and ``name=``, name the hierarchy as
#: ``/proc/<pid>/cgroup`` does).
_V1_MOUNT_OPTIONS = frozenset(
    {"rw", "ro", "xattr", "noprefix", "clone_children", "cpuset_v2_mode", "favordynmods"}
)


class HostCgroupError(Exception):
    """The daemon could not leave the agent's cgroup; the message names the hierarchy and the reason."""


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """One mounted cgroup hierarchy, at its root, as the agent reaches it."""

    #: The controllers (``cpu,cpuacct``, ``name=systemd``) of a v1 hierarchy; ``unified`` for v2.
    name: str
    #: Where the agent opens the hierarchy's root: through ``/proc/1/root`` (PID 1's view) or
    #: ``/proc/self/root`` (its own).
    path: Path
    version: int


def _parse_mountinfo(text: str, *, prefix: Path) -> list[Hierarchy]:
    """The cgroup mounts of a mountinfo that show a hierarchy from its root, one per hierarchy."""
    found: dict[str, Hierarchy] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2]
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        if fstype == "cgroup2":
            name, version = "unified", 2
        elif fstype == "cgroup":
            controllers = [
                o
                for o in options.split(",")
                if o.startswith("name=") or ("=" not in o and o not in _V1_MOUNT_OPTIONS)
            ]
            name, version = ",".join(sorted(controllers)), 1
        else:
            continue
        if root != "/" or name in found:
            continue  # a sub-tree (a container's own cgroup mounted as its root), or seen already
        found[name] = Hierarchy(name=name, path=prefix / mount_point.lstrip("/"), version=version)
    return list(found.values())


def host_hierarchies(*, proc: Path = Path("/proc")) -> list[Hierarchy]:
    """The host's cgroup hierarchies as the runtime sees them (module docstring); raises
    ``HostCgroupError`` when none is in sight."""
    reasons = []
    for view in ("1", "self"):
        mountinfo, prefix = proc / view / "mountinfo", proc / view / "root"
        try:
            text = mountinfo.read_text()
            hierarchies = [h for h in _parse_mountinfo(text, prefix=prefix) if h.path.is_dir()]
        except OSError as error:
            reasons.append(f"{mountinfo}: {error.strerror or error}")
            continue
        if hierarchies:
            return hierarchies
        reasons.append(f"{mountinfo} shows no cgroup hierarchy from its root")
    raise HostCgroupError(f"no host cgroup filesystem in sight ({'; '.join(reasons)})")


def _prepare_cpuset(cgroup: Path) -> None:
    """A new v1 cpuset cgroup refuses tasks until it has CPUs and memory nodes: its parent's."""
    for knob in ("cpuset.cpus", "cpuset.mems"):
        own = cgroup / knob
        if own.exists() and not own.read_text().strip():
            own.write_text((cgroup.parent / knob).read_text())


def move_to_own_cgroup(pids: list[int], *, name: str, hierarchies: list[Hierarchy]) -> list[Path]:
    """Writes ``pids[0]`` (the daemon; it must exist) and the rest (its servers, if still alive) into
    ``<hierarchy>/<name>`` of every hierarchy; returns those cgroups. Raises ``HostCgroupError`` naming
    the first hierarchy that refused."""
    if CGROUP_NAME.fullmatch(name) is None:
        raise HostCgroupError(f"cgroup name {name!r} is not one path component ({CGROUP_NAME.pattern})")
    if not pids or min(pids) <= 0:  # 0 in cgroup.procs would mean the writer: the agent itself
        raise HostCgroupError(f"pids {pids} to move: each must be a process id (> 0)")
    moved = []
    for hierarchy in hierarchies:
        cgroup = hierarchy.path / name
        try:
            cgroup.mkdir(exist_ok=True)
            if hierarchy.version == 1 and "cpuset" in hierarchy.name.split(","):
                _prepare_cpuset(cgroup)
            for index, pid in enumerate(pids):
                try:
                    (cgroup / "cgroup.procs").write_text(f"{pid}\n")
                except ProcessLookupError:
                    if index == 0:
                        raise
                    # A server that exited meanwhile: nothing to move.
        except OSError as error:
            hint = ""
            if hierarchy.version == 2 and error.errno == errno.ENOENT:
                hint = " (cgroup v2 from a cgroup namespace of its own cannot move a process out of it)"
            raise HostCgroupError(
                f"cannot move pid {pids[0]} into {cgroup} ({hierarchy.name}): {error.strerror or error}{hint}"
            ) from error
        moved.append(cgroup)
    return moved


def cgroups_of(pid: int, *, proc: Path = Path("/proc")) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as {hierarchy name: path}, with the names ``Hierarchy.name`` uses."""
    found = {}
    with contextlib.suppress(OSError):
        for line in (proc / str(pid) / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            name = ",".join(sorted(controllers.split(","))) if controllers else "unified"
            found[name] = path
    return found
