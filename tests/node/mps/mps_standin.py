"""STAND-IN MPS control daemon — FOR TESTS ONLY. It controls no GPU and enforces nothing.

It behaves like ``nvidia-cuda-mps-control`` of driver 615 at the interface gpufrac's supervisor uses, so
the supervisor under test is the production code path, run against a separate process through the same
binary-as-client calls it makes on a GPU node. Its grammar and output shapes follow what NVIDIA's GPU
Fractioning Operator verified on driver 615 (docs/mps.md, "Sources", lists each command and its source):

- daemon: ``-f`` (foreground; reads commands on stdin — ``quit`` — and exits at end of file, as the real
  one does) or ``-d`` (background), ``-p 2|3``, ``-m``, ``-a <toml>`` (v3 only), ``-q``; the control
  socket is ``$CUDA_MPS_PIPE_DIRECTORY/control`` (a unix socket, as in real MPS), the pid file
  ``nvidia-cuda-mps-control.pid`` beside it, a log in ``$CUDA_MPS_LOG_DIRECTORY/control.log``.
- a command's protocol (``-p``, default 2) must be the daemon's: a v3 command without ``-p 3`` is refused.
- v3 commands as argv, the server as a flag except for ``namespace get``: ``server list``, ``client list
  [--format=table|csv[,noheader]]`` (the table truncates long PIDs, ``316...``), ``client terminate
  <pid>``, ``namespace create <ns> --server=<s>``, ``namespace set <ns> --server=<s>
  [--active-thread-percentage=N] [--pinned-memory-limit=<n>M]`` (refused while a client is attached),
  ``namespace get <ns> <s> pipe_directory|active_thread_percentage|pinned_memory_limit``, ``namespace
  delete <ns> --server=<s>`` (refused while a client is attached), ``namespace list --server=<s>`` (a
  table), ``quit``. Namespace names must match ``[a-z0-9_]+``, as the real daemon requires.
- classic commands on stdin (``echo get_server_list | ...``): ``get_server_list``, ``get_client_list``,
  ``terminate_client``, ``start_server -uid``, ``set_default_active_thread_percentage``,
  ``get_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``, ``quit``.
- v3 namespace routing on disk: ``<pipe>/<server>/control`` (default namespace) and
  ``<pipe>/<server>/<namespace>/control``; an existing namespace directory is reused, never replaced.
- servers are separate processes whose argv carries ``gpufrac-standin-mps-server``; like real MPS servers
  they outlive a crashed control daemon, which is what the supervisor's stray sweep is for.

A stand-in CUDA client (``--mps-client``) connects to ``$CUDA_MPS_PIPE_DIRECTORY/control``, prints
``connected <server> <namespace> <thread%>`` and ``memory-limit <MiB>M|none`` (the pinned-memory limit it
runs under: the lower of its namespace's and its own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, which memacct
accounts it against) and waits; ``client terminate`` makes it exit with 3, a vanished daemon with 2.
A client of the main control socket goes to the first configured server's ``default`` namespace, or, with
``[features.context-share] default_socket = "off"``, to a ``default`` server of its own started on demand
(not context-shared), as the time-slicing clients of NVIDIA's operator do. With ``--once`` it is a
short-lived test client (gpufrac's MPS probe): it exits 0 as soon as its connection is accepted, as a
CUDA program that only initialises would.

The wedge NVIDIA describes for CUDA <= 13.5 (``wedge-on-kill``): a client killed with GPU work in flight
(its connection drops without a ``client terminate``) orphans that work on its server, and every client
that connects to that server afterwards hangs in CUDA init -- here: its connection is never answered --
while the control plane answers as before (``server list``, ``client list``, ``namespace ...`` unchanged,
the server process alive). Only restarting MPS clears it (a new daemon's servers are clean).

Injectable faults — persistent from ``--fault`` flags or ``$GPUFRAC_STANDIN_FAULTS`` (comma-separated),
one-shot from the lines of ``$GPUFRAC_STANDIN_FAULT_FILE`` (a line is removed when its fault fires, and the
file is re-read at start and on every command, so a test can arm a fault for the next daemon or the next
command): ``crash-after=<s>``, ``crash-on=<command words>``, ``slow-on=<s> <command words>`` (that
command answers ``<s>`` seconds late), ``slow-start=<s>``, ``hang-on-terminate``,
``slow-terminate=<s>`` (a client whose GPU work takes that long to drain), ``ignore-quit``,
``leave-servers``, ``wedge-on-kill`` (above).

The wire protocol between this program's client and daemon halves is its own (one text line, a text
answer); the real daemon's socket protocol is private to NVIDIA and never spoken by gpufrac.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SERVER_MARKER = "gpufrac-standin-mps-server"
#: The server a client of the main control socket gets when no configured server takes it.
DEFAULT_SERVER = "default"
PID_FILE = "nvidia-cuda-mps-control.pid"
_SERVER_KEYS = {
    "allowed_devices",
    "pinned_memory_limit",
    "active_thread_percentage",
    "client_priority",
    "uid",
    "locality_domains",
}
_NAMESPACE_KEYS = {"pinned_memory_limit", "active_thread_percentage", "client_priority"}
#: ``namespace set`` flags and the setting (TOML key) each one sets.
_SET_FLAGS = {
    "active-thread-percentage": "active_thread_percentage",
    "pinned-memory-limit": "pinned_memory_limit",
}
_GET_FIELDS = ("pipe_directory", "active_thread_percentage", "pinned_memory_limit")
_NAME = re.compile(r"[a-z0-9_]+")
_MEMORY = re.compile(r"\d+[KMG]?")
#: The device every stand-in client is listed on (no GPU here).
STANDIN_DEVICE = "GPU-00000000-0000-0000-0000-000000000000"
#: The ``client list`` table's PID column: longer PIDs are cut to 3 digits and ``...`` (captured on 615).
_PID_COLUMN = 6


def _pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def _log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))


class Faults:
    """Persistent faults (flags, env) and one-shot faults (lines of the fault file)."""

    def __init__(self, *, persistent: list[str]) -> None:
        self._persistent = [f.strip() for f in persistent if f.strip()]
        env = os.environ.get("GPUFRAC_STANDIN_FAULTS", "")
        self._persistent += [f.strip() for f in env.split(",") if f.strip()]
        path = os.environ.get("GPUFRAC_STANDIN_FAULT_FILE")
        self._file = Path(path) if path else None

    def _file_lines(self) -> list[str]:
        if self._file is None or not self._file.exists():
            return []
        return [line.strip() for line in self._file.read_text().splitlines() if line.strip()]

    def get(self, name: str, *, when: Callable[[str], bool] = lambda value: True) -> str | None:
        """The value of fault ``name`` (``""`` when it takes none) whose value satisfies ``when``,
        consuming it if it is one-shot."""
        for entry in self._persistent:
            key, _, value = entry.partition("=")
            if key == name and when(value):
                return value
        lines = self._file_lines()
        for i, entry in enumerate(lines):
            key, _, value = entry.partition("=")
            if key == name and when(value):
                assert self._file is not None
                rest = lines[:i] + lines[i + 1 :]
                self._file.write_text("".join(f"{line}\n" for line in rest))
                return value
        return None


@dataclass
class Namespace:
    name: str
    settings: dict[str, str] = field(default_factory=dict)
    listener: asyncio.Server | None = None


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    listener: asyncio.Server | None = None


@dataclass
class Client:
    pid: int
    server: str
    namespace: str
    writer: asyncio.StreamWriter
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    clean: bool = False  # left through `client terminate` or by exiting (its work done), not killed


class CommandError(Exception):
    pass


class StandInDaemon:
    def __init__(
        self, *, protocol: int, multiuser: bool, config: Path | None, faults: Faults, read_stdin: bool
    ) -> None:
        self.protocol = protocol
        self.read_stdin = read_stdin
        self.multiuser = multiuser
        self.config = config
        self.faults = faults
        self.pipe = _pipe_dir()
        self.servers: dict[str, Server] = {}
        self.clients: dict[int, Client] = {}
        self.default_thread_percentage = "100"
        self.default_pinned: dict[str, str] = {}
        #: ``[features.context-share] default_socket``: "off" routes ``<pipe>/control`` clients to a server
        #: of their own (``default``, no context sharing) instead of the first configured server.
        self.default_socket_shared = True
        self.done = asyncio.Event()
        self.wedged: set[str] = set()  # servers with orphaned work: new clients hang (``wedge-on-kill``)
        self._control: asyncio.Server | None = None
        self._log = None

    def log(self, text: str) -> None:
        if self._log is not None:
            self._log.write(f"[{os.getpid()}] {text}\n")
            self._log.flush()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def run(self) -> int:
        _log_dir().mkdir(parents=True, exist_ok=True)
        self._log = (_log_dir() / "control.log").open("a")
        slow = self.faults.get("slow-start")
        if slow:
            self.log(f"fault: slow start {slow}s")
            await asyncio.sleep(float(slow))
        self.pipe.mkdir(parents=True, exist_ok=True)
        control = self.pipe / "control"
        if control.exists():
            if await _listening(control):
                print("An instance of this daemon is already running", file=sys.stderr)
                return 1
            control.unlink()
        servers = self._load_config()
        for name, (settings, namespaces) in servers.items():
            await self._start_server(name=name, settings=settings, namespaces=namespaces)
        self._control = await asyncio.start_unix_server(self._on_control, path=str(control))
        (self.pipe / PID_FILE).write_text(f"{os.getpid()}\n")
        self.log(
            f"started protocol={self.protocol} multiuser={self.multiuser} servers={sorted(self.servers)}"
        )
        crash_after = self.faults.get("crash-after")
        if crash_after:
            asyncio.get_running_loop().call_later(float(crash_after), self._crash, "crash-after")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.done.set)
        loop.add_signal_handler(signal.SIGINT, self.done.set)
        if self.read_stdin:
            self._read_stdin(loop)
        await self.done.wait()
        await self._shutdown()
        return 0

    def _read_stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        """A foreground daemon takes commands on stdin and quits at end of file (so a daemon started with
        a closed stdin exits at once, as the real one does)."""

        def reader() -> None:
            try:
                for line in sys.stdin:
                    if line.strip():
                        asyncio.run_coroutine_threadsafe(self._stdin_command(line.split()), loop)
                loop.call_soon_threadsafe(self._stdin_closed)
            except RuntimeError:  # the daemon stopped (its loop is closed) before its stdin did
                return

        threading.Thread(target=reader, name="stdin", daemon=True).start()

    def _stdin_closed(self) -> None:
        self.log("stdin closed: quitting")
        self.done.set()

    async def _stdin_command(self, command: list[str]) -> None:
        self.log(f"command (stdin): {' '.join(command)}")
        try:
            answer = await self._dispatch(command)
        except CommandError as error:
            answer = f"{error}\n"
        sys.stdout.write(answer)
        sys.stdout.flush()

    def _crash(self, why: str) -> None:
        self.log(f"fault: {why}: crashing")
        os._exit(1)

    def _load_config(self) -> dict[str, tuple[dict[str, str], dict[str, dict[str, str]]]]:
        if self.config is None:
            return {}
        if self.protocol != 3:
            raise SystemExit("-a/--apply needs protocol 3")
        data = tomllib.loads(self.config.read_text())
        if data.get("schema_version") != "1.0":
            raise SystemExit(f"unsupported schema_version {data.get('schema_version')!r}")
        share = data.get("features", {}).get("context-share", {})
        if share.get("default_socket", "on") not in ("on", "off"):
            raise SystemExit(
                f"configuration error: features.context-share.default_socket {share['default_socket']!r} "
                "is not on|off"
            )
        self.default_socket_shared = share.get("default_socket", "on") == "on"
        out: dict[str, tuple[dict[str, str], dict[str, dict[str, str]]]] = {}
        for name, body in data.get("servers", {}).items():
            namespaces = body.pop("namespaces", {})
            body.pop("devices", None)
            unknown = set(body) - _SERVER_KEYS
            if unknown:
                raise SystemExit(f"configuration error: servers.{name}: unknown keys {sorted(unknown)}")
            ns_out: dict[str, dict[str, str]] = {}
            for ns_name, ns_body in namespaces.items():
                if not _NAME.fullmatch(ns_name):
                    raise SystemExit(
                        f"configuration error: servers.{name}.namespaces.{ns_name}: "
                        "a namespace name must match [a-z0-9_]+"
                    )
                unknown = set(ns_body) - _NAMESPACE_KEYS
                if unknown:
                    raise SystemExit(
                        f"configuration error: servers.{name}.namespaces.{ns_name}: "
                        f"unknown keys {sorted(unknown)}"
                    )
                ns_out[ns_name] = {k: str(v) for k, v in ns_body.items()}
            out[name] = ({k: str(v) for k, v in body.items()}, ns_out)
        return out

    async def _start_server(
        self, *, name: str, settings: dict[str, str], namespaces: dict[str, dict[str, str]]
    ) -> Server:
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), SERVER_MARKER, name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        server = Server(name=name, process=process)
        self.servers[name] = server
        if self.protocol == 3:
            directory = self.pipe / name
            directory.mkdir(parents=True, exist_ok=True)
            server.listener = await self._listen(directory / "control", server=name, namespace="default")
            await self._create_namespace(
                server,
                "default",
                {"active_thread_percentage": "100", **settings, **namespaces.get("default", {})},
            )
            for ns_name, ns_settings in namespaces.items():
                if ns_name != "default":
                    await self._create_namespace(server, ns_name, ns_settings)
        self.log(f"server {name} pid={process.pid}")
        return server

    async def _listen(self, path: Path, *, server: str, namespace: str) -> asyncio.Server:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line = (await reader.readline()).decode().strip()
            if line.startswith("CLIENT "):
                await self._serve_client(line.split()[1:], server, namespace, reader, writer)
            else:
                writer.close()

        return await asyncio.start_unix_server(handler, path=str(path))

    async def _create_namespace(self, server: Server, name: str, settings: dict[str, str]) -> None:
        namespace = Namespace(name=name, settings=dict(settings))
        if name != "default" or self.protocol == 3:
            directory = self.pipe / server.name / name
            directory.mkdir(parents=True, exist_ok=True)  # reused if it exists: containers bind-mount it
            directory.chmod(0o755 if not self.multiuser else 0o777)
            try:
                namespace.listener = await self._listen(
                    directory / "control", server=server.name, namespace=name
                )
            except OSError as error:  # e.g. a socket path over sun_path's 108 bytes
                raise CommandError(f"Failed to create namespace {name!r}") from error
        server.namespaces[name] = namespace

    async def _shutdown(self) -> None:
        leave = self.faults.get("leave-servers") is not None
        for client in list(self.clients.values()):
            client.writer.close()
        for server in self.servers.values():
            for namespace in server.namespaces.values():
                if namespace.listener is not None:
                    namespace.listener.close()
                    with contextlib.suppress(FileNotFoundError):
                        (self.pipe / server.name / namespace.name / "control").unlink()
            if server.listener is not None:
                server.listener.close()
            if leave:
                self.log(f"fault: leaving server {server.name} pid={server.process.pid} behind")
                continue
            server.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=5)
        if self._control is not None:
            self._control.close()
        for name in ("control", PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.pipe / name).unlink()
        self.log("stopped")

    # --- clients ---------------------------------------------------------------------------------------

    async def _serve_client(
        self,
        hello: list[str],
        server_name: str | None,
        namespace: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        pid = int(hello[0])
        client_pinned = hello[1] if len(hello) > 1 else ""
        if server_name is None:  # the main control socket: classic, or v3 auto-routing to the first server
            if self.protocol == 3 and not self.default_socket_shared:
                if DEFAULT_SERVER not in self.servers:  # default socket off context sharing: its own server
                    await self._start_server(name=DEFAULT_SERVER, settings={}, namespaces={})
                server_name = DEFAULT_SERVER
            else:
                if not self.servers:
                    await self._start_server(name=DEFAULT_SERVER, settings={}, namespaces={})
                server_name = next(iter(self.servers))
        server = self.servers.get(server_name)
        if server is None or (namespace not in server.namespaces and namespace != "default"):
            writer.close()
            return
        if server_name in self.wedged:  # CUDA init never returns; the control plane knows nothing of it
            self.log(f"client {pid} -> {server_name}/{namespace}: hangs (server has orphaned work)")
            await reader.read()
            writer.close()
            return
        settings = server.namespaces[namespace].settings if namespace in server.namespaces else {}
        threads = settings.get("active_thread_percentage", self.default_thread_percentage)
        memory = _effective_pinned(settings.get("pinned_memory_limit", ""), client_pinned)
        client = Client(pid=pid, server=server_name, namespace=namespace, writer=writer)
        self.clients[pid] = client
        self.log(f"client {pid} -> {server_name}/{namespace} (memacct: pinned limit {memory})")
        writer.write(f"OK {server_name} {namespace} {threads} {memory}\n".encode())
        await writer.drain()
        try:
            if b"BYE" in await reader.read():  # until the client goes away; BYE: it exited normally
                client.clean = True
        finally:
            self.clients.pop(pid, None)
            client.gone.set()
            writer.close()
            if not client.clean and self.faults.get("wedge-on-kill") is not None:
                self.log(f"fault: client {pid} killed with work in flight: server {server_name} wedged")
                self.wedged.add(server_name)

    # --- control commands ------------------------------------------------------------------------------

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode().strip()
        if line.startswith("CLIENT "):
            await self._serve_client(line.split()[1:], None, "default", reader, writer)
            return
        protocol, _, text = line.removeprefix("CMD ").partition(" ")
        command = text.split()
        self.log(f"command: {' '.join(command)}")
        crash_on = self.faults.get(
            "crash-on", when=lambda words: command[: len(words.split())] == words.split()
        )
        if crash_on:
            self._crash(f"crash-on {crash_on}")
        slow = self.faults.get(
            "slow-on", when=lambda spec: command[: len(spec.split()) - 1] == spec.split()[1:]
        )
        if slow:
            self.log(f"fault: slow-on {slow}")
            await asyncio.sleep(float(slow.split()[0]))
        try:
            if protocol != str(self.protocol):
                raise CommandError(
                    f"the MPS control daemon speaks protocol {self.protocol}, this command {protocol} "
                    f"(pass -p {self.protocol})"
                )
            answer = "OK\n" + await self._dispatch(command)
        except CommandError as error:
            answer = f"ERR {error}\n"
        writer.write(answer.encode())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _dispatch(self, words: list[str]) -> str:
        if not words:
            raise CommandError("empty command")
        if words == ["quit"]:
            if self.faults.get("ignore-quit") is not None:
                self.log("fault: ignoring quit")
                return ""
            asyncio.get_running_loop().call_soon(self.done.set)
            return ""
        if self.protocol == 3:
            return await self._dispatch_v3(words)
        return await self._dispatch_classic(words)

    def _server(self, name: str) -> Server:
        server = self.servers.get(name)
        if server is None:
            raise CommandError(f"no server named {name!r}")
        return server

    async def _dispatch_v3(self, words: list[str]) -> str:
        module, verb, rest = words[0], (words[1] if len(words) > 1 else ""), words[2:]
        args = [w for w in rest if not w.startswith("--")]
        flags: dict[str, str] = {}
        for word in rest:
            if word.startswith("--"):
                key, _, value = word[2:].partition("=")
                flags[key] = value
        if (module, verb) == ("server", "list"):
            return "".join(f"{s.name} {s.process.pid}\n" for s in self.servers.values())
        if (module, verb) == ("client", "list"):
            _expect(flags, allowed={"format"}, usage="client list [--format=table|csv[,noheader]]")
            return self._client_list(flags.get("format", "table"))
        if (module, verb) == ("client", "terminate"):
            if len(args) != 1 or not args[0].isdigit() or flags:
                raise CommandError("usage: client terminate <pid>")
            return await self._terminate(int(args[0]))
        if module == "namespace":
            return await self._namespace(verb, args, flags)
        raise CommandError(f"unknown command {' '.join(words)!r}")

    def _client_list(self, form: str) -> str:
        kind, _, header = form.partition(",")
        if kind not in ("table", "csv") or header not in ("", "noheader"):
            raise CommandError(f"unknown format {form!r}; expected table|csv[,noheader]")
        rows = []
        for client in self.clients.values():
            server = self.servers[client.server]
            ns_id = (
                list(server.namespaces).index(client.namespace)
                if client.namespace in server.namespaces
                else 0
            )
            rows.append(
                (
                    client.pid,
                    client.server,
                    f"{client.server}/{client.namespace} ({ns_id})",
                    _comm(client.pid),
                )
            )
        if kind == "csv":
            lines = [f"{pid},{server},{STANDIN_DEVICE},{ns},{cmd}" for pid, server, ns, cmd in rows]
            head = "PID,SERVER,DEVICE,NS,CMD"
        else:
            lines = [
                f"{_cut(str(pid)):<8}{server:<14}{STANDIN_DEVICE:<47}{ns:<26}{cmd}"
                for pid, server, ns, cmd in rows
            ]
            head = f"{'PID':<8}{'SERVER':<14}{'DEVICE':<47}{'MAWS NS':<26}CMD"
        return "".join(f"{line}\n" for line in ([] if header else [head]) + lines)

    async def _terminate(self, pid: int) -> str:
        client = self.clients.get(pid)
        if client is None:
            raise CommandError(f"no client with pid {pid}")
        if self.faults.get("hang-on-terminate") is not None:
            self.log(f"fault: hanging on terminate {pid}")
            await asyncio.Event().wait()
        slow = self.faults.get("slow-terminate")
        if slow:
            self.log(f"fault: client {pid} drains its GPU work for {slow}s")
            await asyncio.sleep(float(slow))
        client.clean = True
        client.writer.write(b"TERMINATE\n")
        with contextlib.suppress(ConnectionError):
            await client.writer.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.gone.wait(), timeout=2.0)
        return ""

    async def _namespace(self, verb: str, args: list[str], flags: dict[str, str]) -> str:
        if verb == "list":
            _expect(flags, allowed={"server"}, required={"server"}, usage="namespace list --server=<server>")
            if args:
                raise CommandError("usage: namespace list --server=<server>")
            return self._namespace_table(self._server(flags["server"]))
        if verb == "get":  # the server is positional here (as on 615), the field names what to print
            if len(args) != 3 or flags:
                raise CommandError(f"usage: namespace get <namespace> <server> <{'|'.join(_GET_FIELDS)}>")
            name, server_name, what = args
            server = self._server(server_name)
            namespace = self._existing(server, name)
            if what not in _GET_FIELDS:
                raise CommandError(f"unknown field {what!r}; expected one of {list(_GET_FIELDS)}")
            if what == "pipe_directory":
                return f"{self.pipe / server.name / name}\n"
            return f"{namespace.settings.get(what, 'N/A')}\n"
        if verb not in ("create", "set", "delete"):
            raise CommandError(f"unknown namespace verb {verb!r}")
        allowed = {"server", *_SET_FLAGS} if verb == "set" else {"server"}
        _expect(
            flags,
            allowed=allowed,
            required={"server"},
            usage=f"namespace {verb} <namespace> --server=<server> ...",
        )
        if len(args) != 1:
            raise CommandError(f"usage: namespace {verb} <namespace> --server=<server> ...")
        name, server = args[0], self._server(flags["server"])
        if not _NAME.fullmatch(name):
            raise CommandError(f"Invalid namespace name {name!r}: only [a-z0-9_]+ is accepted")
        if verb == "create":
            if name in server.namespaces:
                raise CommandError(f"namespace {name!r} already exists on server {server.name!r}")
            await self._create_namespace(server, name, {})
            return ""
        namespace = self._existing(server, name)
        attached = any(c.server == server.name and c.namespace == name for c in self.clients.values())
        if verb == "set":
            settings = {}
            for flag, key in _SET_FLAGS.items():
                if flag in flags:
                    settings[key] = _setting(key, flags[flag])
            if not settings:
                raise CommandError(f"namespace set: nothing to set; expected --{'=, --'.join(_SET_FLAGS)}=")
            if attached:
                raise CommandError(f"Cannot set namespace {name!r}: it has active clients")
            namespace.settings.update(settings)
            return ""
        if name == "default":
            raise CommandError("the default namespace cannot be deleted")
        if attached:
            raise CommandError(f"Cannot delete namespace {name!r}: it has active clients")
        if namespace.listener is not None:
            namespace.listener.close()
        directory = self.pipe / server.name / name
        with contextlib.suppress(FileNotFoundError):
            (directory / "control").unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()
        del server.namespaces[name]
        return ""

    def _existing(self, server: Server, name: str) -> Namespace:
        namespace = server.namespaces.get(name)
        if namespace is None:
            raise CommandError(f"no namespace {name!r} on server {server.name!r}")
        return namespace

    def _namespace_table(self, server: Server) -> str:
        lines = [f"{'NAME':<42}{'ID':<5}{'ACTIVE THREAD %':<17}{'PINNED MEM':<12}CLIENTS"]
        for ns_id, (name, namespace) in enumerate(server.namespaces.items()):
            clients = sum(1 for c in self.clients.values() if c.server == server.name and c.namespace == name)
            threads = namespace.settings.get("active_thread_percentage", "100")
            pinned = namespace.settings.get("pinned_memory_limit", "N/A")
            lines.append(f"{name:<42}{ns_id:<5}{threads:<17}{pinned:<12}{clients}")
        return "".join(f"{line}\n" for line in lines)

    async def _dispatch_classic(self, words: list[str]) -> str:
        verb, args = words[0], words[1:]
        by_pid = {str(s.process.pid): s for s in self.servers.values()}
        if verb == "get_server_list":
            return "".join(f"{pid}\n" for pid in by_pid)
        if verb == "start_server":
            if len(args) != 2 or args[0] != "-uid":
                raise CommandError("usage: start_server -uid <uid>")
            server = await self._start_server(name=f"uid{args[1]}", settings={}, namespaces={})
            return f"{server.process.pid}\n"
        if verb == "get_client_list":
            server = by_pid.get(args[0] if args else "")
            if server is None:
                raise CommandError("usage: get_client_list <server pid>")
            return "".join(f"{c.pid}\n" for c in self.clients.values() if c.server == server.name)
        if verb == "terminate_client":
            if len(args) != 2 or args[0] not in by_pid or not args[1].isdigit():
                raise CommandError("usage: terminate_client <server pid> <client pid>")
            return await self._terminate(int(args[1]))
        if verb == "set_default_active_thread_percentage":
            self.default_thread_percentage = args[0]
            return f"{args[0]}\n"
        if verb == "get_default_active_thread_percentage":
            return f"{self.default_thread_percentage}\n"
        if verb == "set_default_device_pinned_mem_limit":
            self.default_pinned[args[0]] = args[1]
            return ""
        raise CommandError(f"unknown command {' '.join(words)!r}")


def _expect(
    flags: dict[str, str], *, allowed: set[str], usage: str, required: frozenset[str] | set[str] = frozenset()
) -> None:
    unknown = set(flags) - allowed
    missing = set(required) - set(flags)
    if unknown or missing or any(not flags[k] for k in flags):
        raise CommandError(f"usage: {usage}")


def _setting(key: str, value: str) -> str:
    if key == "active_thread_percentage" and not (value.isdigit() and 1 <= int(value) <= 100):
        raise CommandError(f"active thread percentage {value!r} is not an integer in [1, 100]")
    if key == "pinned_memory_limit" and not _MEMORY.fullmatch(value):
        raise CommandError(f"pinned memory limit {value!r} is not <n>[K|M|G]")
    return value


def _mib(value: str) -> int | None:
    match = re.fullmatch(r"(\d+)([KMG]?)", value)
    if match is None:
        return None
    number, unit = int(match[1]), match[2]
    return {"K": number // 1024, "": number // (1024 * 1024), "M": number, "G": number * 1024}[unit]


def _effective_pinned(namespace_limit: str, client_variable: str) -> str:
    """The pinned-memory limit a client runs under, as ``<MiB>M`` or ``none``: the lower of its
    namespace's and its own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for device 0 (a client can only lower
    what the server set)."""
    limits = [_mib(namespace_limit)] if namespace_limit else []
    for entry in client_variable.split(","):
        ordinal, _, value = entry.partition("=")
        if ordinal == "0":
            limits.append(_mib(value))
    known = [limit for limit in limits if limit is not None]
    return f"{min(known)}M" if known else "none"


def _cut(pid: str) -> str:
    return pid if len(pid) <= _PID_COLUMN else pid[:3] + "..."


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


async def _listening(path: Path) -> bool:
    try:
        _, writer = await asyncio.open_unix_connection(str(path))
    except OSError:
        return False
    writer.close()
    return True


async def _send(line: str, *, protocol: int) -> tuple[bool, str]:
    try:
        reader, writer = await asyncio.open_unix_connection(str(_pipe_dir() / "control"))
    except OSError as error:
        return False, f"Cannot find MPS control daemon process ({error})\n"
    writer.write(f"CMD {protocol} {line}\n".encode())
    await writer.drain()
    answer = (await reader.read()).decode()
    writer.close()
    if answer.startswith("OK\n"):
        return True, answer[3:]
    if answer.startswith("ERR "):
        return False, answer[4:]
    return False, "the MPS control daemon closed the connection\n"


async def _client_main(*, once: bool = False) -> int:
    """The stand-in of a CUDA process that became an MPS client (``once``: one that exits when connected)."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(_pipe_dir() / "control"))
    except OSError as error:
        print(f"no MPS control socket: {error}", file=sys.stderr)
        return 1
    pinned = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "").replace(" ", "")
    writer.write(f"CLIENT {os.getpid()} {pinned}\n".encode())
    await writer.drain()
    hello = (await reader.readline()).decode().split()
    if not hello or hello[0] != "OK":
        print("rejected by the MPS daemon", file=sys.stderr)
        return 1
    print(f"connected {' '.join(hello[1:4])}", flush=True)
    print(f"memory-limit {hello[4] if len(hello) > 4 else 'none'}", flush=True)
    if once:  # a CUDA program that exits normally tears its context down first
        writer.write(b"BYE\n")
        await writer.drain()
        writer.close()
        return 0
    message = (await reader.readline()).decode().strip()
    return 3 if message == "TERMINATE" else 2


