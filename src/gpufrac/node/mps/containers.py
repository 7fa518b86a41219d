"""What MPS does for each container, behind the ``ContainerHooks`` seam the NRI plugin calls (REAL).

The NRI plugin owns the runtime conversation and ``gpufrac.node.inject`` owns the injection plan (env,
the MPS directory mount at a private, empty per-container leaf). MPS owns its daemon. They meet here:

- ``on_create(plan, container_id=)`` at CreateContainer, before answering: returns an ``MpsAdjustment``
  that ``apply_adjustment`` folds into the plan, or raises ``MpsUnavailable``, which the plugin turns into
  a failed container (fail-closed: an sm-sharing container must not run without its ceiling);
- ``on_stop(container_id=)`` at StopContainer: drains the container's MPS clients — those whose PID is
  in the container's cgroup (``/proc/<pid>/cgroup`` ∩ ``client list``) — in a background task, one per
  container (a second StopContainer joins the first: terminating a client twice would fail the second
  time and look like a wedge); StopContainer waits for it ``drain_timeout_s`` at most, under NRI's 2 s,
  while each ``client terminate`` may take ``terminate_timeout_s`` (30 s) to drain its GPU work;
- ``on_remove(container_id=)`` at RemoveContainer: deletes the namespace and its directory;
- ``on_synchronize(containers)`` at Synchronize (every NRI connection): the live set, so an agent restart
  recreates the namespaces of running containers instead of stranding them.

DRA claims (``gpufrac.node.dra.plugin``) use the same hooks with a share's key (``<claim uid>-<device>``,
the name of its CDI device) in place of a container id: ``on_create`` at prepare (before the CDI spec is
written, so the spec mounts the namespace's directory), ``on_remove`` at unprepare. A share outlives its
containers (several may use it, one after the other), so its namespace is the claim's, not a
container's; it is never drained at StopContainer (the kubelet unprepares only once the pod's containers
are gone). The live set is the runtime's containers AND the prepared claims (``claims``, read from their
CDI specs at every Synchronize and when the service starts), so neither an NRI reconcile nor an agent
restart deletes a prepared claim's namespace as an orphan, and one whose spec is gone (an agent that
died between removing the spec and the namespace at unprepare) is deleted as one.

Per mode:

- v3, sm-sharing: a namespace ``names.namespace_name(<id>)`` (``gpufrac_<id prefix>_<digest>``) on the
  shared server with an active-thread ceiling of floor(portion x 100) % (at least 1) and the container's
  memory limit as its pinned-memory limit; the mount is re-pointed at the namespace's pipe directory as
  the daemon reports it, the container's only MPS directory, so its processes reach that namespace and
  nothing else. The ceiling is enforced by the server; the plan's
  client env (same values) only narrows it further.
- classic, sm-sharing: the mount is re-pointed at the node's pipe directory; the ceiling and the memory
  limit are the plan's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (client-side limits: the only ones classic MPS has).
- time-slicing, v3 with ``time_slicing_clients``: the mount is re-pointed at the container's own
  directory holding only a hard link to the daemon's default socket (``default_socket``), so its
  processes are MPS clients of the default server (memory accounting, the plan's pinned-memory variable)
  and reach no sm-sharing namespace; they are drained at StopContainer as sm-sharing clients are.
- time-slicing otherwise, and exclusive: no change — the private leaf holds no control socket, so such
  containers are not MPS clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gpufrac.contract.render import BoundContainer
from gpufrac.contract.request import ComputeMode
from gpufrac.node.inject import CUDA_MPS_PIPE_DIRECTORY, InjectionPlan, active_thread_percentage
from gpufrac.node.mps.control import MpsClient
from gpufrac.node.mps.mode import MpsMode
from gpufrac.node.mps.names import namespace_name
from gpufrac.node.mps.supervisor import (
    DrainResult,
    MpsSupervisor,
    MpsUnavailable,
    NamespaceSpec,
    SupervisorState,
)
from gpufrac.node.usage.cgroup import container_id_of

log = logging.getLogger(__name__)

#: The classic MPS pipe directory's mount: read-only, nothing executable or a device
#: (``read_only_shared_pipe``; why: ``gpufrac.node.nri.handler``).
SHARED_PIPE_MOUNT_OPTIONS = ("rbind", "ro", "nosuid", "nodev", "noexec")


@dataclass(frozen=True, slots=True)
class MpsAdjustment:
    """What MPS changes in a container's injection plan: the host directory mounted as its MPS directory
    (``None``: keep the plan's private leaf, which holds no socket, so the container is no MPS client)."""

    pipe_source: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def apply_adjustment(plan: InjectionPlan, adjustment: MpsAdjustment) -> InjectionPlan:
    """``plan`` with the MPS directory mount re-pointed and ``env`` merged (pure)."""
    pipe_dir = plan.env_map.get(CUDA_MPS_PIPE_DIRECTORY)
    mounts = plan.mounts
    if adjustment.pipe_source is not None:
        mounts = tuple(
            dataclasses.replace(m, source=adjustment.pipe_source) if m.destination == pipe_dir else m
            for m in plan.mounts
        )
        if pipe_dir is None:
            raise ValueError("an MPS adjustment for a plan without an MPS directory")
    env = {**plan.env_map, **adjustment.env}
    return dataclasses.replace(plan, mounts=mounts, env=tuple(env.items()))


class ContainerHooks(Protocol):
    """Called by the NRI plugin's handler at the container's lifecycle points (see the module docstring).

    ``on_create`` runs before CreateContainer is answered; its result goes through ``apply_adjustment``.
    ``on_stop`` and ``on_remove`` must not raise for containers they do not know.
    """

    async def on_create(self, plan: InjectionPlan, *, container_id: str) -> MpsAdjustment: ...

    async def on_stop(self, *, container_id: str) -> None: ...

    async def on_remove(self, *, container_id: str) -> None: ...

    async def on_synchronize(self, containers: Iterable[tuple[str, InjectionPlan]]) -> None: ...


#: The prepared DRA claims' shares as ``(key, plan)``, read when the live set is needed.
PreparedClaims = Callable[[], Iterable[tuple[str, InjectionPlan]]]


def thread_ceiling(portion: float | None) -> int:
    """The namespace's active-thread percentage (``inject.active_thread_percentage``; 100 without one)."""
    return 100 if portion is None else active_thread_percentage(portion)


def uses_mps(plan: InjectionPlan) -> bool:
    """Whether a container with this plan is an MPS client (sm-sharing, not a whole GPU)."""
    return plan.bound.mode is ComputeMode.SM_SHARING and not plan.bound.exclusive


def namespace_spec(plan: InjectionPlan, *, owner: str) -> NamespaceSpec:
    """The MPS namespace of a container or a claim's share (``owner``: the container id or the share's
    key): its active-thread ceiling from the compute portion, its pinned-memory cap from the limit."""
    return NamespaceSpec(
        name=namespace_name(owner),
        active_thread_percentage=thread_ceiling(plan.bound.compute_portion),
        pinned_memory_limit_mib=plan.bound.limit_mib,
        container_id=owner,
    )


def read_only_shared_pipe(plan: InjectionPlan, *, shared_pipe_dir: str | None) -> InjectionPlan:
    """``plan`` with a mount of classic MPS's shared pipe directory made read-only, nosuid, nodev, noexec
    (``SHARED_PIPE_MOUNT_OPTIONS``); unchanged without ``shared_pipe_dir`` (the mount stays writable)."""
    if shared_pipe_dir is None:
        return plan
    return dataclasses.replace(
        plan,
        mounts=tuple(
            dataclasses.replace(m, options=SHARED_PIPE_MOUNT_OPTIONS)
            if m.source.rstrip("/") == shared_pipe_dir.rstrip("/")
            else m
            for m in plan.mounts
        ),
    )


def time_slicing_fraction(plan: InjectionPlan) -> bool:
    """Whether a container with this plan is a time-slicing fraction (a default-socket client when
    ``time_slicing_clients`` is on)."""
    return plan.bound.mode is ComputeMode.TIME_SLICING and not plan.bound.exclusive


class MpsContainerHooks:
    """The ``ContainerHooks`` of a node running MPS."""

    def __init__(
        self,
        *,
        supervisor: MpsSupervisor,
        proc_root: Path = Path("/proc"),
        claims: PreparedClaims = tuple,
    ) -> None:
        """``proc_root``: the host's /proc (the agent runs with hostPID), where a client PID's cgroup
        names its container. ``claims``: the prepared DRA claims' shares, the live set's other half."""
        self._supervisor = supervisor
        self._claims = claims
        self._proc_root = proc_root
        self._sm: set[str] = set()
        self._ts: set[str] = set()  # time-slicing containers on the default socket
        self._reconciling: asyncio.Task[None] | None = None
        self._drains: dict[str, asyncio.Task[DrainResult]] = {}
        self.last_drain: DrainResult | None = None

    async def on_synchronize(self, containers: Iterable[tuple[str, InjectionPlan]]) -> None:
        """The runtime's live containers (``(container id, plan)``), after every NRI (re)connection.

        Their namespaces become the supervisor's live set: after an agent restart they are recreated in
        the same directories (which the running containers have mounted), and namespaces of containers
        that went away meanwhile are deleted. Before the daemon is READY this only records them (the
        reconcile at READY does the rest); after, the reconcile runs in the background so Synchronize is
        answered at once."""
        containers = [*containers, *self._claims()]
        live = [(cid, plan) for cid, plan in containers if uses_mps(plan)]
        self._sm = {cid for cid, _ in live}
        supervisor = self._supervisor
        links = supervisor.default_links
        if links is not None:
            self._ts = {cid for cid, plan in containers if time_slicing_fraction(plan)}
            links.set_live(self._ts)
        if supervisor.mode is not MpsMode.V3:
            return
        supervisor.set_namespaces([namespace_spec(plan, owner=cid) for cid, plan in live])
        if supervisor.state is SupervisorState.READY:
            self._reconciling = asyncio.create_task(supervisor.reconcile_logged(), name="mps-reconcile")

    def keep_claims(self) -> None:
        """Before the runtime's first Synchronize: the prepared claims' namespaces join the live set (and
        are created at the daemon's first reconcile), without declaring it complete -- the runtime's
        containers are not known yet, so nothing is deleted as an orphan until they are."""
        claims = list(self._claims())
        live = [(key, plan) for key, plan in claims if uses_mps(plan)]
        self._sm |= {key for key, _ in live}
        links = self._supervisor.default_links
        if links is not None:
            for key, plan in claims:
                if time_slicing_fraction(plan):
                    self._ts.add(key)
                    with contextlib.suppress(OSError, ValueError):  # linked again at the next Synchronize
                        links.add(key)
        if self._supervisor.mode is MpsMode.V3:
            self._supervisor.keep_namespaces(namespace_spec(plan, owner=key) for key, plan in live)

    async def on_create(self, plan: InjectionPlan, *, container_id: str) -> MpsAdjustment:
        supervisor = self._supervisor
        links = supervisor.default_links
        if links is not None and time_slicing_fraction(plan):
            # Linked now if the daemon serves, else at its READY: the container never waits for MPS (its
            # first guard is the cgroup limit; a CUDA process finding no socket runs without MPS).
            try:
                directory = links.add(container_id)
            except (OSError, ValueError) as error:  # PipeDirTooLong is a ValueError
                raise MpsUnavailable(f"default MPS socket for container {container_id}: {error}") from error
            self._ts.add(container_id)
            return MpsAdjustment(pipe_source=str(directory))
        if not uses_mps(plan):
            return MpsAdjustment()
        if supervisor.mode is MpsMode.V3:
            spec = namespace_spec(plan, owner=container_id)
            pipe_directory = await supervisor.ensure_namespace(spec)
            self._sm.add(container_id)
            return MpsAdjustment(pipe_source=str(pipe_directory))
        if not await supervisor.wait_ready(timeout_s=supervisor.settings.create_wait_s):
            raise MpsUnavailable(f"the MPS daemon is {supervisor.state}, not serving")
        self._sm.add(container_id)
        # Classic MPS has one pipe directory; the limits travel as the client env the plan already holds.
        return MpsAdjustment(pipe_source=str(supervisor.settings.pipe_dir))

    async def on_resize(self, bound: BoundContainer, *, container_id: str) -> str | None:
        """A running sm-sharing container's new portion and limit (a live resize, ``gpufrac.node.resize``):
        its namespace takes them where MPS lets it (``MpsSupervisor.resize_namespace``); None when they
        hold, else why not. Nothing for other containers."""
        if bound.mode is not ComputeMode.SM_SHARING or bound.exclusive or container_id not in self._sm:
            return None
        if self._supervisor.mode is not MpsMode.V3:
            return (
                "classic MPS: the container's processes keep CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and "
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as they started with them"
            )
        spec = NamespaceSpec(
            name=namespace_name(container_id),
            active_thread_percentage=thread_ceiling(bound.compute_portion),
            pinned_memory_limit_mib=bound.limit_mib,
            container_id=container_id,
        )
        return await self._supervisor.resize_namespace(spec)

    async def on_stop(self, *, container_id: str) -> None:
        """Starts (or joins) the container's drain and waits for it ``drain_timeout_s`` at most."""
        if container_id not in self._sm and container_id not in self._ts:
            return
        task = self._drains.get(container_id)
        if task is None:
            task = asyncio.create_task(self._drain(container_id), name=f"mps-drain-{container_id[:12]}")
            self._drains[container_id] = task
            task.add_done_callback(lambda done: self._drained(container_id, done))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._supervisor.settings.drain_timeout_s):
                await asyncio.shield(task)  # past the timeout the drain goes on; StopContainer does not wait

    async def drained(self, *, container_id: str) -> DrainResult | None:
        """The result of the container's drain in flight (None when none is)."""
        task = self._drains.get(container_id)
        return None if task is None else await asyncio.shield(task)

    async def close(self, *, timeout_s: float) -> None:
        """At shutdown: waits ``timeout_s`` for the drains in flight, then cancels what is left."""
        tasks = list(self._drains.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _drain(self, container_id: str) -> DrainResult:
        proc_root = self._proc_root

        def owns(client: MpsClient) -> bool:
            return container_id_of(pid=client.pid, proc_root=proc_root) == container_id

        return await self._supervisor.drain(owns=owns)

    def _drained(self, container_id: str, task: asyncio.Task[DrainResult]) -> None:
        if self._drains.get(container_id) is task:
            del self._drains[container_id]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning("MPS drain of container %s failed: %r", container_id, error)
            return
        self.last_drain = task.result()

    async def on_remove(self, *, container_id: str) -> None:
        if container_id in self._ts:
            self._ts.discard(container_id)
            if self._supervisor.default_links is not None:
                self._supervisor.default_links.remove(container_id)
            return
        if container_id not in self._sm:
            return
        self._sm.discard(container_id)
        if self._supervisor.mode is MpsMode.V3:
            await self._supervisor.release_namespace(namespace_name(container_id))
