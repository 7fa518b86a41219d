"""The MPS part of the node agent, in one object the agent can start and cancel (REAL).

The supervisor needs the driver version (it decides v3 or classic), which only the GPU inventory knows,
and NVML may not answer at the moment the agent starts. The NRI handler, on the other hand, needs its
``ContainerHooks`` when it is built. ``MpsService`` bridges the two: ``hooks`` exists from the start and
answers "MPS not started yet" (``MpsUnavailable``: the container fails closed) until ``run`` has read the
driver and started the supervisor; a Synchronize that arrives before then is kept and applied before the
daemon's first reconcile, so running containers keep their namespaces across an agent restart.

``run`` is the service's whole life (the agent runs it again after a driver upgrade): read the driver
(retrying while the inventory is unavailable), start the supervisor, wait; cancelling it stops the
supervisor (quit, kill, stray servers) in a ``finally``, or, when the agent shuts down with handover
(``handover_on_exit``), detaches from it and leaves the daemon serving for the next agent. ``capability``
is what the inventory publisher asks for; ``on_change`` (the publisher's ``poke``) is called whenever the
supervisor's state changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from lightkube import AsyncClient

from gpufrac.contract.render import BoundContainer
from gpufrac.contract.request import ComputeMode
from gpufrac.kube.events import EventRecorder
from gpufrac.node.inject import InjectionPlan
from gpufrac.node.inventory.backend import InventoryUnavailable
from gpufrac.node.mps.config import MpsSettings
from gpufrac.node.mps.containers import MpsAdjustment, MpsContainerHooks, PreparedClaims, uses_mps
from gpufrac.node.mps.events import EventSink, NodeEventSink
from gpufrac.node.mps.mode import DriverVersion, NodeMpsCapability, capability_for
from gpufrac.node.mps.supervisor import MpsSupervisor, MpsUnavailable

log = logging.getLogger(__name__)


class LogEventSink:
    """Events as log lines, for an agent that does not talk to the API server (``--no-publish``)."""

    def emit(self, *, type: str, reason: str, message: str) -> None:
        log.warning("event %s %s: %s", type, reason, message)


class MpsService:
    def __init__(
        self,
        *,
        settings: MpsSettings,
        events: EventSink,
        read_driver: Callable[[], str],
        on_change: Callable[[], None] | None = None,
        retry_s: float = 5.0,
        recorder: EventRecorder | None = None,
        claims: PreparedClaims = tuple,
    ) -> None:
        """``recorder``: the ``EventRecorder`` behind ``events`` when this service owns it (it then runs
        for as long as ``run`` does, and flushes the Events of the final stop). ``claims``: the prepared
        DRA claims' shares (``gpufrac.node.mps.containers``), part of the live set from the start."""
        self._recorder = recorder
        self._claims = claims
        self._settings = settings
        self._events = events
        self._read_driver = read_driver
        self._on_change = on_change
        self._retry_s = retry_s
        self.supervisor: MpsSupervisor | None = None
        self._started: MpsContainerHooks | None = None
        self._pending: list[tuple[str, InjectionPlan]] | None = None
        self.hooks = _ServiceHooks(self)
        #: Set by the agent as it shuts down: leave the daemon serving for the next agent (``detach``)
        #: instead of stopping it. Off for a driver upgrade, which must stop MPS.
        self.handover_on_exit = False

    def capability(self, driver: DriverVersion) -> NodeMpsCapability:
        if self.supervisor is None:
            return capability_for(driver=driver, mps_running=False)
        return self.supervisor.capability()

    @classmethod
    def for_node(
        cls,
        *,
        node_name: str,
        client: AsyncClient | None,
        settings: MpsSettings,
        read_driver: Callable[[], str],
        on_change: Callable[[], None] | None = None,
        recorder: EventRecorder | None = None,
        counted: Callable[[EventSink], EventSink] = lambda sink: sink,
        claims: PreparedClaims = tuple,
    ) -> MpsService:
        """The service of a node agent: Events on its Node when it has an API client, log lines if not.

        ``recorder``: an ``EventRecorder`` the caller already runs (the node agent shares one between
        MPS and the audit); without one the service makes its own and runs it. ``counted`` wraps the
        sink (the agent's ``CountingMpsEvents``, so restarts and wedges are also metrics)."""
        if client is None:
            return cls(
                settings=settings,
                events=counted(LogEventSink()),
                read_driver=read_driver,
                on_change=on_change,
                claims=claims,
            )
        owned = recorder is None
        if recorder is None:
            recorder = EventRecorder(
                client=client, component="gpufrac-node-agent", instance=node_name, workers=1
            )
        return cls(
            settings=settings,
            events=counted(NodeEventSink(recorder=recorder, node_name=node_name)),
            read_driver=read_driver,
            on_change=on_change,
            recorder=recorder if owned else None,
            claims=claims,
        )

    async def run(self) -> None:
        driver = await self._driver()
        supervisor = MpsSupervisor(
            settings=self._settings, driver=driver, events=self._events, on_change=self._on_change
        )
        hooks = MpsContainerHooks(supervisor=supervisor, claims=self._claims)
        if self._pending is not None:  # the runtime's live containers, known before the daemon starts
            await hooks.on_synchronize(self._pending)
            self._pending = None
        else:  # the prepared claims' namespaces are made at the first READY all the same
            hooks.keep_claims()
        self.supervisor, self._started = supervisor, hooks
        recording = asyncio.create_task(self._recorder.run()) if self._recorder is not None else None
        try:
            await supervisor.start()
            await asyncio.Event().wait()
        finally:
            # Stopped for good or for a driver upgrade (the agent runs this again afterwards): until the
            # next run, containers that need MPS are refused; the stopped supervisor's capability says
            # MPS is not serving.
            self._started = None
            await hooks.close(timeout_s=self._settings.drain_timeout_s)  # drains in flight, briefly
            if self.handover_on_exit:
                await supervisor.detach()
            else:
                await supervisor.stop()
            if recording is not None:  # after the stop: its Events are flushed on cancellation
                recording.cancel()
                await asyncio.gather(recording, return_exceptions=True)

    async def _driver(self) -> DriverVersion:
        while True:
            try:
                return DriverVersion.parse(await asyncio.to_thread(self._read_driver))
            except InventoryUnavailable as error:
                log.warning("MPS: driver version unknown (%s); retrying in %.0fs", error, self._retry_s)
                await asyncio.sleep(self._retry_s)


