"""The NRI plugin's connection to the runtime: register, answer the runtime's calls, reconnect.

One session is one connection to the runtime's NRI socket (containerd: /var/run/nri/nri.sock), as a Go
plugin built on NRI's ``pkg/stub`` would make it:

1. connect, multiplex the socket (``mux``), serve the Plugin service on connection 1 (``ttrpc``);
2. call ``Runtime.RegisterPlugin`` with the plugin's name and index (the runtime orders plugins by index);
3. the runtime calls ``Configure`` (we answer the events we subscribe to), then ``Synchronize`` with every
   pod and container it has -- possibly split over several calls flagged ``more`` -- then the events.

When the runtime restarts or drops us the socket closes; ``run`` connects again with exponential backoff
(reset once a session got as far as registering), and the next ``Synchronize`` brings the handler up to
date. A runtime that sends malformed data (``mux.MalformedData``) is treated the same way: the session
ends, the socket is dropped, and the plugin reconnects; nothing a runtime sends ends ``run``.
Everything gpufrac-specific lives behind ``NriHandler``; this module only speaks the protocol.

CreateContainer sits on the runtime's critical path with a 2 s budget per plugin (after which the runtime
drops the plugin), so requests are decoded and answered on the event loop with no thread hops, and each
runs in its own task so a slow StopContainer never holds up a create.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.node.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MalformedData, Mux, TrunkClosed
from gpufrac.node.nri.ttrpc import Code, Method, TtrpcClient, TtrpcError, TtrpcServer

log = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"


def nri_version() -> str:
    """The NRI version our messages were generated from (reported at registration, as Go plugins do)."""
    try:
        stamp = resources.files("gpufrac._generated.nri").joinpath("PINNED_VERSION").read_text()
    except OSError:
        return "unknown"
    for pin in stamp.split():
        module, _, version = pin.partition("@")
        if module == "github.com/containerd/nri":
            return version
    return "unknown"


class ContainerRejected(Exception):
    """Raised by a handler to fail the container; the message is what the user sees in the pod status."""


class NriHandler(Protocol):
    """What the plugin does at each point of the runtime's lifecycle (gpufrac's lives in ``handler``)."""

    def events(self) -> Iterable[int]:
        """The ``api.Event`` values to subscribe to."""
        ...

    async def configure(self, *, config: str, runtime_name: str, runtime_version: str) -> None: ...

    async def synchronize(
        self, *, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> None: ...

    async def create_container(
        self, *, pod: api.PodSandbox, container: api.Container
    ) -> api.ContainerAdjustment | None: ...

    async def start_container(self, *, pod: api.PodSandbox, container: api.Container) -> None:
        """Called after the container exists (its cgroup and paused init process) and before its workload
        runs; raising ``ContainerRejected`` fails the start. Only called when subscribed."""
        ...

    async def stop_container(self, *, pod: api.PodSandbox, container: api.Container) -> None: ...

    async def remove_container(self, *, pod: api.PodSandbox, container: api.Container) -> None: ...

    async def validate_container_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> str | None:
        """Why the container must not be created with the adjustment every plugin made (the runtime's
        final one, with the plugins it consulted), or None to let it be. Only called when subscribed
        (``VALIDATE_CONTAINER_ADJUSTMENT``); the runtime asks validators after every plugin answered."""
        ...

    async def shutdown(self) -> None: ...


def event_mask(events: Iterable[int]) -> int:
    """NRI's EventMask: bit ``event - 1`` per subscribed event."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


@dataclass(frozen=True, slots=True)
class PluginIdentity:
    name: str = keys.NRI_PLUGIN_NAME
    #: Two digits; the runtime calls plugins in ascending index order. 10 runs gpufrac early, so plugins
    #: after it see the enforcement env (and cannot silently take it over: NRI refuses a second owner).
    index: str = "10"


