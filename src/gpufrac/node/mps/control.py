"""Typed MPS control commands, issued through the control binary acting as a client (REAL).

gpufrac never speaks the daemon's socket protocol (NVIDIA keeps it private); like an operator at a shell
it runs the control binary with ``CUDA_MPS_PIPE_DIRECTORY`` pointing at the daemon. Two grammars:

- v3 (r615+): the "module verb" syntax as argv, each preceded by ``-p 3`` (the CLI must use the protocol
  the daemon was started with, or it talks to nothing), the server given as a flag::

      nvidia-cuda-mps-control -p 3 client list --format=csv,noheader
      nvidia-cuda-mps-control -p 3 client terminate <pid>
      nvidia-cuda-mps-control -p 3 namespace create <ns> --server=shared
      nvidia-cuda-mps-control -p 3 namespace set <ns> --server=shared --active-thread-percentage=N ...
      nvidia-cuda-mps-control -p 3 namespace get <ns> shared pipe_directory
      nvidia-cuda-mps-control -p 3 namespace delete <ns> --server=shared
      nvidia-cuda-mps-control -p 3 namespace list --server=shared

  as verified against driver 615 by NVIDIA's GPU Fractioning Operator (``mpsd/internal/mpsctl/
  control.go`` and its tests; docs/mps.md lists each command with its source and what is still assumed).
- classic: one command per line on stdin, as in ``echo get_server_list | nvidia-cuda-mps-control``.

Outputs are read defensively, one small parser each: ``client list`` only in its CSV form (the table
form truncates PIDs: ``316...`` for 3165259), the PID only from the first field; ``namespace list``
prints a table whose rows are read for names the daemon would accept, nothing else; ``namespace get ...
pipe_directory`` gives the first absolute path of its output, and none is an error.

Every command has a timeout. A command that times out raises ``MpsCommandTimeout`` and its client process
is killed; the caller decides what a timeout means (for ``client terminate``: the server is wedged).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpufrac.node.mps.mode import MpsMode
from gpufrac.node.mps.names import check_namespace_name, valid_namespace_name

#: The protocol the v3 daemon is started with (``-p 3``); every v3 command repeats it.
V3_PROTOCOL = "3"
#: ``client list`` in its machine-readable form; the table form truncates PIDs (docs/mps.md).
CLIENT_LIST_CSV = "--format=csv,noheader"
#: The ``namespace get`` field naming the directory of a namespace's control socket.
PIPE_DIRECTORY_FIELD = "pipe_directory"
#: The largest PID Linux hands out (``pid_max`` at most 2^22); a larger number is no PID.
MAX_PID = 4 * 1024 * 1024
_NS_CELL = re.compile(r"(?P<server>[^/\s]+)/(?P<namespace>[^\s/(]+)(?:\s*\(\d+\))?")


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

    def invocation(self, *words: str) -> tuple[list[str], bytes | None]:
        """The argv and stdin of one command: v3 as argv after ``-p 3``, classic as a line on stdin."""
        if self.mode is MpsMode.V3:
            return [self.control_bin, "-p", V3_PROTOCOL, *words], None
        return [self.control_bin], f"{' '.join(words)}\n".encode()

    async def run(self, *words: str, timeout_s: float | None = None) -> str:
        """Runs one command and returns its stdout; raises on a non-zero exit or a timeout."""
        text = " ".join(words)
        argv, stdin = self.invocation(*words)
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
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                out, err = await process.communicate(stdin)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise MpsCommandTimeout(f"`{text}`: no answer from the MPS control daemon") from None
        except asyncio.CancelledError:
            # Cancelled by our caller (a shutdown): never leave the client process behind.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await asyncio.shield(process.wait())
            raise
        if process.returncode != 0:
            reason = err.decode().strip() or out.decode().strip() or f"exit status {process.returncode}"
            raise MpsCommandError(f"`{text}`: {reason}")
        return out.decode()

    # --- clients ---------------------------------------------------------------------------------------

    async def list_clients(self) -> list[MpsClient]:
        if self.mode is MpsMode.V3:
            return parse_client_list(await self.run("client", "list", CLIENT_LIST_CSV))
        clients = []
        for server_pid in _pids(await self.run("get_server_list")):
            for pid in _pids(await self.run("get_client_list", str(server_pid))):
                clients.append(MpsClient(pid=pid, server=str(server_pid), namespace="default"))
        return clients

    async def terminate_client(self, client: MpsClient, *, timeout_s: float) -> None:
        """Blocks until the client's outstanding GPU work has drained (that is the point of it)."""
        if self.mode is MpsMode.V3:
            await self.run("client", "terminate", str(client.pid), timeout_s=timeout_s)
        else:
            await self.run("terminate_client", client.server, str(client.pid), timeout_s=timeout_s)

    # --- namespaces (v3) -------------------------------------------------------------------------------

    async def list_namespaces(self, *, server: str) -> list[str]:
        return parse_namespace_list(await self.run("namespace", "list", f"--server={server}"))

    async def create_namespace(self, *, server: str, name: str) -> None:
        _check_name(name)
        await self.run("namespace", "create", name, f"--server={server}")

    async def set_namespace(
        self, *, server: str, name: str, active_thread_percentage: int, pinned_memory_limit: str | None
    ) -> None:
        """``namespace set``: the ceiling (and the pinned-memory limit); refused once a client attached."""
        _check_name(name)
        if not 1 <= active_thread_percentage <= 100:
            raise MpsCommandError(
                f"active_thread_percentage {active_thread_percentage} of MPS namespace {name!r} "
                "is not in [1, 100]"
            )
        flags = [f"--active-thread-percentage={active_thread_percentage}"]
        if pinned_memory_limit is not None:
            flags.append(f"--pinned-memory-limit={pinned_memory_limit}")
        await self.run("namespace", "set", name, f"--server={server}", *flags)

    async def namespace_field(self, *, server: str, name: str, field: str) -> str:
        """``namespace get <ns> <server> <field>`` (the server is positional here, unlike the other
        verbs); the raw answer, stripped."""
        _check_name(name)
        return (await self.run("namespace", "get", name, server, field)).strip()

    async def namespace_pipe_directory(self, *, server: str, name: str) -> Path:
        """The directory of the namespace's control socket, as the daemon reports it."""
        answer = await self.namespace_field(server=server, name=name, field=PIPE_DIRECTORY_FIELD)
        found = parse_pipe_directory(answer)
        if found is None:
            raise MpsCommandError(
                f"`namespace get {name} {server} {PIPE_DIRECTORY_FIELD}`: no absolute path in {answer!r}"
            )
        return found

    async def delete_namespace(self, *, server: str, name: str) -> None:
        _check_name(name)
        await self.run("namespace", "delete", name, f"--server={server}")

    async def quit(self, *, timeout_s: float) -> None:
        """``quit`` through the control binary: for a daemon whose stdin is not ours (a previous agent's)."""
        await self.run("quit", timeout_s=timeout_s)


