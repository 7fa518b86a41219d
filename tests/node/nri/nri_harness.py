"""The node under test: NRI's real runtime-side adaptation (testenv/nriruntime) with gpufrac's plugin.

The plugin is reached only the way containerd reaches it: the test asks the runtime program to run pods
and create containers, the adaptation calls every registered plugin over the NRI socket, merges their
adjustments and answers with the container as adjusted -- or with the error a plugin failed it with.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def _generated() -> bool:
    try:
        return importlib.util.find_spec("gpufrac._generated.nri.api_pb2") is not None
    except ModuleNotFoundError:
        return False


if not _generated():  # `make testenv` not run yet
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-nri-protos")], check=True)
    importlib.invalidate_caches()

from gpufrac.contract.keys import CDI_GPU_KIND  # noqa: E402
from gpufrac.kube.events import ObjectRef  # noqa: E402
from gpufrac.local.nriruntime import CreatedContainer, NriRuntime  # noqa: E402
from gpufrac.node.inventory.backend import GpuInfo  # noqa: E402
from gpufrac.node.mapping import MappingStore  # noqa: E402
from gpufrac.node.memlimit.enforcer import LimitEnforcer  # noqa: E402
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits  # noqa: E402
from gpufrac.node.metrics import EnforcementCounters  # noqa: E402
from gpufrac.node.mps.containers import ContainerHooks  # noqa: E402
from gpufrac.node.nri.handler import ForeignGpuPolicy, GpuInjector  # noqa: E402
from gpufrac.node.nri.plugin import NriPlugin  # noqa: E402

_ids = itertools.count(1)

#: The node's GPUs (simulated: this machine has none); devices the tests assign are these.
GPU_A = "GPU-8f3c6a2e-0000-4000-8000-00000000000a"
GPU_B = "GPU-8f3c6a2e-0000-4000-8000-00000000000b"
NODE_GPUS = (
    GpuInfo(uuid=GPU_A, index=0, minor=0, model="NVIDIA H100 80GB HBM3", mib=81559),
    GpuInfo(uuid=GPU_B, index=1, minor=1, model="NVIDIA H100 80GB HBM3", mib=81559),
)


@dataclass
class Events:
    """The agent's Events as the API server would receive them (the agent writes them through this seam)."""

    emitted: list[tuple[ObjectRef, str, str, str]] = field(default_factory=list)

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        self.emitted.append((regarding, type, reason, message))


@dataclass
class Agent:
    """The node agent's NRI half: plugin, handler and mapping store, running as a task."""

    store: MappingStore
    injector: GpuInjector
    plugin: NriPlugin
    task: asyncio.Task[None]
    events: Events
    counters: EnforcementCounters
    limits: LimitEnforcer | None = None

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.store.close()


@dataclass
class Node:
    root: Path
    runtime: NriRuntime
    agents: list[Agent] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "nri.sock"

    @property
    def pipe_root(self) -> Path:
        return self.root / "mps-pipes"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def agent(self) -> Agent:
        return self.agents[-1]

    @property
    def store(self) -> MappingStore:
        return self.agent.store

    async def start_agent(
        self,
        *,
        fail_open: bool = False,
        wait: bool = True,
        gpus: Sequence[GpuInfo] | None = NODE_GPUS,
        foreign_gpus: ForeignGpuPolicy = "report",
        hooks: ContainerHooks | None = None,
        shared_pipe_dir: str | None = None,
        cdi_kind: str = CDI_GPU_KIND,
        limits: bool = False,
        verify_only: bool = False,
        driver_version: str = "615.20.01",
        cdi_dir: Path | None = None,
    ) -> Agent:
        """``cdi_dir``: where the DRA plugin's claim specs are (the agent's with ``--dra``).
        ``limits``: the driver's per-cgroup memory limits through the SIMULATED driver
        (``driver``), keyed by the runtime's cgroup directories (``make_node(cgroups=True)``)."""
        # The runtime counts a plugin whose connection closed until it prunes it, so "connected" is one
        # more registration, not one more plugin.
        registered = int((await self.runtime.list())["registrations"]) + 1 if wait else 0
        store = MappingStore(directory=self.state_dir)
        events, counters = Events(), EnforcementCounters()
        enforcer = None
        if limits:
            assert self.runtime.cgroup_root is not None, "make_node(cgroups=True) gives containers cgroups"
            by_name = {g.uuid: g.uuid for g in gpus or ()} | {str(g.index): g.uuid for g in gpus or ()}
            enforcer = LimitEnforcer(
                driver=self.driver(gpus=gpus or (), driver_version=driver_version),
                gpu_uuid=by_name.get,
                cgroup_root=self.runtime.cgroup_root,
                events=events,
                set_limits=not verify_only,
            )
        injector = GpuInjector(
            store=store,
            pipe_root=self.pipe_root,
            fail_open=fail_open,
            node_gpus=lambda: gpus,
            events=events,
            counters=counters,
            foreign_gpus=foreign_gpus,
            foreign_gpus_exempt=frozenset({"gpu-operator"}),
            hooks=hooks,
            shared_pipe_dir=shared_pipe_dir,
            cdi_kind=cdi_kind,
            limits=enforcer,
            cdi_dir=cdi_dir,
        )
        plugin = NriPlugin(
            handler=injector, socket_path=str(self.socket), backoff_initial_s=0.02, backoff_max_s=0.2
        )
        agent = Agent(
            store=store,
            injector=injector,
            plugin=plugin,
            task=asyncio.create_task(plugin.run()),
            events=events,
            counters=counters,
            limits=enforcer,
        )
        self.agents.append(agent)
        if wait:
            await self.runtime.wait_registrations(registered, timeout_s=10)
        return agent

    def driver(
        self, *, gpus: Sequence[GpuInfo] = NODE_GPUS, driver_version: str = "615.20.01"
    ) -> SimulatedMemoryLimits:
        """The node's SIMULATED driver: one state file, whichever agent or test opens it."""
        assert self.runtime.cgroup_root is not None
        return SimulatedMemoryLimits(
            path=self.root / "driver-limits.json",
            gpus=lambda: gpus,
            driver_version=lambda: driver_version,
            cgroup_root=self.runtime.cgroup_root,
        )

    async def pod(
        self, annotations: Mapping[str, str] | None = None, *, name: str | None = None, namespace: str = "ml"
    ) -> str:
        n = next(_ids)
        pod_id = f"pod{n:04d}"
        await self.runtime.run_pod(
            id=pod_id,
            name=name or f"p{n}",
            namespace=namespace,
            uid=f"uid-{n:04d}",
            annotations=annotations or {},
        )
        return pod_id

    async def create(
        self,
        pod_id: str,
        name: str,
        *,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[Mapping[str, Any]] = (),
        cdi_devices: Sequence[str] = (),
        cgroups_path: str | None = None,
        container_id: str | None = None,
    ) -> CreatedContainer:
        container_id = container_id or f"{pod_id}-{name}-{next(_ids):04d}"
        return await self.runtime.create_container(
            id=container_id,
            pod_id=pod_id,
            name=name,
            env=env or {"PATH": "/usr/bin"},
            mounts=mounts,
            cdi_devices=cdi_devices,
            cgroups_path=cgroups_path,
        )