class NriPlugin:
    """Connects to the runtime and keeps connecting; ``run`` until cancelled."""

    def __init__(
        self,
        *,
        handler: NriHandler,
        socket_path: str = DEFAULT_SOCKET,
        identity: PluginIdentity = PluginIdentity(),
        registration_timeout_s: float = 5.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        on_state: Callable[[bool], None] | None = None,
    ) -> None:
        self._handler = handler
        self._socket_path = socket_path
        self._identity = identity
        self._registration_timeout_s = registration_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._on_state = on_state
        self._sync_pods: list[api.PodSandbox] = []
        self._sync_containers: list[api.Container] = []
        #: Set while a session is registered and synchronized: the plugin is in the runtime's path.
        self.synchronized = asyncio.Event()
        self.sessions = 0
        self.last_error: str | None = None
        self.last_sync_parts = 0  # how many Synchronize calls the last synchronization took

    # -- lifecycle --------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the runtime, reconnecting with backoff whenever the connection goes away."""
        delay = self._backoff_initial_s
        while True:
            registered = False
            try:
                registered = await self._session()
            except MalformedData as exc:  # the runtime's bytes, not the network: say so louder
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("nri: dropped the connection: %s", exc, extra={"socket": self._socket_path})
            except (OSError, TrunkClosed, TtrpcError, TimeoutError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.info(
                    "nri: not connected to the runtime (%s)",
                    self.last_error,
                    extra={"socket": self._socket_path},
                )
            except Exception as exc:  # whatever else a session meets, the plugin stays in the runtime's path
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("nri: session failed; reconnecting", extra={"socket": self._socket_path})
            finally:
                self._set_synchronized(False)
            if registered:
                delay = self._backoff_initial_s
            await asyncio.sleep(delay)
            delay = min(self._backoff_max_s, delay * 2)

    def _set_synchronized(self, value: bool) -> None:
        if value == self.synchronized.is_set():
            return
        if value:
            self.synchronized.set()
        else:
            self.synchronized.clear()
        if self._on_state is not None:
            self._on_state(value)

    async def _session(self) -> bool:
        """One connection, until the runtime closes it. Returns whether registration got through."""
        reader, writer = await asyncio.open_unix_connection(self._socket_path)
        mux = Mux(reader=reader, writer=writer)
        server = TtrpcServer(mux=mux, conn_id=PLUGIN_SERVICE_CONN, methods=self._methods())
        client = TtrpcClient(mux=mux, conn_id=RUNTIME_SERVICE_CONN)
        self._sync_pods, self._sync_containers = [], []
        reading = asyncio.create_task(mux.run(), name="nri-mux")
        registered = False
        try:
            request = api.RegisterPluginRequest(
                plugin_name=self._identity.name, plugin_idx=self._identity.index, NRI_version=nri_version()
            )
            registering = asyncio.create_task(
                client.call(
                    service=RUNTIME_SERVICE,
                    method="RegisterPlugin",
                    payload=request.SerializeToString(),
                    timeout_s=self._registration_timeout_s,
                )
            )
            done, _ = await asyncio.wait({registering, reading}, return_when=asyncio.FIRST_COMPLETED)
            if registering not in done:  # the socket closed first
                registering.cancel()
                # gather, not suppress(CancelledError): a cancellation of this task must not be swallowed
                await asyncio.gather(registering, return_exceptions=True)
                await reading  # raises TrunkClosed
                raise TrunkClosed("the runtime closed the socket before registration")
            await registering  # raises when the runtime refused the registration
            registered = True
            self.sessions += 1
            log.info(
                "nri: registered as %s-%s",
                self._identity.index,
                self._identity.name,
                extra={"socket": self._socket_path, "session": self.sessions},
            )
            await reading  # until the runtime goes away (raises TrunkClosed)
        finally:
            reading.cancel()
            client.fail_pending(TrunkClosed("the NRI session ended"))
            await server.close()
            await asyncio.gather(reading, return_exceptions=True)  # as above: our own cancel propagates
            await mux.close()
        return registered

    # -- the Plugin service -----------------------------------------------------------------------------

    def _methods(self) -> dict[tuple[str, str], Method]:
        def unary(request_type: type, handle: Callable[[object], Awaitable[object]]) -> Method:
            async def method(payload: bytes) -> bytes:
                reply = await handle(request_type.FromString(payload))
                return reply.SerializeToString()  # type: ignore[attr-defined]

            return method

        async def noop_reply(reply_type: type) -> object:
            return reply_type()

        def ignore(request_type: type, reply_type: type) -> Method:
            return unary(request_type, lambda _request: noop_reply(reply_type))

        table: dict[str, Method] = {
            "Configure": unary(api.ConfigureRequest, self._configure),
            "Synchronize": unary(api.SynchronizeRequest, self._synchronize),
            "Shutdown": unary(api.Empty, self._shutdown),
            "CreateContainer": unary(api.CreateContainerRequest, self._create_container),
            "StartContainer": unary(api.StartContainerRequest, self._start_container),
            "StopContainer": unary(api.StopContainerRequest, self._stop_container),
            "RemoveContainer": unary(api.RemoveContainerRequest, self._remove_container),
            "StateChange": unary(api.StateChangeEvent, self._state_change),
            # Not subscribed to; answered anyway, as NRI's stub does, should a runtime call them.
            "UpdateContainer": ignore(api.UpdateContainerRequest, api.UpdateContainerResponse),
            "PostUpdateContainer": ignore(api.PostUpdateContainerRequest, api.PostUpdateContainerResponse),
            "PostStartContainer": ignore(api.PostStartContainerRequest, api.PostStartContainerResponse),
            "PostCreateContainer": ignore(api.PostCreateContainerRequest, api.PostCreateContainerResponse),
            "RunPodSandbox": ignore(api.RunPodSandboxRequest, api.RunPodSandboxResponse),
            "UpdatePodSandbox": ignore(api.UpdatePodSandboxRequest, api.UpdatePodSandboxResponse),
            "PostUpdatePodSandbox": ignore(api.PostUpdatePodSandboxRequest, api.PostUpdatePodSandboxResponse),
            "StopPodSandbox": ignore(api.StopPodSandboxRequest, api.StopPodSandboxResponse),
            "RemovePodSandbox": ignore(api.RemovePodSandboxRequest, api.RemovePodSandboxResponse),
            "ValidateContainerAdjustment": unary(api.ValidateContainerAdjustmentRequest, self._validate),
        }
        return {(PLUGIN_SERVICE, name): method for name, method in table.items()}

    async def _configure(self, request: api.ConfigureRequest) -> api.ConfigureResponse:
        log.info(
            "nri: configured by %s %s (NRI %s)",
            request.runtime_name,
            request.runtime_version,
            request.NRI_version or "unknown",
            extra={"request_timeout_ms": request.request_timeout},
        )
        await self._handler.configure(
            config=request.config, runtime_name=request.runtime_name, runtime_version=request.runtime_version
        )
        return api.ConfigureResponse(events=event_mask(self._handler.events()))

    async def _synchronize(self, request: api.SynchronizeRequest) -> api.SynchronizeResponse:
        if not self._sync_pods and not self._sync_containers:
            self.last_sync_parts = 0
        self.last_sync_parts += 1
        self._sync_pods.extend(request.pods)
        self._sync_containers.extend(request.containers)
        if request.more:  # the runtime split a large state; the last part has more=false
            return api.SynchronizeResponse(more=True)
        pods, containers = self._sync_pods, self._sync_containers
        self._sync_pods, self._sync_containers = [], []
        await self._handler.synchronize(pods=pods, containers=containers)
        self._set_synchronized(True)
        return api.SynchronizeResponse(more=False)

    async def _shutdown(self, _request: api.Empty) -> api.Empty:
        await self._handler.shutdown()
        return api.Empty()

    async def _create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        try:
            adjust = await self._handler.create_container(pod=request.pod, container=request.container)
        except ContainerRejected as exc:
            raise TtrpcError(Code.UNKNOWN, str(exc)) from exc
        return (
            api.CreateContainerResponse(adjust=adjust)
            if adjust is not None
            else api.CreateContainerResponse()
        )

    async def _start_container(self, request: api.StartContainerRequest) -> api.StartContainerResponse:
        try:
            await self._handler.start_container(pod=request.pod, container=request.container)
        except ContainerRejected as exc:
            raise TtrpcError(Code.UNKNOWN, str(exc)) from exc
        return api.StartContainerResponse()

    async def _stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        await self._handler.stop_container(pod=request.pod, container=request.container)
        return api.StopContainerResponse()

    async def _remove_container(self, request: api.RemoveContainerRequest) -> api.RemoveContainerResponse:
        await self._handler.remove_container(pod=request.pod, container=request.container)
        return api.RemoveContainerResponse()

    async def _validate(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        reason = await self._handler.validate_container_adjustment(request)
        return api.ValidateContainerAdjustmentResponse(reject=reason is not None, reason=reason or "")

    async def _state_change(self, event: api.StateChangeEvent) -> api.Empty:
        # Runtimes that predate the dedicated RPCs relay some events here (NRI's stub does the same).
        if event.event == api.REMOVE_CONTAINER:
            await self._handler.remove_container(pod=event.pod, container=event.container)
        return api.Empty()
