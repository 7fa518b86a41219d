"""MPS namespace names and pipe-directory paths: what the r615 control daemon accepts (REAL).

Two limits of the daemon shape every name gpufrac gives a namespace, both measured on driver 615 by
NVIDIA's GPU Fractioning Operator (kai-scheduler/gpu-fractioning, ``mpsd/internal/mpsns/name.go`` at
ad0bc57; see docs/mps.md, "Sources"):

- a namespace name must match ``[a-z0-9_]+`` (no hyphen, no uppercase): ``ctr-<id>`` is refused;
- the namespace's pipe directory holds a unix socket, and a unix socket path (``sun_path``) is 108 bytes
  including its NUL. A directory too long for its socket makes the daemon fail with no useful message, so
  the length is checked here and reported with the path.

A container's name is derived, not stored: ``gpufrac_<first 12 of the id, sanitised>_<20 hex of the
SHA-256 of the whole id>``. The digest makes it collision-safe (two containers sharing a name would share
a ceiling, and the first removed would delete the other's namespace) whatever the id looks like; the
readable part lets an operator match ``namespace list`` to ``crictl ps``. The derivation is a pure
function, so after an agent restart the runtime's container ids (NRI Synchronize) give the same names
again, and the supervisor records the container id beside each name (``NamespaceSpec.container_id``).
Only names with the ``gpufrac_`` prefix are ever deleted as orphans: a namespace someone else made, the
daemon's ``default`` and a table cell that happens to look like a name are never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

NAMESPACE_PREFIX = "gpufrac_"
_READABLE = 12
_DIGEST_HEX = 20
NAME_RULE = "[a-z0-9_]+"
_NAME = re.compile(NAME_RULE)

#: ``sun_path``: a unix socket path is at most this many bytes, its terminating NUL included.
UNIX_PATH_MAX = 108
#: Room kept in a pipe directory for ``/`` and the longest socket name the daemon creates there
#: (``/control`` is 8; the reference operator keeps 24 so a longer name in a later driver still fits).
SOCKET_NAME_RESERVE = 24
#: The longest pipe directory whose sockets fit in ``sun_path``.
MAX_PIPE_DIR_BYTES = UNIX_PATH_MAX - 1 - SOCKET_NAME_RESERVE


class PipeDirTooLong(ValueError):
    """A pipe directory no unix socket can live in; ``str()`` names the path, its length and the limit."""


def valid_namespace_name(name: str) -> bool:
    """Whether the daemon accepts ``name`` (``[a-z0-9_]+``)."""
    return _NAME.fullmatch(name) is not None


def check_namespace_name(name: str) -> None:
    """Raises ``ValueError`` naming ``name`` and the rule unless the daemon would accept it."""
    if not valid_namespace_name(name):
        raise ValueError(f"MPS namespace name {name!r} does not match {NAME_RULE}")


def namespace_name(container_id: str) -> str:
    """The namespace of container ``container_id``: valid, collision-safe, the same on every call."""
    if not container_id.strip():
        raise ValueError("container id '' cannot name an MPS namespace")
    readable = re.sub(r"[^a-z0-9]", "_", container_id[:_READABLE].lower())
    digest = hashlib.sha256(container_id.encode()).hexdigest()[:_DIGEST_HEX]
    return f"{NAMESPACE_PREFIX}{readable}_{digest}"


def is_managed(name: str) -> bool:
    """Whether ``name`` is one gpufrac derives (and so may delete when no live container owns it)."""
    return name.startswith(NAMESPACE_PREFIX) and valid_namespace_name(name)


def check_pipe_dir(path: str | Path) -> None:
    """Raises ``PipeDirTooLong`` when the sockets of directory ``path`` would not fit in ``sun_path``."""
    size = len(os.fsencode(path))
    if size > MAX_PIPE_DIR_BYTES:
        raise PipeDirTooLong(
            f"MPS pipe directory {str(path)!r} is {size} bytes, over the {MAX_PIPE_DIR_BYTES}-byte limit "
            f"(a unix socket path is at most {UNIX_PATH_MAX} bytes with its NUL, and "
            f"{SOCKET_NAME_RESERVE} are kept for the socket name): shorten mps_pipe_dir"
        )
