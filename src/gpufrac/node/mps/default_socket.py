"""Time-slicing containers as MPS clients of the default server: a second memory guard (REAL, opt-in).

NVIDIA's GPU Fractioning Operator puts every time-slicing container on the MPS daemon's default socket
(``<pipe>/control``, context sharing off for it), so each of its processes is an MPS client: the daemon's
memory accounting (``memacct``) sees it by PID, and its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` caps it even
where the container toolkit's ``apply-cuda-memory-limits`` hook (the cgroup limit) is missing.

gpufrac does the same when ``MpsSettings.time_slicing_clients`` is on, with one difference the reference
does not make: the container does not get the node's pipe directory, which also holds
``<server>/<namespace>/`` of every sm-sharing tenant (a container given it could join another tenant's
namespace and use its compute share). It gets a directory of its own, ``<pipe>/tsclients/<namespace
name>``, holding one entry: ``control``, a hard link to the daemon's ``<pipe>/control``. A hard link of a
unix socket is the same socket (connect() reaches the listener of that inode), and a link in a directory
the container has bind-mounted is visible there when it is replaced. The daemon makes a new socket at every
start, so the links are made again whenever the daemon becomes READY (``refresh``, called by the
supervisor) — a link left on the old inode would refuse connections.

Why opt-in (docs/mps.md, "Which guard enforces what"): ``<pipe>/control`` is also where control commands
are sent. A container that can reach it can run ``nvidia-cuda-mps-control`` itself, and a root process
there is the daemon's owner: it could ``client terminate`` another tenant's processes or ``quit`` MPS for
the node. And what the container gets in return is a guard it can undo (a process that re-exports
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` before ``cuInit`` escapes it). So it is right where tenants are
trusted not to be hostile and the toolkit hook is missing; the cgroup limit stays the guard to rely on.

ASSUMED (confirm on an r615 node): a CUDA client needs no entry of the pipe directory other than
``control`` (the stand-in's clients do not), and the daemon tolerates a directory of ours in its pipe
directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from gpufrac.node.mps.names import check_pipe_dir, namespace_name

log = logging.getLogger(__name__)

#: The directory under the pipe directory that holds one sub-directory per time-slicing container.
CLIENTS_DIR = "tsclients"
CONTROL_SOCKET = "control"


class DefaultSocketLinks:
    """One directory per time-slicing container holding a hard link to the daemon's default socket.

    The directories live under the pipe directory on purpose: a hard link needs the same filesystem.
    """

    def __init__(self, *, pipe_dir: Path) -> None:
        self._pipe_dir = pipe_dir
        self._root = pipe_dir / CLIENTS_DIR
        self._live: set[str] = set()

    def directory(self, container_id: str) -> Path:
        return self._root / namespace_name(container_id)

    def add(self, container_id: str) -> Path:
        """Makes the container's directory and links it to the default socket if the daemon has one
        (otherwise the next ``refresh`` does). Raises ``PipeDirTooLong`` before making anything when the
        socket path would not fit in ``sun_path``."""
        directory = self.directory(container_id)
        check_pipe_dir(directory)
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)  # any uid may reach the socket; only the agent changes the directory
        self._live.add(container_id)
        self._link(directory)
        return directory

    def remove(self, container_id: str) -> None:
        self._live.discard(container_id)
        directory = self.directory(container_id)
        with contextlib.suppress(FileNotFoundError):
            (directory / CONTROL_SOCKET).unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()

    def set_live(self, container_ids: Iterable[str]) -> None:
        """The runtime's live time-slicing containers (Synchronize): the others' directories go."""
        live = set(container_ids)
        known = {p.name for p in self._root.iterdir()} if self._root.is_dir() else set()
        wanted = {namespace_name(cid): cid for cid in live}
        for name in known - set(wanted):
            with contextlib.suppress(FileNotFoundError):
                (self._root / name / CONTROL_SOCKET).unlink()
            with contextlib.suppress(OSError):
                (self._root / name).rmdir()
        self._live = set()
        for cid in live:
            try:
                self.add(cid)
            except (OSError, ValueError) as error:  # PipeDirTooLong is a ValueError; others still linked
                log.warning("MPS default socket not linked for container %s: %s", cid, error)

    def refresh(self) -> None:
        """Points every live container's link at the daemon's current socket (after every daemon start)."""
        for cid in sorted(self._live):
            try:
                self._link(self.directory(cid))
            except OSError as error:  # that container stays without MPS until the next start; others not
                log.warning("MPS default socket not linked for container %s: %s", cid, error)

    def _link(self, directory: Path) -> None:
        socket = self._pipe_dir / CONTROL_SOCKET
        target = directory / CONTROL_SOCKET
        staged = directory / f".{CONTROL_SOCKET}.new"
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        try:
            os.link(socket, staged)
        except FileNotFoundError:
            return  # no daemon socket yet: the refresh at READY links it
        os.replace(staged, target)  # atomic: a process in the container never sees no `control`
        # rename(2) of two links to one inode does nothing and succeeds: relinking a directory already on
        # the current socket (every Synchronize) would leave the staged name behind, and the directory
        # could then never be removed.
        staged.unlink(missing_ok=True)
