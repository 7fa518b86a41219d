"""STAND-IN MPS control daemon — FOR TESTS ONLY. It controls no GPU and enforces nothing.

It behaves like ``nvidia-cuda-mps-control`` at the interface gpufrac's supervisor uses, so the supervisor
under test is the production code path, run against a separate process through the same binary-as-client
calls it makes on a GPU node:

- daemon: ``-f`` (foreground) or ``-d`` (background), ``-p 2|3``, ``-m``, ``-a <toml>`` (v3 only), ``-q``;
  the control socket is ``$CUDA_MPS_PIPE_DIRECTORY/control`` (a unix socket, as in real MPS), the pid file
  ``nvidia-cuda-mps-control.pid`` beside it, a log in ``$CUDA_MPS_LOG_DIRECTORY/control.log``.
- v3 commands as argv (``... namespace create shared ns1 active_thread_percentage=25``): ``server list``,
  ``client list``, ``client terminate <pid>``, ``namespace create|set|get|delete|list``, ``quit``.
- classic commands on stdin (``echo get_server_list | ...``): ``get_server_list``, ``get_client_list``,
  ``terminate_client``, ``start_server -uid``, ``set_default_active_thread_percentage``,
  ``get_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``, ``quit``.
- v3 namespace routing on disk: ``<pipe>/<server>/control`` (default namespace) and
  ``<pipe>/<server>/<namespace>/control``; an existing namespace directory is reused, never replaced.
- servers are separate processes whose argv carries ``gpufrac-standin-mps-server``; like real MPS servers
  they outlive a crashed control daemon, which is what the supervisor's stray sweep is for.

A stand-in CUDA client (``--mps-client``) connects to ``$CUDA_MPS_PIPE_DIRECTORY/control``, prints
``connected <server> <namespace> <thread%>`` and waits; ``client terminate`` makes it exit with 3, a
vanished daemon with 2.

Injectable faults — persistent from ``--fault`` flags or ``$GPUFRAC_STANDIN_FAULTS`` (comma-separated),
one-shot from the lines of ``$GPUFRAC_STANDIN_FAULT_FILE`` (a line is removed when its fault fires, and the
file is re-read at start and on every command, so a test can arm a fault for the next daemon or the next
command): ``crash-after=<s>``, ``crash-on=<command words>``, ``slow-start=<s>``, ``hang-on-terminate``,
``ignore-quit``, ``leave-servers``.

The wire protocol between this program's client and daemon halves is its own (one text line, a text
answer); the real daemon's socket protocol is private to NVIDIA and never spoken by gpufrac.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

SERVER_MARKER = "gpufrac-standin-mps-server"
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

    def get(self, name: str) -> str | None:
        """The value of fault ``name`` (``""`` when it takes none), consuming it if it is one-shot."""
        for entry in self._persistent:
            key, _, value = entry.partition("=")
            if key == name:
                return value
        lines = self._file_lines()
        for i, entry in enumerate(lines):
            key, _, value = entry.partition("=")
            if key == name:
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


class CommandError(Exception):
    pass


class StandInDaemon:
    def __init__(self, *, protocol: int, multiuser: bool, config: Path | None, faults: Faults) -> None:
        self.protocol = protocol
        self.multiuser = multiuser
        self.config = config
        self.faults = faults
        self.pipe = _pipe_dir()
        self.servers: dict[str, Server] = {}
        self.clients: dict[int, Client] = {}
        self.default_thread_percentage = "100"
        self.default_pinned: dict[str, str] = {}
        self.done = asyncio.Event()
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
        await self.done.wait()
        await self._shutdown()
        return 0

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
        out: dict[str, tuple[dict[str, str], dict[str, dict[str, str]]]] = {}
        for name, body in data.get("servers", {}).items():
            namespaces = body.pop("namespaces", {})
            body.pop("devices", None)
            unknown = set(body) - _SERVER_KEYS
            if unknown:
                raise SystemExit(f"configuration error: servers.{name}: unknown keys {sorted(unknown)}")
            ns_out: dict[str, dict[str, str]] = {}
            for ns_name, ns_body in namespaces.items():
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
                await self._serve_client(int(line.split()[1]), server, namespace, reader, writer)
            else:
                writer.close()

        return await asyncio.start_unix_server(handler, path=str(path))

    async def _create_namespace(self, server: Server, name: str, settings: dict[str, str]) -> None:
        namespace = Namespace(name=name, settings=dict(settings))
        if name != "default" or self.protocol == 3:
            directory = self.pipe / server.name / name
            directory.mkdir(parents=True, exist_ok=True)  # reused if it exists: containers bind-mount it
            directory.chmod(0o755 if not self.multiuser else 0o777)
            namespace.listener = await self._listen(directory / "control", server=server.name, namespace=name)
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
        pid: int,
        server_name: str | None,
        namespace: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        if server_name is None:  # the main control socket: classic, or v3 auto-routing to the first server
            if not self.servers:
                await self._start_server(name="default", settings={}, namespaces={})
            server_name = next(iter(self.servers))
        server = self.servers.get(server_name)
        if server is None or (namespace not in server.namespaces and namespace != "default"):
            writer.close()
            return
        settings = server.namespaces[namespace].settings if namespace in server.namespaces else {}
        threads = settings.get("active_thread_percentage", self.default_thread_percentage)
        client = Client(pid=pid, server=server_name, namespace=namespace, writer=writer)
        self.clients[pid] = client
        self.log(f"client {pid} -> {server_name}/{namespace}")
        writer.write(f"OK {server_name} {namespace} {threads}\n".encode())
        await writer.drain()
        try:
            await reader.read()  # until the client goes away
        finally:
            self.clients.pop(pid, None)
            client.gone.set()
            writer.close()

    # --- control commands ------------------------------------------------------------------------------

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode().strip()
        if line.startswith("CLIENT "):
            await self._serve_client(int(line.split()[1]), None, "default", reader, writer)
            return
        command = line.removeprefix("CMD ").split()
        self.log(f"command: {' '.join(command)}")
        crash_on = self.faults.get("crash-on")
        if crash_on and command[: len(crash_on.split())] == crash_on.split():
            self._crash(f"crash-on {crash_on}")
        try:
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
        module, verb, args = words[0], (words[1] if len(words) > 1 else ""), words[2:]
        if (module, verb) == ("server", "list"):
            return "".join(f"{s.name} {s.process.pid}\n" for s in self.servers.values())
        if (module, verb) == ("client", "list"):
            return "".join(f"{c.pid} {c.server} {c.namespace}\n" for c in self.clients.values())
        if (module, verb) == ("client", "terminate"):
            if len(args) != 1 or not args[0].isdigit():
                raise CommandError("usage: client terminate <pid>")
            return await self._terminate(int(args[0]))
        if module == "namespace":
            return await self._namespace(verb, args)
        raise CommandError(f"unknown command {' '.join(words)!r}")

    async def _terminate(self, pid: int) -> str:
        client = self.clients.get(pid)
        if client is None:
            raise CommandError(f"no client with pid {pid}")
        if self.faults.get("hang-on-terminate") is not None:
            self.log(f"fault: hanging on terminate {pid}")
            await asyncio.Event().wait()
        client.writer.write(b"TERMINATE\n")
        with contextlib.suppress(ConnectionError):
            await client.writer.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.gone.wait(), timeout=2.0)
        return ""

    async def _namespace(self, verb: str, args: list[str]) -> str:
        if verb not in ("create", "set", "get", "delete", "list"):
            raise CommandError(f"unknown namespace verb {verb!r}")
        if verb == "list":
            if len(args) != 1:
                raise CommandError("usage: namespace list <server>")
            return "".join(f"{name}\n" for name in self._server(args[0]).namespaces)
        if len(args) < 2:
            raise CommandError(f"usage: namespace {verb} <server> <name> ...")
        server, name, rest = self._server(args[0]), args[1], args[2:]
        settings: dict[str, str] = {}
        for item in rest if verb in ("create", "set") else ():
            key, sep, value = item.partition("=")
            if not sep or key not in _NAMESPACE_KEYS:
                raise CommandError(f"bad setting {item!r}; expected one of {sorted(_NAMESPACE_KEYS)}=<value>")
            if key == "active_thread_percentage" and not (value.isdigit() and 1 <= int(value) <= 100):
                raise CommandError(f"active_thread_percentage {value!r} is not an integer in [1, 100]")
            settings[key] = value
        if verb == "create":
            if name in server.namespaces:
                raise CommandError(f"namespace {name!r} already exists on server {server.name!r}")
            await self._create_namespace(server, name, settings)
            return ""
        namespace = server.namespaces.get(name)
        if namespace is None:
            raise CommandError(f"no namespace {name!r} on server {server.name!r}")
        if verb == "set":
            namespace.settings.update(settings)
            return ""
        if verb == "get":
            return "".join(f"{k}={v}\n" for k, v in sorted(namespace.settings.items()))
        if verb == "delete":
            if name == "default":
                raise CommandError("the default namespace cannot be deleted")
            if any(c.server == server.name and c.namespace == name for c in self.clients.values()):
                raise CommandError(f"namespace {name!r} has connected clients")
            if namespace.listener is not None:
                namespace.listener.close()
            directory = self.pipe / server.name / name
            with contextlib.suppress(FileNotFoundError):
                (directory / "control").unlink()
            with contextlib.suppress(OSError):
                directory.rmdir()
            del server.namespaces[name]
        return ""

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


async def _listening(path: Path) -> bool:
    try:
        _, writer = await asyncio.open_unix_connection(str(path))
    except OSError:
        return False
    writer.close()
    return True


async def _send(line: str) -> tuple[bool, str]:
    try:
        reader, writer = await asyncio.open_unix_connection(str(_pipe_dir() / "control"))
    except OSError as error:
        return False, f"Cannot find MPS control daemon process ({error})\n"
    writer.write(f"CMD {line}\n".encode())
    await writer.drain()
    answer = (await reader.read()).decode()
    writer.close()
    if answer.startswith("OK\n"):
        return True, answer[3:]
    if answer.startswith("ERR "):
        return False, answer[4:]
    return False, "the MPS control daemon closed the connection\n"


async def _client_main() -> int:
    """The stand-in of a CUDA process that became an MPS client."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(_pipe_dir() / "control"))
    except OSError as error:
        print(f"no MPS control socket: {error}", file=sys.stderr)
        return 1
    writer.write(f"CLIENT {os.getpid()}\n".encode())
    await writer.drain()
    hello = (await reader.readline()).decode().split()
    if not hello or hello[0] != "OK":
        print("rejected by the MPS daemon", file=sys.stderr)
        return 1
    print(f"connected {' '.join(hello[1:])}", flush=True)
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
    parser = argparse.ArgumentParser(prog="nvidia-cuda-mps-control (gpufrac STAND-IN)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-d", "--daemon", action="store_true")
    mode.add_argument("-f", "--foreground", action="store_true")
    mode.add_argument("-q", "--quit", action="store_true")
    mode.add_argument("--mps-client", action="store_true", help="act as a CUDA process using MPS")
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
    parser.add_argument("command", nargs="*")
    args = parser.parse_args(argv)
    if args.mps_client:
        return asyncio.run(_client_main())
    if args.daemon:
        child = [a for a in argv if a not in ("-d", "--daemon")]
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "-f", *child],
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
        )
        return asyncio.run(daemon.run())
    lines = (
        ["quit"]
        if args.quit
        else [" ".join(args.command)]
        if args.command
        else [line.strip() for line in sys.stdin if line.strip()]
    )
    status = 0
    for line in lines:
        ok, text = asyncio.run(_send(line))
        (sys.stdout if ok else sys.stderr).write(text)
        status = status or (0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
