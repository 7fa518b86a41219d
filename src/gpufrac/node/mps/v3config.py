"""The TOML configuration handed to ``nvidia-cuda-mps-control -p 3 -a`` (REAL).

Follows NVIDIA's "MPS v3 Configuration File" page (schema_version 1.0): one context-share server for all
sm-sharing containers, per-process memory accounting (``features.memacct``) with its audit log, and the
server's ``default`` namespace capped, so a process that reaches the server without going through a
container's namespace socket gets a sliver of the GPU instead of all of it. Container namespaces are
NOT in the file: they are created and deleted at run time with ``namespace create/delete`` and
re-created by the supervisor after every restart (the daemon does not persist run-time changes).
With ``time_slicing_clients`` the default socket is taken out of context sharing, as NVIDIA's operator
does, so time-slicing containers on it are MPS clients (memacct) without sharing a context.
"""

from __future__ import annotations

from gpufrac.node.mps.config import MpsSettings


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_v3_config(*, settings: MpsSettings) -> str:
    server = settings.server_name
    lines = [
        'schema_version = "1.0"',
        "",
        f"[servers.{server}]",
        "",
        f"[servers.{server}.namespaces.default]",
        f"active_thread_percentage = {_quote(str(settings.default_namespace_thread_percentage))}",
        f"pinned_memory_limit = {_quote(settings.default_namespace_pinned_limit)}",
        "",
        "[features.memacct]",
        "enabled = true",
        "audit_log = true",
        "",
        "[features.context-share]",
        "enabled = true",
        # Off when time-slicing containers are clients of the default socket: each then gets a server
        # that shares no context with anyone's (gpufrac.node.mps.default_socket).
        f'default_socket = "{"off" if settings.time_slicing_clients else "on"}"',
        "",
    ]
    return "\n".join(lines)