def _server_main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [SERVER_MARKER]:
        return _server_main()
    parser = argparse.ArgumentParser(prog="nvidia-cuda-mps-control (gpufrac STAND-IN)", allow_abbrev=False)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", "--daemon", action="store_true")
    mode.add_argument("-f", "--foreground", action="store_true")
    mode.add_argument("-q", "--quit", action="store_true")
    mode.add_argument("--mps-client", action="store_true", help="act as a CUDA process using MPS")
    parser.add_argument("--once", action="store_true", help="with --mps-client: exit once connected")
    parser.add_argument("-m", "--multiuser", action="store_true")
    parser.add_argument(
        "-p",
        "--protocol",
        type=int,
        choices=(2, 3),
        default=int(os.environ.get("CUDA_MPS_PROTOCOL_VERSION", "2")),
    )
    parser.add_argument("-a", "--apply", type=Path)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)  # the child of -d
    parser.add_argument("command", nargs="*")
    args, flags = parser.parse_known_args(argv)
    words = [*args.command, *flags]  # a command's own flags (--server=...) follow its positional words
    if flags and not args.command:
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    if args.mps_client:
        return asyncio.run(_client_main(once=args.once))
    if args.daemon:
        child = [a for a in argv if a not in ("-d", "--daemon")]
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "-f", "--detached", *child],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return 0
    if args.foreground:
        daemon = StandInDaemon(
            protocol=args.protocol,
            multiuser=args.multiuser,
            config=args.apply,
            faults=Faults(persistent=args.fault),
            read_stdin=not args.detached,
        )
        return asyncio.run(daemon.run())
    lines = (
        ["quit"]
        if args.quit
        else [" ".join(words)]
        if words
        else [line.strip() for line in sys.stdin if line.strip()]
    )
    status = 0
    for line in lines:
        ok, text = asyncio.run(_send(line, protocol=args.protocol))
        (sys.stdout if ok else sys.stderr).write(text)
        status = status or (0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
