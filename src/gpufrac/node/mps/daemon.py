"""One MPS control daemon process: spawn it, know when it serves, stop it, leave nothing behind (REAL).

The daemon runs in the foreground (``-f``) as the agent's child, so its exit is noticed at once instead of
by polling a pid file. A foreground daemon reads commands on its stdin and exits at end of file (driver
615, as NVIDIA's GPU Fractioning Operator found: ``mpsd/internal/supervisor.go``), so its stdin is a pipe
the agent holds open for the daemon's whole life. Ready means more than "the process exists": the control
socket is in the pipe directory AND the daemon answers a harmless query (``server list`` /
``get_server_list``).

Stopping is graceful first and certain last: ``quit`` on the daemon's stdin; if it is still there after
``quit_timeout_s``, SIGKILL; then MPS *server* processes that outlived their daemon (a crashed daemon
leaves them, and they keep the GPU context and its memory) are killed. A server is ours when its argv
carries the server marker AND it runs with our ``CUDA_MPS_PIPE_DIRECTORY``, or when our daemon listed it
while it was up; nothing else on the node is touched.

A daemon left by a previous agent (its pid in ``nvidia-cuda-mps-control.pid`` in our pipe directory) is
stopped the same way before a new one starts, because two daemons cannot share one pipe directory.

Handover (``MpsSettings.handover``, on in the node agent). A foreground daemon dies with the agent that
holds its stdin, so every agent upgrade restarted MPS and every sm-sharing process lost its server. With
handover the daemon runs in the background (``-d``: not the agent's child, not tied to its stdin), so it
outlives an agent that stops; the next agent ADOPTS it instead of replacing it when the pid file names a
live process of our pipe directory and the daemon answers ``server list``. Its clients never notice. The
price: its exit is noticed by polling its pid (``exit_poll_s``) rather than at once, its exit status is
unknown, and ``quit`` goes through the control socket. ASSUMPTION (the stand-in behaves so; confirm on
r615): ``-d`` accepts ``-p 3 -m -a <toml>`` as ``-f`` does.

A background daemon still dies with the agent's *container*, whose cgroup the runtime kills whole. With
``MpsSettings.own_cgroup`` the daemon, once it answers (started or adopted), is moved into a cgroup of its
own on the host (``gpufrac.node.mps.hostcgroup``), with the servers it already has; ``cgroup_error`` says
why when it could not be.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from gpufrac.node.mps.config import MpsSettings
from gpufrac.node.mps.control import V3_PROTOCOL, MpsCommandError, MpsControl
from gpufrac.node.mps.hostcgroup import Hierarchy, HostCgroupError, host_hierarchies, move_to_own_cgroup
from gpufrac.node.mps.mode import MpsMode
from gpufrac.node.mps.v3config import render_v3_config

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"


class DaemonStartError(Exception):
    """The daemon exited or did not become ready in time; the message says which."""


class MpsDaemon:
    def __init__(
        self,
        *,
        settings: MpsSettings,
        mode: MpsMode,
        control: MpsControl,
        host_cgroups: Callable[[], list[Hierarchy]] = host_hierarchies,
    ) -> None:
        """``host_cgroups``: where ``settings.own_cgroup`` is created (the host's hierarchies)."""
        self._settings = settings
        self._host_cgroups = host_cgroups
        self._mode = mode
        self._control = control
        self._process: asyncio.subprocess.Process | None = None
        self._pid: int | None = None  # a background daemon's (handover): not our child
        self._servers: set[int] = set()
        #: This daemon was left running by a previous agent and adopted, not started.
        self.adopted = False
        #: Why the daemon is still in the agent's cgroup (``settings.own_cgroup`` set); None when it left.
        self.cgroup_error: str | None = None

    @property
    def detached(self) -> bool:
        return self._settings.handover

    @property
    def pid(self) -> int | None:
        if self.detached:
            return self._pid
        return self._process.pid if self._process is not None else None

    def argv(self, *, config_file: Path) -> list[str]:
        mode = "-d" if self.detached else "-f"
        if self._mode is MpsMode.V3:
            return [self._settings.control_bin, "-p", V3_PROTOCOL, "-m", mode, "-a", str(config_file)]
        return [self._settings.control_bin, mode]

    async def start(self) -> None:
        """Adopts a running daemon (handover) or spawns one, and returns once it answers; raises
        ``DaemonStartError`` otherwise."""
        settings = self._settings
        settings.pipe_dir.mkdir(parents=True, exist_ok=True)
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        if self.detached and await self._adopt():
            return
        await self._stop_leftover()
        await sweep_servers(settings=settings, known=set())
        with contextlib.suppress(FileNotFoundError):
            (settings.pipe_dir / "control").unlink()  # stale after a crash; the new daemon binds it
        config_file = settings.state_dir / "mps-v3.toml"
        if self._mode is MpsMode.V3:
            config_file.write_text(render_v3_config(settings=settings))
        output = (settings.log_dir / "gpufrac-daemon.out").open("ab")
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv(config_file=config_file),
                env=self._control.environment(),
                # Foreground: held open, as the daemon exits at end of file. Background: not ours to hold.
                stdin=asyncio.subprocess.DEVNULL if self.detached else asyncio.subprocess.PIPE,
                stdout=output,
                stderr=output,
                start_new_session=True,
            )
        except OSError as error:
            raise DaemonStartError(f"cannot run {settings.control_bin}: {error}") from error
        finally:
            output.close()
        if self.detached:  # `-d` forks the daemon and returns
            status = await self._process.wait()
            self._process = None
            if status != 0:
                raise DaemonStartError(f"`{settings.control_bin} -d` exited with status {status}")
        await self._wait_ready()
        self._leave_agent_cgroup()

    def _leave_agent_cgroup(self) -> None:
        """With handover and ``own_cgroup``: the daemon (and its servers so far) into a cgroup of its own."""
        name = self._settings.own_cgroup
        if name is None or not self.detached or self._pid is None:
            return
        try:
            servers = sorted(pid for pid in self._servers if pid > 0 and pid != self._pid)
            moved = move_to_own_cgroup([self._pid, *servers], name=name, hierarchies=self._host_cgroups())
        except HostCgroupError as error:
            self.cgroup_error = str(error)
            log.warning(
                "the MPS control daemon %d stays in the node agent's cgroup, so replacing the agent's "
                "container will stop it: %s",
                self._pid,
                error,
            )
            return
        self.cgroup_error = None
        log.info(
            "moved the MPS control daemon %d into its own cgroup %s", self._pid, ", ".join(map(str, moved))
        )

    async def _adopt(self) -> bool:
        """Takes over the daemon a previous agent left running, when it is ours and answers."""
        pid = self._pid_from_file()
        if pid is None or not _runs_with_pipe_dir(pid=pid, pipe_dir=self._settings.pipe_dir):
            return False
        try:
            out = await self._list_servers()
        except MpsCommandError as error:
            log.warning("MPS control daemon %d left running does not answer (%s); replacing it", pid, error)
            return False
        self._pid, self.adopted = pid, True
        self._servers |= {int(w) for w in out.split() if w.isdigit()}
        log.info("adopted the MPS control daemon %d left running by the previous agent", pid)
        self._leave_agent_cgroup()  # a previous agent's may not have left it (or was of an older release)
        return True

    def _pid_from_file(self) -> int | None:
        try:
            return int((self._settings.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _exit_status(self) -> int | None:
        """The daemon's exit status once it is gone (-1 for a background daemon: not our child)."""
        if not self.detached:
            assert self._process is not None
            return self._process.returncode
        if self._pid is None:
            return None
        return None if _running(self._pid, proc_root=Path("/proc")) else -1

    async def _wait_ready(self) -> None:
        assert self._process is not None or self.detached
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.ready_timeout_s
        probe = ("server", "list") if self._mode is MpsMode.V3 else ("get_server_list",)
        while True:
            if self.detached and self._pid is None:
                self._pid = self._pid_from_file()
            if (status := self._exit_status()) is not None:
                raise DaemonStartError(f"the MPS control daemon exited with status {status}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                await self.kill()
                raise DaemonStartError(
                    f"the MPS control daemon was not ready within {self._settings.ready_timeout_s}s"
                )
            if (self._settings.pipe_dir / "control").exists() and (not self.detached or self._pid):
                try:
                    out = await self._control.run(
                        *probe, timeout_s=min(remaining, self._settings.command_timeout_s)
                    )
                except MpsCommandError:
                    pass
                else:
                    self._servers |= {int(w) for w in out.split() if w.isdigit()}
                    return
            await asyncio.sleep(min(0.05, max(remaining, 0.0)))

    async def wait(self) -> int:
        """Until the daemon exits; its exit status (-1 for a background daemon)."""
        if not self.detached:
            assert self._process is not None
            return await self._process.wait()
        while (status := self._exit_status()) is None:
            await asyncio.sleep(self._settings.exit_poll_s)
        return status

    async def stop(self) -> None:
        """``quit`` on its stdin, then SIGKILL, then the stray servers. Safe to call on a dead daemon."""
        if self.detached:
            await self._stop_detached()
            return
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(MpsCommandError):
                self._servers |= {int(w) for w in (await self._list_servers()).split() if w.isdigit()}
            try:
                async with asyncio.timeout(self._settings.quit_timeout_s):
                    await self._quit_on_stdin(process)
                    await process.wait()
            except (OSError, TimeoutError) as error:
                log.warning("MPS daemon did not quit (%r); killing it", error)
        await self.kill()

    @staticmethod
    async def _quit_on_stdin(process: asyncio.subprocess.Process) -> None:
        stdin = process.stdin
        if stdin is None or stdin.is_closing():
            raise OSError("the daemon's stdin is closed")
        stdin.write(b"quit\n")
        await stdin.drain()

    async def _stop_detached(self) -> None:
        """A background daemon: ``quit`` through its control socket, then as ``kill``."""
        pid = self._pid
        if pid is not None and _running(pid, proc_root=Path("/proc")):
            with contextlib.suppress(MpsCommandError):
                self._servers |= {int(w) for w in (await self._list_servers()).split() if w.isdigit()}
            with contextlib.suppress(MpsCommandError):
                await self._control.quit(timeout_s=self._settings.quit_timeout_s)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._settings.quit_timeout_s
            while _running(pid, proc_root=Path("/proc")) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        await self.kill()

    async def kill(self) -> None:
        """SIGKILL the daemon (if alive) and every stray server of ours."""
        if self.detached:
            pid, self._pid = self._pid, None
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self._settings.kill_timeout_s
                while _running(pid, proc_root=Path("/proc")) and loop.time() < deadline:
                    await asyncio.sleep(0.02)
                (self._settings.pipe_dir / PID_FILE).unlink(missing_ok=True)
            await sweep_servers(settings=self._settings, known=self._servers)
            self._servers.clear()
            return
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), timeout=self._settings.kill_timeout_s)
        if process is not None and process.stdin is not None:
            process.stdin.close()
        await sweep_servers(settings=self._settings, known=self._servers)
        self._servers.clear()

    async def _list_servers(self) -> str:
        probe = ("server", "list") if self._mode is MpsMode.V3 else ("get_server_list",)
        return await self._control.run(*probe, timeout_s=self._settings.command_timeout_s)

    async def _stop_leftover(self) -> None:
        pid_file = self._settings.pipe_dir / PID_FILE
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        if not _runs_with_pipe_dir(pid=pid, pipe_dir=self._settings.pipe_dir):
            pid_file.unlink(missing_ok=True)
            return
        log.warning("stopping MPS control daemon %d left by a previous agent", pid)
        with contextlib.suppress(MpsCommandError):
            await self._control.quit(timeout_s=self._settings.quit_timeout_s)
        for _ in range(int(self._settings.quit_timeout_s / 0.05)):
            if not _alive(pid):
                break
            await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)


