"""Test harness: the real supervisor pointed at the STAND-IN control daemon, run as a separate process.

Paths are short on purpose (unix socket paths are limited to 107 bytes) and every test stops its
supervisor in a ``finally``, then checks no process of its pipe directory is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mps_standin import SERVER_MARKER

from gpufrac.node.mps.config import BackoffSettings, MpsSettings
from gpufrac.node.mps.hostcgroup import HostCgroupError, host_hierarchies
from gpufrac.node.mps.supervisor import MpsSupervisor

#: The stand-in control daemon's program (a test double: it lives with the tests, run as a script).
STANDIN = Path(__file__).with_name("mps_standin.py")
#: NRI's plugin request timeout in the tests that put the stand-in behind NRI. An sm-sharing
#: CreateContainer runs three control commands (namespace create, set, get); the real control binary
#: answers each in milliseconds, well inside containerd's 2 s, but each stand-in command is a Python
#: process (~0.3 s, several times that on a loaded test machine), and past the timeout the runtime creates
#: the container without the plugin's adjustment.
STANDIN_NRI_REQUEST_TIMEOUT_S = 6.0


@dataclass
class RecordingSink:
    """An EventSink that keeps what it is given (the seam's test side; the Events are the result)."""

    events: list[tuple[str, str, str]] = field(default_factory=list)

    def emit(self, *, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


def processes_of(pipe_dir: Path) -> list[int]:
    """Pids of live processes started for ``pipe_dir`` (daemon, servers, clients we spawned)."""
    found = []
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(item.startswith(needle) for item in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


@dataclass
class MpsEnv:
    root: Path
    bin: Path
    fault_file: Path

    def settings(self, **overrides: object) -> MpsSettings:
        base: dict[str, object] = dict(
            control_bin=str(self.bin),
            server_marker=SERVER_MARKER,
            pipe_dir=self.root / "pipe",
            log_dir=self.root / "log",
            state_dir=self.root / "state",
            ready_timeout_s=10.0,
            command_timeout_s=5.0,
            create_wait_s=1.0,
            quit_timeout_s=3.0,
            kill_timeout_s=3.0,
            # The active probe's test client: the stand-in's short-lived client (a CUDA program there).
            probe_command=(str(self.bin), "--mps-client", "--once"),
            backoff=BackoffSettings(initial_s=0.05, factor=2.0, max_s=0.4, stable_s=30.0, degraded_after=3),
        )
        base.update(overrides)
        return MpsSettings(**base)  # type: ignore[arg-type]

    @property
    def proc_root(self) -> Path:
        """A /proc of cgroup files only: where the stand-in clients are put into containers (the test
        machine cannot run processes in a kubelet's container cgroups; the file layout is containerd's)."""
        return self.root / "proc"

    def in_container(self, pid: int, container_id: str) -> None:
        """Makes ``pid`` a process of container ``container_id`` as ``/proc/<pid>/cgroup`` tells it."""
        directory = self.proc_root / str(pid)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/"
            f"cri-containerd-{container_id}.scope\n"
        )

    def commands(self) -> list[str]:
        """The argv of every control-binary invocation so far (daemon, commands, clients), in order."""
        log = self.root / "argv.log"
        return log.read_text().splitlines() if log.exists() else []

    def arm(self, *faults: str) -> None:
        """One-shot faults for the next daemon start / command."""
        self.fault_file.write_text("".join(f"{f}\n" for f in faults))

    async def client(
        self, pipe_dir: Path, *, env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, str]:
        """A stand-in CUDA process using MPS through ``pipe_dir`` (with ``env`` on top, e.g. a
        container's injected variables); returns it and its greeting (``memory_limit`` reads the next
        line)."""
        process = await asyncio.create_subprocess_exec(
            str(self.bin),
            "--mps-client",
            env={**os.environ, **(env or {}), "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)},
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=10)
        return process, line.decode().strip()


async def remove_cgroup(name: str, *, timeout_s: float = 30.0) -> None:
    """Removes the test's cgroup ``name`` from every host hierarchy (``gpufrac.node.mps.hostcgroup``) once
    its last process has left (a killed process stays in it until its parent has reaped it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    with contextlib.suppress(HostCgroupError):
        for hierarchy in host_hierarchies():
            cgroup = hierarchy.path / name
            while cgroup.exists():
                try:
                    cgroup.rmdir()
                except OSError as error:
                    assert loop.time() < deadline, f"cannot remove {cgroup}: {error}"
                    await asyncio.sleep(0.1)


# Deadlines, not timings: generous, because the suite runs on loaded 2-core machines where a stand-in
# daemon's restart can take many seconds; a passing condition returns at once.
async def started(supervisor: MpsSupervisor, *, timeout_s: float = 60.0) -> MpsSupervisor:
    await supervisor.start()
    assert await supervisor.wait_ready(timeout_s=timeout_s), f"not ready: {supervisor.state}"
    return supervisor


async def until(predicate: Callable[[], bool], *, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def memory_limit(client: asyncio.subprocess.Process) -> str:
    """The pinned-memory limit a connected stand-in client runs under (its second line)."""
    assert client.stdout is not None
    line = (await asyncio.wait_for(client.stdout.readline(), timeout=10)).decode().strip()
    assert line.startswith("memory-limit "), line
    return line.removeprefix("memory-limit ")
