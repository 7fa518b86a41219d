"""The MPS supervisor: keeps one control daemon serving and the namespaces of live containers on it (REAL).

State machine (``state``)::

    STOPPED ──start()──► STARTING ──ready──► READY ──daemon exits / server wedged──► BACKOFF
                            ▲  │ not ready in time, or exits                            │
                            │  └───────────────────────────────► BACKOFF ──delay──────┘ (→ STARTING)
    READY/BACKOFF/STARTING ──stop()──► STOPPING ──► STOPPED

- Every transition into BACKOFF is a restart and emits an Event on the Node (reason, cause, attempt,
  delay). The delay grows exponentially and resets once the daemon has been READY for ``stable_s``.
- Wedged: a ``client terminate`` that does not answer within ``terminate_timeout_s`` (30 s: the command
  blocks while the client's GPU work drains, and a slow drain is a legitimate one) means the server no
  longer processes requests; the daemon is killed — servers included — and started again at once with a
  ``MpsServerWedged`` Event.
- Hung clients: with CUDA <= 13.5 a client killed with work in flight leaves every later client hanging
  in CUDA init while the control daemon answers normally, so no command shows it. While READY, the active
  probe (``gpufrac.node.mps.probe``) runs a short-lived test client every ``probe_interval_s``; one that
  gets no context within ``probe_timeout_s`` declares the server wedged: the daemon is killed and started
  again at once (``MpsServerWedged`` Event, counted as a wedge). Until a probe passes on the new daemon
  (the first runs as soon as it is READY) the node withholds sm-sharing (``capability``) and new MPS
  containers are refused (``ensure_namespace``), so no new fraction lands on a server not proven healthy.
- Recycled: after a drain leaves no client attached (``recycle_when_idle``), the daemon is quit and
  started again at once (a Normal ``MpsDaemonRecycled`` Event, no backoff): restarting an idle MPS costs
  nobody anything, and it is the one way to be sure a fault left by a client killed mid-kernel does not
  hang the next one.
- After every start, the time-slicing containers' links to the default socket are made again (v3 with
  ``time_slicing_clients``: ``default_socket``), and namespaces are reconciled (v3): each live
  container's namespace is created again (the daemon keeps nothing across restarts) with its settings,
  its pipe directory read back (a client that attached between ``create`` and ``set``, uncapped, is
  terminated and the set tried again); namespaces with gpufrac's prefix that no live container owns are
  deleted (``names.is_managed``).
- The namespace directory ``<pipe>/<server>/<namespace>`` is created by the supervisor before
  ``namespace create`` and kept across daemon restarts, because the container bind-mounts that very
  directory: a recreated directory would be a different inode, invisible inside a running container.
  ASSUMPTION (stand-in behaves so; confirm on r615): the daemon reuses an existing namespace directory.

Handover (``settings.handover``): ``detach()`` stops supervising and leaves the daemon serving, for the
next agent to adopt (``MpsDaemon``); a daemon adopted at start keeps its namespaces and their clients.
Its namespaces that the live set does not name are deleted only once the live set is known (the runtime's
Synchronize): before that, "not live" only means "not told yet". With ``settings.own_cgroup`` a daemon
that could not leave the agent's container cgroup (so a pod replacement would kill it) is a Warning Event
``MpsDaemonInAgentCgroup`` with the reason (once per daemon).

``stop()`` is the one shutdown path: it cancels the supervision task (whatever state it is in, including a
backoff sleep or a start in progress), then stops the daemon gracefully and sweeps stray servers in a
``finally`` so that a cancelled stop still leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpufrac.kube.events import NORMAL, WARNING
from gpufrac.node.mps.backoff import Backoff
from gpufrac.node.mps.config import MpsSettings
from gpufrac.node.mps.control import MpsClient, MpsCommandError, MpsCommandTimeout, MpsControl
from gpufrac.node.mps.daemon import DaemonStartError, MpsDaemon
from gpufrac.node.mps.default_socket import DefaultSocketLinks
from gpufrac.node.mps.events import (
    REASON_IN_AGENT_CGROUP,
    REASON_RECYCLED,
    REASON_RESTARTED,
    REASON_START_FAILED,
    REASON_WEDGED,
    EventSink,
)
from gpufrac.node.mps.hostcgroup import Hierarchy, host_hierarchies
from gpufrac.node.mps.mode import DriverVersion, MpsMode, NodeMpsCapability, capability_for, mode_for_driver
from gpufrac.node.mps.names import PipeDirTooLong, check_pipe_dir, is_managed
from gpufrac.node.mps.probe import ProbeOutcome, probe_once

log = logging.getLogger(__name__)


class SupervisorState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"


class MpsUnavailable(Exception):
    """The daemon is not serving, so a container's MPS setup cannot be done now."""


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """A container's namespace on the shared server; ``container_id`` records whose it is."""

    name: str
    active_thread_percentage: int
    pinned_memory_limit_mib: int | None = None
    container_id: str | None = None

    @property
    def pinned_memory_limit(self) -> str | None:
        return None if self.pinned_memory_limit_mib is None else f"{self.pinned_memory_limit_mib}M"


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What one drain did: the clients it terminated, those it did not reach (the server wedged first),
    and whether it restarted MPS (wedged) or recycled it (nothing left attached)."""

    terminated: tuple[int, ...] = ()
    remaining: tuple[int, ...] = ()
    wedged: bool = False
    recycled: bool = False


class MpsSupervisor:
    def __init__(
        self,
        *,
        settings: MpsSettings,
        driver: DriverVersion,
        events: EventSink,
        clock: Callable[[], float] = time.monotonic,
        mode: MpsMode | None = None,
        on_change: Callable[[], None] | None = None,
        host_cgroups: Callable[[], list[Hierarchy]] = host_hierarchies,
    ) -> None:
        """``mode`` overrides the driver's choice (the GPU check runs classic MPS on any driver).
        ``on_change`` is called on every state change, e.g. ``InventoryPublisher.poke`` so the node's
        capability labels follow the daemon (the publisher reads ``capability()``). ``host_cgroups``: the
        hierarchies ``settings.own_cgroup`` is created in (the host's)."""
        self._host_cgroups = host_cgroups
        self._on_change = on_change
        self.settings = settings
        self.driver = driver
        self.mode = mode or mode_for_driver(driver)
        self._events = events
        self._clock = clock
        self.control = MpsControl(
            control_bin=settings.control_bin,
            pipe_dir=settings.pipe_dir,
            log_dir=settings.log_dir,
            mode=self.mode,
            timeout_s=settings.command_timeout_s,
        )
        self.backoff = Backoff(settings=settings.backoff)
        self._state = SupervisorState.STOPPED
        self.restarts = 0
        self._delay = 0.0
        self._daemon: MpsDaemon | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._wedged = asyncio.Event()
        self._recycle = asyncio.Event()
        #: Why the server is not trusted (a probe hung) until a probe passes on the current daemon; None
        #: when it is.
        self.suspect: str | None = None
        self.probes = 0
        self._probe_error: str | None = None
        self._namespaces: dict[str, NamespaceSpec] = {}
        self._live_known = False  # set_namespaces was called: the live set is the runtime's
        self._on_daemon: set[str] = set()  # namespaces the running daemon has (listed at reconcile)
        self._applied: dict[str, NamespaceSpec] = {}  # settings the running daemon has for each
        self._pipe_dirs: dict[str, Path] = {}  # each namespace's pipe directory, as the daemon reported it
        self._ns_lock = asyncio.Lock()
        self._cgroup_reported: str | None = None  # the last MpsDaemonInAgentCgroup reason told
        #: Time-slicing containers' links to the default socket (``settings.time_slicing_clients``, v3).
        self.default_links = (
            DefaultSocketLinks(pipe_dir=settings.pipe_dir)
            if settings.time_slicing_clients and self.mode is MpsMode.V3
            else None
        )

    # --- what the rest of the agent reads --------------------------------------------------------------

    @property
    def state(self) -> SupervisorState:
        return self._state

    @state.setter
    def state(self, value: SupervisorState) -> None:
        changed, self._state = value is not self._state, value
        if changed and self._on_change is not None:
            self._on_change()

    @property
    def daemon_pid(self) -> int | None:
        return self._daemon.pid if self._daemon is not None and self.state is SupervisorState.READY else None

    def capability(self) -> NodeMpsCapability:
        """sm-sharing is advertised while the daemon serves, or restarts without having failed repeatedly."""
        running = self.state is SupervisorState.READY or (
            self.state in (SupervisorState.STARTING, SupervisorState.BACKOFF) and not self.backoff.degraded
        )
        return capability_for(driver=self.driver, mps_running=running and self.suspect is None)

    def namespace_dir(self, name: str) -> Path:
        """Where a namespace's directory is created before ``namespace create`` (the daemon reuses it);
        what a container mounts is the directory the daemon reports (``pipe_directory``)."""
        return self.settings.pipe_dir / self.settings.server_name / name

    def pipe_directory(self, name: str) -> Path | None:
        """The pipe directory the running daemon reported for namespace ``name``."""
        return self._pipe_dirs.get(name)

    async def wait_ready(self, *, timeout_s: float) -> bool:
        """True once READY; waits at most ``timeout_s``, and not at all when nothing is (re)starting."""
        if self.state in (SupervisorState.STOPPED, SupervisorState.STOPPING):
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout=timeout_s)
        return self._ready.is_set()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts supervising; returns at once (use ``wait_ready`` to wait for the first READY)."""
        if self._task is not None:
            raise RuntimeError("the MPS supervisor is already running")
        self.state = SupervisorState.STARTING
        self._task = asyncio.create_task(self._supervise(), name="mps-supervisor")

    async def stop(self) -> None:
        """Stops supervising and the daemon; leaves no daemon or server process behind."""
        task, self._task = self._task, None
        self.state = SupervisorState.STOPPING
        self._ready.clear()
        try:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            # Even if stop() itself is cancelled, the daemon and its servers must not outlive the agent.
            daemon, self._daemon = self._daemon, None
            if daemon is not None:
                await asyncio.shield(daemon.stop())
            self.state = SupervisorState.STOPPED

    async def _supervise(self) -> None:
        while True:
            self.state = SupervisorState.STARTING
            self._wedged.clear()
            self._recycle.clear()
            daemon = MpsDaemon(
                settings=self.settings, mode=self.mode, control=self.control, host_cgroups=self._host_cgroups
            )
            self._daemon = daemon
            self._on_daemon, self._applied, self._pipe_dirs = set(), {}, {}  # a new daemon knows nothing
            try:
                await daemon.start()
                await self.reconcile()
                if self.default_links is not None:  # the daemon made a new default socket
                    self.default_links.refresh()
            except (DaemonStartError, MpsCommandError) as error:
                await daemon.kill()
                self._restart_later(reason=REASON_START_FAILED, cause=f"did not start: {error}")
                await asyncio.sleep(self._delay)
                continue
            self._report_cgroup(daemon)
            self.backoff.ready(now=self._clock())
            self.state = SupervisorState.READY
            self._ready.set()
            log.info("MPS control daemon ready (mode %s, pid %s)", self.mode, daemon.pid)
            cause, reason = await self._until_down(daemon)
            self._ready.clear()
            if reason == REASON_RECYCLED:
                await daemon.stop()  # nothing attached: quit gracefully, then the stray sweep
            else:
                await daemon.kill()
            self._restart_later(reason=reason, cause=cause)
            await asyncio.sleep(self._delay)

    def _report_cgroup(self, daemon: MpsDaemon) -> None:
        error = daemon.cgroup_error
        if error is not None and error != self._cgroup_reported:
            self._events.emit(
                type=WARNING,
                reason=REASON_IN_AGENT_CGROUP,
                message=f"MPS control daemon {daemon.pid} stays in the node agent's cgroup, so replacing the "
                f"agent's pod (a rolling update) will stop it and its clients: {error}",
            )
        self._cgroup_reported = error

    async def _until_down(self, daemon: MpsDaemon) -> tuple[str, str]:
        exited = asyncio.create_task(daemon.wait())
        wedged = asyncio.create_task(self._wedged.wait())
        recycle = asyncio.create_task(self._recycle.wait())
        hung = asyncio.create_task(self._probe_until_hung())
        try:
            await asyncio.wait({exited, wedged, recycle, hung}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exited, wedged, recycle, hung):
                task.cancel()
        if exited.done() and not exited.cancelled():
            return f"exited with status {exited.result()}", REASON_RESTARTED
        if wedged.done() and not wedged.cancelled():
            return "stopped answering `client terminate` (server wedged); killed", REASON_WEDGED
        if hung.done() and not hung.cancelled():
            self.suspect = hung.result()
            self._on_change_now()
            return (
                f"answers, but {self.suspect} (clients hang in CUDA init: server wedged); killed",
                REASON_WEDGED,
            )
        return "recycled: no MPS client left attached after a drain", REASON_RECYCLED

    @property
    def probe_pipe_dir(self) -> Path:
        """Where a client of the server connects: the shared server's directory (v3), the pipe (classic)."""
        if self.mode is MpsMode.V3:
            return self.settings.pipe_dir / self.settings.server_name
        return self.settings.pipe_dir

    async def _probe_until_hung(self) -> str:
        """Probe while READY; returns what hung. The first probe is at once while the server is suspect."""
        interval = self.settings.probe_interval_s
        if interval is None:
            await asyncio.Event().wait()
        assert interval is not None
        if self.suspect is None:
            await asyncio.sleep(interval)
        while True:
            outcome, detail = await probe_once(
                command=self.settings.probe_command,
                pipe_dir=self.probe_pipe_dir,
                log_dir=self.settings.log_dir,
                timeout_s=self.settings.probe_timeout_s,
            )
            self.probes += 1
            if outcome is ProbeOutcome.HUNG:
                log.warning("MPS probe: %s", detail)
                return detail
            if outcome is ProbeOutcome.ERROR:
                if detail != self._probe_error:
                    log.warning("MPS probe could not run (it proves nothing about MPS): %s", detail)
                self._probe_error = detail
            else:
                self._probe_error = None
                if self.suspect is not None:
                    log.info("MPS probe: a test client got a context again; the server is trusted")
                    self.suspect = None
                    self._on_change_now()
            await asyncio.sleep(interval)

    def _on_change_now(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _restart_later(self, *, reason: str, cause: str) -> None:
        self.state = SupervisorState.BACKOFF
        if reason in (REASON_WEDGED, REASON_RECYCLED):
            self._delay = 0.0  # asked for, not a failure to back off from
        else:
            self._delay = self.backoff.failed(now=self._clock())
        self.restarts += 1
        message = f"MPS control daemon {cause}; restart {self.restarts} in {self._delay:.2f}s"
        kind = NORMAL if reason == REASON_RECYCLED else WARNING
        (log.info if kind == NORMAL else log.warning)("%s", message)
        self._events.emit(type=kind, reason=reason, message=message)

    # --- namespaces (v3) -------------------------------------------------------------------------------

    async def ensure_namespace(self, spec: NamespaceSpec) -> Path:
        """Creates ``spec`` on the shared server (or updates it) and returns its pipe directory as the
        daemon reports it; the daemon must be serving within ``create_wait_s`` or ``MpsUnavailable`` is
        raised and nothing is kept."""
        if self.mode is not MpsMode.V3:
            raise RuntimeError("namespaces exist in MPS v3 only")
        self._namespaces[spec.name] = spec
        try:
            if not await self.wait_ready(timeout_s=self.settings.create_wait_s):
                raise MpsUnavailable(f"the MPS daemon is {self.state}, not serving")
            if self.suspect is not None:
                raise MpsUnavailable(
                    f"the MPS server was wedged ({self.suspect}) and is not proven healthy yet"
                )
            async with self._ns_lock:
                return await self._create(spec)
        except MpsUnavailable:
            self._namespaces.pop(spec.name, None)
            raise
        except MpsCommandError as error:  # the daemon refused or died meanwhile: same answer for the runtime
            self._namespaces.pop(spec.name, None)
            raise MpsUnavailable(f"namespace {spec.name}: {error}") from error

    def keep_namespaces(self, specs: Iterable[NamespaceSpec]) -> None:
        """Adds ``specs`` to the live set without declaring it complete (the runtime's containers are not
        known yet): they are created at the next reconcile, and nothing is deleted on their account."""
        for spec in specs:
            self._namespaces[spec.name] = spec

    def set_namespaces(self, specs: Iterable[NamespaceSpec]) -> None:
        """Replaces the live set without touching the daemon; the next ``reconcile`` applies it."""
        self._namespaces = {spec.name: spec for spec in specs}
        self._live_known = True

    async def reconcile_logged(self) -> None:
        """``reconcile`` for a background task: a failure is logged (the next restart reconciles again)."""
        try:
            await self.reconcile()
        except MpsCommandError as error:
            log.warning("MPS namespace reconcile failed: %s", error)

    async def release_namespace(self, name: str) -> None:
        """Forgets and deletes a container's namespace and its directory (after the container is gone).

        If the daemon is down, or refuses (a client still attached), the next reconcile deletes it as
        an orphan."""
        self._namespaces.pop(name, None)
        if self.state is SupervisorState.READY:
            async with self._ns_lock:
                try:
                    if name in self._on_daemon:
                        await self.control.delete_namespace(server=self.settings.server_name, name=name)
                        self._on_daemon.discard(name)
                except MpsCommandError as error:
                    log.warning("MPS namespace %s not deleted yet: %s", name, error)
                self._applied.pop(name, None)
                self._pipe_dirs.pop(name, None)
        directory = self.namespace_dir(name)
        with contextlib.suppress(FileNotFoundError):
            (directory / "control").unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()

    async def resize_namespace(self, spec: NamespaceSpec) -> str | None:
        """New settings for a live namespace (a running container resized): None once the daemon holds
        them, else why it does not.

        The live set takes ``spec`` at once, so every later (re)creation of the namespace -- a daemon
        restart, a recycle -- has the new ceiling and pinned-memory limit. ``namespace set`` is tried
        now; MPS refuses it while a client is attached (NVIDIA: a client's active-thread percentage and
        pinned device memory limit are fixed when it connects; none can be changed for a running
        process), which is the usual case for a running container: its clients keep the settings they
        connected with, and the container's GPU memory stays bounded by the cgroup's hard limit, which
        the driver changes live."""
        if self.mode is not MpsMode.V3:
            return (
                "classic MPS has no namespaces: its clients keep the limits of the environment they began "
                "with"
            )
        if spec.name not in self._namespaces:
            return f"MPS namespace {spec.name} is not live on this node"
        self._namespaces[spec.name] = spec
        if self.state is not SupervisorState.READY:
            return (
                f"the MPS daemon is {self.state}: the namespace is made with the new settings when it serves"
            )
        async with self._ns_lock:
            if self._applied.get(spec.name) == spec:
                return None
            try:
                await self.control.set_namespace(
                    server=self.settings.server_name,
                    name=spec.name,
                    active_thread_percentage=spec.active_thread_percentage,
                    pinned_memory_limit=spec.pinned_memory_limit,
                )
            except MpsCommandError as error:
                return (
                    f"MPS kept the namespace's settings for the clients attached now ({error}); processes "
                    "connecting after they all detach get the new ones"
                )
            self._applied[spec.name] = spec
        return None

    def live_namespaces(self) -> Iterable[NamespaceSpec]:
        return tuple(self._namespaces.values())

    async def _create(self, spec: NamespaceSpec) -> Path:
        """``namespace create`` (unless the daemon has it), ``namespace set`` (unless the daemon already
        has these settings: a set is refused once a client attached), then the pipe directory read back
        and its length checked. A namespace created here and not usable is deleted again."""
        pipe = self._pipe_dirs.get(spec.name)
        if spec.name in self._on_daemon and self._applied.get(spec.name) == spec and pipe is not None:
            return pipe  # a retried CreateContainer, or a Synchronize of a running container
        directory = self.namespace_dir(spec.name)
        try:
            check_pipe_dir(directory)  # before the daemon is asked: its own failure says nothing useful
        except PipeDirTooLong as error:
            raise MpsCommandError(str(error)) from error
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)  # any uid may reach the socket; only the agent changes the directory
        server = self.settings.server_name
        fresh = spec.name not in self._on_daemon
        if fresh:
            try:
                await self.control.create_namespace(server=server, name=spec.name)
            except MpsCommandError as refused:
                # Inconclusive: the daemon may have it already (a list that did not show it). Whether it
                # answers for its pipe directory settles it; if not, the create's refusal stands.
                try:
                    await self.control.namespace_pipe_directory(server=server, name=spec.name)
                except MpsCommandError:
                    raise refused from None
                fresh = False
            self._on_daemon.add(spec.name)
        elif await self._daemon_has(spec):  # an adopted daemon's namespace, as it is: nothing to set
            pipe = await self.control.namespace_pipe_directory(server=server, name=spec.name)
            self._applied[spec.name], self._pipe_dirs[spec.name] = spec, pipe
            return pipe
        try:
            try:
                await self._set(spec)
            except MpsCommandError:
                if not fresh or not await self._terminate_early_clients(spec.name):
                    raise
                await self._set(spec)
            pipe = await self.control.namespace_pipe_directory(server=server, name=spec.name)
            try:
                check_pipe_dir(pipe)
            except PipeDirTooLong as error:
                raise MpsCommandError(str(error)) from error
        except MpsCommandError:
            if fresh:  # never leave an uncapped namespace behind
                with contextlib.suppress(MpsCommandError):
                    await self.control.delete_namespace(server=server, name=spec.name)
                    self._on_daemon.discard(spec.name)
            raise
        self._applied[spec.name] = spec
        self._pipe_dirs[spec.name] = pipe
        return pipe

    async def _set(self, spec: NamespaceSpec) -> None:
        await self.control.set_namespace(
            server=self.settings.server_name,
            name=spec.name,
            active_thread_percentage=spec.active_thread_percentage,
            pinned_memory_limit=spec.pinned_memory_limit,
        )

    async def _terminate_early_clients(self, name: str) -> bool:
        """Terminates the clients that attached to namespace ``name`` between its ``create`` and its
        ``set`` (a running container's process, reconnecting after a daemon restart, can): they run
        without the ceiling, and the daemon refuses a ``set`` while they stay. True if any was found."""
        try:
            early = [
                c
                for c in await self.control.list_clients()
                if c.namespace == name and c.server == self.settings.server_name
            ]
        except MpsCommandError:
            return False
        for client in early:
            log.warning(
                "MPS client %d attached to namespace %s before its limits were set: terminating it",
                client.pid,
                name,
            )
            with contextlib.suppress(MpsCommandError):  # gone already: that is what we wanted
                await self.control.terminate_client(client, timeout_s=self.settings.terminate_timeout_s)
        return bool(early)

    async def _daemon_has(self, spec: NamespaceSpec) -> bool:
        """Whether the daemon's namespace already has ``spec``'s settings (read back with ``namespace
        get``): a daemon adopted from the previous agent keeps them, and a ``namespace set`` would be
        refused while its clients are attached."""
        server = self.settings.server_name
        try:
            threads = await self.control.namespace_field(
                server=server, name=spec.name, field="active_thread_percentage"
            )
            pinned = await self.control.namespace_field(
                server=server, name=spec.name, field="pinned_memory_limit"
            )
        except MpsCommandError:
            return False
        got = pinned.strip()
        return threads.strip() == str(spec.active_thread_percentage) and (
            (None if got in ("", "N/A") else got) == spec.pinned_memory_limit
        )

    async def detach(self) -> None:
        """Stops supervising and leaves the daemon serving for the next agent (handover); without
        handover, the same as ``stop``."""
        if not self.settings.handover:
            await self.stop()
            return
        task, self._task = self._task, None
        self.state = SupervisorState.STOPPING
        self._ready.clear()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        daemon, self._daemon = self._daemon, None
        if daemon is not None:
            log.info("leaving the MPS control daemon %s serving for the next agent", daemon.pid)
        self.state = SupervisorState.STOPPED

    async def reconcile(self) -> None:
        """Makes the daemon's namespaces those of the live containers (run after every start)."""
        if self.mode is not MpsMode.V3:
            return
        async with self._ns_lock:
            self._on_daemon = set(await self.control.list_namespaces(server=self.settings.server_name))
            for name in set(self._applied) - self._on_daemon:  # gone from the daemon meanwhile
                self._applied.pop(name, None)
                self._pipe_dirs.pop(name, None)
            for spec in list(self._namespaces.values()):
                await self._create(spec)
            adopted = self._daemon is not None and self._daemon.adopted
            for orphan in sorted(self._on_daemon - set(self._namespaces)):
                if adopted and not self._live_known:  # its clients may be live containers not told yet
                    continue
                if not is_managed(orphan):  # `default`, someone else's, or a table cell: never ours
                    continue
                log.info("deleting orphan MPS namespace %s", orphan)
                await self.control.delete_namespace(server=self.settings.server_name, name=orphan)
                self._on_daemon.discard(orphan)
                self._applied.pop(orphan, None)
                self._pipe_dirs.pop(orphan, None)

    # --- drain -----------------------------------------------------------------------------------------

    async def drain(self, *, owns: Callable[[MpsClient], bool]) -> DrainResult:
        """Terminates the MPS clients ``owns`` picks, one after the other, each given
        ``terminate_timeout_s`` to drain its GPU work (not bounded as a whole: the caller runs it in the
        background). A terminate past its timeout marks the server wedged: the drain stops there and the
        supervision task hard-restarts the daemon. A drain that leaves no client attached recycles MPS
        when ``recycle_when_idle``."""
        if self.state is not SupervisorState.READY:
            return DrainResult()
        try:
            mine = [c for c in await self.control.list_clients() if owns(c)]
        except MpsCommandError as error:
            log.warning("drain: cannot list the MPS clients: %s", error)
            return DrainResult()
        terminated: list[int] = []
        for client in mine:
            try:
                await self.control.terminate_client(client, timeout_s=self.settings.terminate_timeout_s)
            except MpsCommandTimeout:
                self._declare_wedged()
                return DrainResult(
                    terminated=tuple(terminated),
                    remaining=tuple(c.pid for c in mine if c.pid not in terminated),
                    wedged=True,
                )
            except MpsCommandError as error:  # gone already: that is what we wanted
                log.debug("terminate %d: %s", client.pid, error)
            terminated.append(client.pid)
        recycled = False
        if mine and self.settings.recycle_when_idle and self.state is SupervisorState.READY:
            try:
                idle = not await self.control.list_clients()
            except MpsCommandError as error:
                log.warning("drain: cannot re-list the MPS clients, not recycling: %s", error)
                idle = False
            if idle:
                self._recycle.set()
                self._ready.clear()
                recycled = True
        return DrainResult(terminated=tuple(terminated), recycled=recycled)

    def _declare_wedged(self) -> None:
        if self.state is SupervisorState.READY:
            log.warning("MPS server wedged: a client terminate did not answer")
            self._ready.clear()
            self._wedged.set()
