"""Drives ``gpufrac-nriruntime`` (testenv/nriruntime): NRI's real runtime-side adaptation, one process.

The test environment has no containerd, but NRI's runtime half is a Go library (what containerd embeds),
so testenv builds it into a small program that listens on an NRI socket and runs pods and containers
through it on command. This module starts that program and speaks its JSON-lines protocol: a pod
sandbox, a container create (answered with NRI's merged adjustment and the container as adjusted, or the
error a plugin failed it with), start/stop/remove, waiting for plugins, and a restart that drops every
plugin connection the way a runtime restart does. The simulated kubelet creates its containers through
it, and the node agent's tests use it to reach the NRI plugin only through the real adaptation.

Pods and containers travel as protobuf JSON of NRI's own messages, so the keyword arguments map onto
``api.PodSandbox`` / ``api.Container`` fields one to one.

With ``cgroup_root`` the runtime also does what runc does with a container's cgroup, SIMULATED as plain
directories: a created container gets ``<cgroup_root><cgroups_path>`` (default ``/kubepods/pod<pod
id>/<id>``, the cgroupfs driver's layout) and its ``linux.cgroups_path`` says so; a removed one loses it.
The node agent's simulated driver keys its memory limits by those directories, as NVML keys them by
the real cgroups, so the same agent code sets and reads back limits here and on a real node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BINARY_ENV = "GPUFRAC_NRIRUNTIME"
DEFAULT_BINARY = Path(__file__).resolve().parents[3] / "testenv" / "bin" / "gpufrac-nriruntime"


class NriRuntimeError(RuntimeError):
    """The runtime program failed a command (the message is its error)."""


class ContainerCreateFailed(NriRuntimeError):
    """CreateContainer failed: a plugin refused the container (the message says which and why)."""


@dataclass(frozen=True, slots=True)
class CreatedContainer:
    """A container as NRI's adaptation left it after every plugin's adjustment."""

    id: str
    env: dict[str, str]
    mounts: list[dict[str, Any]]
    cdi_devices: list[str]
    adjust: dict[str, Any]
    elapsed_ns: int

    @property
    def removed_env(self) -> list[str]:
        """Variables the adjustment removes (NRI marks a removal with a leading ``-``)."""
        return [e["key"][1:] for e in self.adjust.get("env", []) if e.get("key", "").startswith("-")]

    def mount_at(self, destination: str) -> dict[str, Any] | None:
        return next((m for m in self.mounts if m.get("destination") == destination), None)


def binary_path() -> Path:
    return Path(os.environ.get(BINARY_ENV, str(DEFAULT_BINARY)))


def _env_list(env: Mapping[str, str] | Sequence[str]) -> list[str]:
    if isinstance(env, Mapping):
        return [f"{key}={value}" for key, value in env.items()]
    return list(env)


def _env_map(entries: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        key, _, value = entry.partition("=")
        out[key] = value
    return out


class NriRuntime:
    """One ``gpufrac-nriruntime`` process; an async context manager (start/stop)."""

    def __init__(
        self,
        *,
        socket_path: Path,
        binary: Path | None = None,
        request_timeout_s: float = 2.0,
        registration_timeout_s: float = 5.0,
        log_level: str = "warning",
        default_validator: bool = False,
        required_plugins: Sequence[str] = (),
        cgroup_root: Path | None = None,
        toolkit_hook: Callable[..., bool] | None = None,
    ) -> None:
        """``toolkit_hook`` plays the NVIDIA toolkit's memory-limit hook on every created container's
        cgroup (``gpufrac.node.memlimit.simulated.SimulatedToolkitHook``); None: no toolkit.
        ``cgroup_root``: where created containers get a (SIMULATED) cgroup directory; None: none.
        ``default_validator`` turns on NRI's built-in default validator (containerd's
        ``default_validator`` section): a container whose pod requires a plugin that is not connected
        (``required-plugins.noderesource.dev``, or ``required_plugins`` for every container) is refused."""
        self.socket_path = socket_path
        self.cgroup_root = cgroup_root
        self._toolkit_hook = toolkit_hook
        self._cgroups: dict[str, Path] = {}
        if cgroup_root is not None:  # a cgroup v2 root, as the agent recognises one
            cgroup_root.mkdir(parents=True, exist_ok=True)
            (cgroup_root / "cgroup.controllers").touch()
        self._binary = binary or binary_path()
        self._args = [
            "-socket",
            str(socket_path),
            "-request-timeout",
            f"{int(request_timeout_s * 1000)}ms",
            "-registration-timeout",
            f"{int(registration_timeout_s * 1000)}ms",
            "-log-level",
            log_level,
        ]
        if default_validator:
            self._args.append("-default-validator")
            if required_plugins:
                self._args += ["-required-plugins", ",".join(required_plugins)]
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> NriRuntime:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        if not self._binary.exists():
            raise FileNotFoundError(
                f"{self._binary} is missing: build it with `bash testenv/nriruntime/build.sh` (make testenv)"
            )
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = await asyncio.create_subprocess_exec(
            str(self._binary),
            *self._args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 << 20,
        )
        await self._expect_ready()

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(ConnectionError):
                    proc.stdin.write(b'{"op":"exit"}\n')
                    await proc.stdin.drain()
                await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def _expect_ready(self) -> dict[str, Any]:
        line = await self._read()
        if line.get("event") != "ready":
            raise NriRuntimeError(f"gpufrac-nriruntime did not start: {line.get('error', line)}")
        return line

    async def _read(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        raw = await self._proc.stdout.readline()
        if not raw:
            code = await self._proc.wait()
            raise NriRuntimeError(f"gpufrac-nriruntime exited ({code})")
        return json.loads(raw)

    async def command(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one command and return its reply; raises ``NriRuntimeError`` when it failed."""
        reply = await self._exchange({"op": op, **fields})
        if not reply.get("ok"):
            raise NriRuntimeError(reply.get("error", "failed"))
        return reply

    async def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._proc is None or self._proc.stdin is None:
            raise NriRuntimeError("gpufrac-nriruntime is not running")
        async with self._lock:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            await self._proc.stdin.drain()
            return await self._read()

    # -- pods and containers ----------------------------------------------------------------------------

    async def run_pod(
        self,
        *,
        id: str,
        name: str,
        namespace: str,
        uid: str,
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        pod = {
            "id": id,
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "annotations": dict(annotations or {}),
            "labels": dict(labels or {}),
        }
        await self.command("run_pod", pod=pod)

    async def create_container(
        self,
        *,
        id: str,
        pod_id: str,
        name: str,
        env: Mapping[str, str] | Sequence[str] = (),
        mounts: Sequence[Mapping[str, Any]] = (),
        annotations: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        cdi_devices: Sequence[str] = (),
        cgroups_path: str | None = None,
    ) -> CreatedContainer:
        """Create through every connected plugin; raises ``ContainerCreateFailed`` when one refuses.

        ``cdi_devices`` are the CDI devices the container has before NRI: containerd reports the CRI
        container config's, i.e. a device plugin's CDI response as the kubelet hands it over."""
        container = {
            "id": id,
            "pod_sandbox_id": pod_id,
            "name": name,
            "env": _env_list(env),
            "mounts": [dict(m) for m in mounts],
            "annotations": dict(annotations or {}),
            "args": list(args),
            "CDI_devices": [{"name": n} for n in cdi_devices],
        }
        if cgroups_path is None and self.cgroup_root is not None:
            cgroups_path = f"/kubepods/pod{pod_id}/{id}"
        if cgroups_path is not None:
            container["linux"] = {"cgroups_path": cgroups_path}
        reply = await self._exchange({"op": "create_container", "container": container})
        if not reply.get("ok"):
            raise ContainerCreateFailed(reply.get("error", "failed"))
        if self.cgroup_root is not None and cgroups_path is not None:  # what runc's create makes
            cgroup = self.cgroup_root / cgroups_path.lstrip("/")
            cgroup.mkdir(parents=True, exist_ok=True)
            self._cgroups[id] = cgroup
            if self._toolkit_hook is not None:  # the OCI hook runs inside runc's create
                self._toolkit_hook(env=_env_map(reply["container"].get("env", [])), cgroup=str(cgroup))
        created = reply["container"]
        return CreatedContainer(
            id=id,
            env=_env_map(created.get("env", [])),
            mounts=created.get("mounts", []),
            cdi_devices=[d["name"] for d in created.get("CDI_devices", [])],
            adjust=reply.get("adjust", {}),
            elapsed_ns=int(reply.get("elapsed_ns", 0)),
        )

    async def start_container(self, id: str) -> int:
        """Start through every connected plugin; raises ``NriRuntimeError`` when one refuses. Returns the
        nanoseconds the adaptation's StartContainer took (what the runtime waits for)."""
        reply = await self.command("start_container", id=id)
        return int(reply.get("elapsed_ns", 0))

    async def stop_container(self, id: str) -> None:
        await self.command("stop_container", id=id)

    async def remove_container(self, id: str) -> None:
        await self.command("remove_container", id=id)
        cgroup = self._cgroups.pop(id, None)
        if cgroup is not None:
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    async def stop_pod(self, id: str) -> None:
        await self.command("stop_pod", id=id)

    async def remove_pod(self, id: str) -> None:
        await self.command("remove_pod", id=id)

    async def list(self) -> dict[str, Any]:
        return await self.command("list")

    # -- plugins ----------------------------------------------------------------------------------------

    async def wait_plugins(self, count: int = 1, *, timeout_s: float = 10.0) -> int:
        """Wait until ``count`` plugins are registered, configured and synchronized."""
        reply = await self.command("wait_plugins", count=count, timeout_ms=int(timeout_s * 1000))
        return int(reply["plugins"])

    async def wait_registrations(self, count: int, *, timeout_s: float = 10.0) -> int:
        """Wait until ``count`` plugins have registered and synchronized since the runtime (re)started
        (``list()["registrations"]`` says how many have); unlike the plugin count, a plugin that has gone
        but is not pruned yet cannot make it look like a new one is in."""
        reply = await self.command("wait_registrations", count=count, timeout_ms=int(timeout_s * 1000))
        return int(reply["registrations"])

    async def restart(self) -> None:
        """Restart the runtime: every plugin connection drops; pods and containers are kept, and the
        plugins that reconnect are synchronized with them."""
        async with self._lock:
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write(b'{"op":"restart"}\n')
            await self._proc.stdin.drain()
            reply = await self._read()
            if not reply.get("ok"):
                raise NriRuntimeError(reply.get("error", "restart failed"))
            await self._expect_ready()