async def sweep_servers(
    *, settings: MpsSettings, known: set[int], proc_root: Path = Path("/proc")
) -> list[int]:
    """SIGKILLs MPS servers of our pipe directory that are still alive and waits (up to
    ``kill_timeout_s``) until they are gone; returns their pids."""
    killed = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if not _is_server(pid=pid, marker=settings.server_marker, proc_root=proc_root):
            continue
        if pid in known or _runs_with_pipe_dir(pid=pid, pipe_dir=settings.pipe_dir, proc_root=proc_root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    if killed:
        log.warning("killed stray MPS servers %s", killed)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.kill_timeout_s
    while any(_running(pid, proc_root=proc_root) for pid in killed) and loop.time() < deadline:
        await asyncio.sleep(
            0.02
        )  # SIGKILL is asynchronous: the GPU context is freed once the process is gone
    return killed


def _running(pid: int, *, proc_root: Path) -> bool:
    """Alive and not a zombie (a zombie holds no GPU memory; its parent reaps it)."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_server(*, pid: int, marker: str, proc_root: Path) -> bool:
    try:
        argv = (proc_root / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(os.path.basename(arg.decode(errors="replace")) == marker for arg in argv if arg)


def _runs_with_pipe_dir(*, pid: int, pipe_dir: Path, proc_root: Path = Path("/proc")) -> bool:
    try:
        environ = (proc_root / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
