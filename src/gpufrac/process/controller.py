"""The skeleton every gpufrac controller runs on: informers, a Lease, probes, a leader's work, shutdown.

The scheduler and the operator are both "keep informers current on every replica, let only the Lease
holder write" controllers. What they share lives here once, so the two cannot drift again:

- Leader election on its own connection pool (as kube-scheduler does: a renew must never queue behind
  a burst of the controller's own writes, or a busy leader loses its lease for being busy).
- /healthz (started, and not failed), /readyz (informers synced; "leading" once the leader's work runs,
  else "standby (synced)") and /metrics, with the event loop's lag (``gpufrac.process.loop_lag``).
- Informers a controller can only start once it knows their resource exists (the scheduler's Queue
  informers wait for their CRD) come as ``InformerSource`` s: the runner runs them with the others, and
  /readyz and the leader's work wait for them the same way.
- The leader's work starts once every informer has synced and the lease is held.
- Shutdown order: stop the leader's work, let writes in flight finish (the controller's ``drain``),
  then release the lease, so a successor never writes while this replica still does; then the rest.
- ``Handler`` adapts an informer's three callbacks to ``changed(old or None, new)`` and ``deleted(obj)``.

Losing the lease ends ``run()`` with ``LeadershipLost``; ``serve`` turns that into exit code 1 (the
Deployment restarts the replica, which comes back as a standby), and SIGTERM/SIGINT into a clean stop
with exit code 0 (``gpufrac.process.signals``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx2
from lightkube import AsyncClient
from prometheus_client import CollectorRegistry

from gpufrac.kube.informer import Informer
from gpufrac.kube.lease import LeaderElector, LeadershipLost, LeaseTiming
from gpufrac.process.loop_lag import LoopLag
from gpufrac.process.probes import ProbeServer

log = logging.getLogger(__name__)


def default_identity() -> str:
    """A replica's name in its Lease when none is given: the pod's name from the Downward API
    (``POD_NAME``, which the chart sets), what a person reading the Lease finds with kubectl; outside a
    pod, host, process and a random suffix, so two replicas never share a name."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


