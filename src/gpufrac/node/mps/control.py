"""Typed MPS control commands, issued through the control binary acting as a client (REAL).

gpufrac never speaks the daemon's socket protocol (NVIDIA keeps it private); like an operator at a shell
it runs the control binary with ``CUDA_MPS_PIPE_DIRECTORY`` pointing at the daemon. Two grammars:

- v3 (r615+): the scriptable "module verb" syntax as argv, e.g. ``nvidia-cuda-mps-control namespace
  create shared ctr-1a2b active_thread_percentage=25``. A new invocation follows the running daemon's
  protocol, so no ``-p 3`` is needed on command calls.
- classic: one command per line on stdin, as in ``echo get_server_list | nvidia-cuda-mps-control``.

ASSUMPTIONS where NVIDIA's public pages are thin (checked against the stand-in only; to be confirmed on
an r615 node by the GPU check): arguments of ``namespace create/set`` as ``key=value`` using the TOML key
names; ``client list`` prints ``<pid> <server> <namespace>`` per line; ``namespace list <server>`` one name
per line; a failed command exits non-zero with its reason on stderr. Each parser is one small function
here, so a different real format is a local change.

Every command has a timeout. A command that times out raises ``MpsCommandTimeout`` and its client process
is killed; the caller decides what a timeout means (for ``client terminate``: the server is wedged).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from gpufrac.node.mps.mode import MpsMode


class MpsCommandError(Exception):
    """The daemon refused a command or could not be reached; ``str()`` says which command and why."""


class MpsCommandTimeout(MpsCommandError):
    """The control binary did not answer within its timeout."""


@dataclass(frozen=True, slots=True)
class MpsClient:
    pid: int
    server: str
    namespace: str


@dataclass(frozen=True, slots=True)
class MpsControl:
    """Issues commands to the daemon behind ``pipe_dir``."""

    control_bin: str
    pipe_dir: Path
    log_dir: Path
    mode: MpsMode
    timeout_s: float

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    async def run(self, *words: str, timeout_s: float | None = None) -> str:
        """Runs one command and returns its stdout; raises on a non-zero exit or a timeout."""
        text = " ".join(words)
        if self.mode is MpsMode.V3:
            argv, stdin = [self.control_bin, *words], None
        else:
            argv, stdin = [self.control_bin], f"{text}\n".encode()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                env=self.environment(),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as error:
            raise MpsCommandError(f"`{text}`: cannot run {self.control_bin}: {error}") from error
        try:
            out, err = await asyncio.wait_for(
                process.communicate(stdin), timeout=self.timeout_s if timeout_s is None else timeout_s
            )
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise MpsCommandTimeout(f"`{text}`: no answer from the MPS control daemon") from None
        except asyncio.CancelledError:
            # Cancelled by our caller (a bounded drain, a shutdown): never leave the client process behind.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.shield(process.wait())
            raise
        if process.returncode != 0:
            reason = err.decode().strip() or out.decode().strip() or f"exit status {process.returncode}"
            raise MpsCommandError(f"`{text}`: {reason}")
        return out.decode()

    # --- v3 --------------------------------------------------------------------------------------------

    async def list_clients(self) -> list[MpsClient]:
        if self.mode is MpsMode.V3:
            return parse_client_list(await self.run("client", "list"))
        clients = []
        for server_pid in _pids(await self.run("get_server_list")):
            for pid in _pids(await self.run("get_client_list", str(server_pid))):
                clients.append(MpsClient(pid=pid, server=str(server_pid), namespace="default"))
        return clients

    async def terminate_client(self, client: MpsClient, *, timeout_s: float) -> None:
        if self.mode is MpsMode.V3:
            await self.run("client", "terminate", str(client.pid), timeout_s=timeout_s)
        else:
            await self.run("terminate_client", client.server, str(client.pid), timeout_s=timeout_s)

    async def list_namespaces(self, *, server: str) -> list[str]:
        return [
            line.strip()
            for line in (await self.run("namespace", "list", server)).splitlines()
            if line.strip()
        ]

    async def create_namespace(self, *, server: str, name: str, settings: dict[str, str]) -> None:
        await self.run(
            "namespace", "create", server, name, *(f"{k}={v}" for k, v in sorted(settings.items()))
        )

    async def namespace_settings(self, *, server: str, name: str) -> dict[str, str]:
        out = await self.run("namespace", "get", server, name)
        return dict(line.strip().split("=", 1) for line in out.splitlines() if "=" in line)

    async def delete_namespace(self, *, server: str, name: str) -> None:
        await self.run("namespace", "delete", server, name)

    async def quit(self, *, timeout_s: float) -> None:
        await self.run("quit", timeout_s=timeout_s)


def parse_client_list(text: str) -> list[MpsClient]:
    """``<pid> <server> <namespace>`` per line (v3 ``client list``; see the module's assumptions)."""
    clients = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            clients.append(MpsClient(pid=int(parts[0]), server=parts[1], namespace=parts[2]))
    return clients


def _pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]
