"""What MPS does for each container, behind the ``ContainerHooks`` seam the NRI plugin calls (REAL).

The NRI plugin owns the runtime conversation; MPS owns its daemon. They meet here: the plugin turns its
injection plan into a ``ContainerGpu`` and calls

- ``on_create`` at CreateContainer, before answering: returns the extra env and mounts (or raises
  ``MpsUnavailable``, which the plugin turns into a failed container — fail-closed);
- ``on_stop`` at StopContainer: drains the container's MPS clients, bounded by ``drain_timeout_s``;
- ``on_remove`` at RemoveContainer: deletes the namespace and its directory.

Per mode:

- v3, sm-sharing: a namespace ``ctr-<id prefix>`` on the shared server with an active-thread ceiling of
  floor(portion x 100) % (at least 1) and the container's memory limit as its pinned-memory limit; the
  namespace's own directory is mounted as the container's only MPS directory, so its processes can reach
  that namespace and nothing else.
- classic, sm-sharing: the node's pipe directory is mounted, and the ceiling and memory limit travel as
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (client-side limits: the
  only ones classic MPS has).
- time-slicing, either mode: nothing — such containers are not MPS clients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.contract.request import ComputeMode
from gpufrac.node.mps.control import MpsClient
from gpufrac.node.mps.mode import MpsMode
from gpufrac.node.mps.supervisor import DrainResult, MpsSupervisor, MpsUnavailable, NamespaceSpec
from gpufrac.node.usage.cgroup import container_id_of

NAMESPACE_PREFIX = "ctr-"


@dataclass(frozen=True, slots=True)
class ContainerGpu:
    """The part of a container's injection plan MPS needs."""

    container_id: str
    mode: ComputeMode
    compute_portion: float | None
    limit_mib: int | None
    device_count: int = 1


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    destination: str
    options: tuple[str, ...] = ("rbind", "rw")


@dataclass(frozen=True, slots=True)
class ContainerAdjustment:
    """What to add to the container, on top of the injection plan."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()


class ContainerHooks(Protocol):
    """Called by the NRI plugin at the container's lifecycle points (see the module docstring)."""

    async def on_create(self, container: ContainerGpu) -> ContainerAdjustment: ...

    async def on_stop(self, container_id: str) -> None: ...

    async def on_remove(self, container_id: str) -> None: ...


def thread_ceiling(portion: float | None) -> int:
    """Active-thread percentage for a compute portion: floored to a whole percent, at least 1."""
    if portion is None:
        return 100
    return min(100, max(1, math.floor(round(portion * 100, 6))))


def namespace_name(container_id: str) -> str:
    return f"{NAMESPACE_PREFIX}{container_id[:20]}"


class MpsContainerHooks:
    def __init__(self, *, supervisor: MpsSupervisor) -> None:
        self._supervisor = supervisor
        self._sm: dict[str, ContainerGpu] = {}
        self.last_drain: DrainResult | None = None

    def restore(self, containers: Iterable[ContainerGpu]) -> None:
        """Re-registers live containers (from the mapping store) before the supervisor starts, so the
        first reconcile recreates their namespaces instead of deleting them as orphans."""
        for container in containers:
            if container.mode is ComputeMode.SM_SHARING:
                self._sm[container.container_id] = container
                if self._supervisor.mode is MpsMode.V3:
                    self._supervisor.register_namespace(self._spec(container))

    def _spec(self, container: ContainerGpu) -> NamespaceSpec:
        return NamespaceSpec(
            name=namespace_name(container.container_id),
            active_thread_percentage=thread_ceiling(container.compute_portion),
            pinned_memory_limit_mib=container.limit_mib,
        )

    async def on_create(self, container: ContainerGpu) -> ContainerAdjustment:
        if container.mode is not ComputeMode.SM_SHARING:
            return ContainerAdjustment()
        supervisor = self._supervisor
        inside = supervisor.settings.container_pipe_dir
        if supervisor.mode is MpsMode.V3:
            spec = self._spec(container)
            await supervisor.ensure_namespace(spec)
            self._sm[container.container_id] = container
            return ContainerAdjustment(
                env={"CUDA_MPS_PIPE_DIRECTORY": inside},
                mounts=(Mount(source=str(supervisor.namespace_dir(spec.name)), destination=inside),),
            )
        if not await supervisor.wait_ready(timeout_s=supervisor.settings.create_wait_s):
            raise MpsUnavailable(f"the MPS daemon is {supervisor.state}, not serving")
        self._sm[container.container_id] = container
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": inside,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_ceiling(container.compute_portion)),
        }
        if container.limit_mib is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                f"{i}={container.limit_mib}M" for i in range(container.device_count)
            )
        return ContainerAdjustment(
            env=env, mounts=(Mount(source=str(supervisor.settings.pipe_dir), destination=inside),)
        )

    async def on_stop(self, container_id: str) -> None:
        if container_id not in self._sm:
            return
        if self._supervisor.mode is MpsMode.V3:
            name = namespace_name(container_id)

            def owns(client: MpsClient) -> bool:
                return client.namespace == name
        else:

            def owns(client: MpsClient) -> bool:
                return container_id_of(pid=client.pid) == container_id

        self.last_drain = await self._supervisor.drain(owns=owns)

    async def on_remove(self, container_id: str) -> None:
        if self._sm.pop(container_id, None) is None:
            return
        if self._supervisor.mode is MpsMode.V3:
            await self._supervisor.release_namespace(namespace_name(container_id))