class _ServiceHooks:
    """``ContainerHooks`` that exist before the supervisor does."""

    def __init__(self, service: MpsService) -> None:
        self._service = service

    async def on_create(self, plan: InjectionPlan, *, container_id: str) -> MpsAdjustment:
        started = self._service._started
        if started is None:
            if uses_mps(plan):
                raise MpsUnavailable("the MPS supervisor has not started yet (driver version not read)")
            return MpsAdjustment()
        return await started.on_create(plan, container_id=container_id)

    async def on_stop(self, *, container_id: str) -> None:
        if self._service._started is not None:
            await self._service._started.on_stop(container_id=container_id)

    async def on_remove(self, *, container_id: str) -> None:
        if self._service._started is not None:
            await self._service._started.on_remove(container_id=container_id)

    async def on_resize(self, bound: BoundContainer, *, container_id: str) -> str | None:
        if self._service._started is None:
            return (
                None if bound.mode is not ComputeMode.SM_SHARING else "the MPS supervisor has not started yet"
            )
        return await self._service._started.on_resize(bound, container_id=container_id)

    async def on_synchronize(self, containers: Iterable[tuple[str, InjectionPlan]]) -> None:
        if self._service._started is None:
            self._service._pending = list(containers)
            return
        await self._service._started.on_synchronize(containers)