def parse_client_list(text: str) -> list[MpsClient]:
    """``client list --format=csv,noheader``: ``<pid>,<server>,<device>,<server>/<namespace> (<id>),<cmd>``
    per client (captured on 615). The PID is the whole first field or nothing: the table form's
    truncated ``316...`` and any digits in the other fields are never taken for a PID."""
    clients: list[MpsClient] = []
    seen: set[int] = set()
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if not fields[0].isdigit() or not 0 < int(fields[0]) <= MAX_PID or int(fields[0]) in seen:
            continue
        pid = int(fields[0])
        seen.add(pid)
        server = fields[1] if len(fields) > 1 else ""
        namespace = ""
        for cell in fields[3:4]:
            match = _NS_CELL.fullmatch(cell)
            if match is not None:
                namespace = match.group("namespace")
        clients.append(MpsClient(pid=pid, server=server, namespace=namespace))
    return clients


def parse_namespace_list(text: str) -> list[str]:
    """``namespace list --server=<s>`` prints a table: its header and anything that is not a name the
    daemon accepts are skipped; a row's name is its first cell (``<server>/<name> (<id>)`` is read as
    ``<name>``). A truncated name is no valid name, so it is never mistaken for another namespace."""
    names: list[str] = []
    for line in text.splitlines():
        cells = line.split()
        if not cells:
            continue
        cell = cells[0]
        match = _NS_CELL.fullmatch(" ".join(cells[:2])) or _NS_CELL.fullmatch(cell)
        name = match.group("namespace") if match is not None else cell
        if valid_namespace_name(name) and name not in names:
            names.append(name)
    return names


def parse_pipe_directory(text: str) -> Path | None:
    """The first absolute path in ``text`` (``/p``, ``pipe_directory=/p``, ``pipe_directory: /p``)."""
    for token in re.split(r"[\s=,]+", text):
        token = token.strip("\"'")
        if token.startswith("/"):
            return Path(os.path.normpath(token))
    return None


def _check_name(name: str) -> None:
    """A name the daemon would refuse never reaches it: the error names the name and the rule."""
    try:
        check_namespace_name(name)
    except ValueError as error:
        raise MpsCommandError(str(error)) from None


def _pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]