class InformerSource(Protocol):
    """Informers that a controller starts itself (for instance once their CRD is found installed)."""

    @property
    def synced(self) -> bool:
        """Every informer it runs has listed (or it knows it has none to run)."""
        ...

    async def run(self) -> None: ...

    async def wait_synced(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Election:
    """Where the Lease is and its timing; ``None`` in place of an Election: no leader election."""

    lease_name: str
    lease_namespace: str
    timing: LeaseTiming = field(default_factory=LeaseTiming)


@dataclass(frozen=True, slots=True)
class Handler:
    """Adapts the informer's callbacks to ``changed(old or None, new)`` and ``deleted(obj)``."""

    changed: Callable[[Any, Any], None]
    deleted: Callable[[Any], None]

    def on_add(self, obj: Any) -> None:
        self.changed(None, obj)

    def on_update(self, old: Any, new: Any) -> None:
        self.changed(old, new)

    def on_delete(self, obj: Any) -> None:
        self.deleted(obj)


class ControllerRunner:
    """Runs one controller replica; see the module docstring.

    ``lead`` is the leader's work (it runs until cancelled); ``background`` are coroutines every
    replica runs (an event recorder, timers); ``drain`` waits for writes in flight at shutdown.
    """

    def __init__(
        self,
        *,
        name: str,
        client: AsyncClient,
        identity: str,
        informers: Sequence[Informer[Any]],
        lead: Callable[[], Awaitable[None]],
        sources: Sequence[InformerSource] = (),
        registry: CollectorRegistry,
        http_host: str,
        http_port: int,
        election: Election | None,
        lease_client: AsyncClient | None = None,
        background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
        drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.identity = identity
        self.informers = tuple(informers)
        self._sources = tuple(sources)
        self._lead_work = lead
        self._background = tuple(background)
        self._drain = drain
        self.elector: LeaderElector | None = None
        self._lease_client: AsyncClient | None = None
        self._owns_lease_client = False
        if election is not None:
            self._lease_client = lease_client or AsyncClient(
                config=client.config, timeout=httpx2.Timeout(5.0)
            )
            self._owns_lease_client = lease_client is None
            self.elector = LeaderElector(
                client=self._lease_client,
                name=election.lease_name,
                namespace=election.lease_namespace,
                identity=identity,
                timing=election.timing,
            )
        self._probes = ProbeServer(
            host=http_host, port=http_port, registry=registry, healthy=self._healthy, ready=self._ready
        )
        self.loop_lag = LoopLag(registry)
        self._started = False
        self._working = False
        self._failed: BaseException | None = None

    # -- state --------------------------------------------------------------------------------------------

    @property
    def probe_port(self) -> int:
        return self._probes.port

    def is_leader(self) -> bool:
        """The fence to check right before each write."""
        return self.elector is None or self.elector.is_leader

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers) and all(s.synced for s in self._sources)

    @property
    def working(self) -> bool:
        """True while the leader's work runs on this replica."""
        return self._working

    async def wait_working(self, timeout: float | None = None) -> None:
        async def poll() -> None:
            while not self._working:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(poll(), timeout=timeout)

    # -- running ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled (clean stop) or until something fails (``LeadershipLost`` included)."""
        await self._probes.start()
        self._started = True
        log.info(
            "%s starting as %s; probes and metrics on port %d", self.name, self.identity, self.probe_port
        )
        background = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.informers]
        background += [asyncio.create_task(s.run(), name=f"{self.name}-source") for s in self._sources]
        background += [
            asyncio.create_task(make(), name=f"{self.name}-background") for make in self._background
        ]
        background.append(asyncio.create_task(self.loop_lag.run(), name=f"{self.name}-loop-lag"))
        elector = asyncio.create_task(self.elector.run(), name="lease") if self.elector else None
        lead = asyncio.create_task(self._lead(), name=f"{self.name}-lead")
        watched = [*background, lead, *([elector] if elector else [])]
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is not None:
                    raise error
            raise RuntimeError(f"task {next(iter(done)).get_name()} ended unexpectedly")
        except BaseException as error:
            if not isinstance(error, asyncio.CancelledError):
                self._failed = error
            raise
        finally:
            # 1. stop the leader's work; 2. let writes in flight finish; 3. only then give up the lease;
            # 4. the rest.
            self._working = False
            await cancel(lead)
            if self._drain is not None:
                await self._drain()
            if elector is not None:
                await cancel(elector)
            await cancel(*background)
            await self._probes.stop()
            if self._lease_client is not None and self._owns_lease_client:
                await self._lease_client.close()
            log.info("%s %s stopped", self.name, self.identity)

    async def _lead(self) -> None:
        for informer in self.informers:
            await informer.synced.wait()
        for source in self._sources:
            await source.wait_synced()
        if self.elector is not None:
            await self.elector.leading.wait()
        self._working = True
        await self._lead_work()

    def _healthy(self) -> tuple[bool, str]:
        if self._failed is not None:
            return False, f"failed: {self._failed}"
        return self._started, "running" if self._started else "starting"

    def _ready(self) -> tuple[bool, str]:
        if not self.synced:
            return False, "informers not synced"
        return True, "leading" if self._working else "standby (synced)"


async def cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancel ``tasks`` and wait for each to end, whatever it ends with."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def serve(
    *,
    name: str,
    kubeconfig: Path | None,
    field_manager: str,
    build: Callable[[AsyncClient], Any],
) -> int:
    """Connect, build the controller (anything with ``run()``) and run it until SIGTERM/SIGINT (exit code
    0) or a failure such as a lost lease (1)."""
    from gpufrac.kube.client import connect
    from gpufrac.process.heap import tune_collector
    from gpufrac.process.signals import run_until_signal

    client = connect(kubeconfig=kubeconfig, field_manager=field_manager)
    try:
        controller = build(client)
        tune_collector()  # after the imports and the build: what is alive now lives as long as the process
        return await run_until_signal(controller.run(), name=name, expected=(LeadershipLost,))
    finally:
        await client.close()


__all__ = ["ControllerRunner", "Election", "Handler", "LeadershipLost", "cancel", "serve"]
