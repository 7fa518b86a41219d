"""The node agent as one process: NRI plugin, GPU inventory publisher, usage reporting with the audit,
and health probes, started and stopped together.

``run`` serves until cancelled (SIGTERM in ``gpufrac node-agent``). Shutdown order matters and is done
in one ``finally``: first the Node's readiness condition goes False (``NodeAgentStopped``), so the
scheduler stops placing GPU pods on a node where nothing would inject their limits; then the NRI
connection closes (the runtime carries on without the plugin); then the probes stop. A failure in one
step does not skip the next.

Readiness (/readyz) is "the NRI plugin is registered and synchronized with the runtime, the GPU inventory
has been read, and the Node has been published" (when publishing). The plugin enters the runtime's
path after the first inventory read (CreateContainer checks devices against it); liveness (/healthz)
is the event loop answering. The agent's heartbeat is its node's Lease (``gpufrac.node.heartbeat``),
renewed every ``heartbeat_s`` while the agent publishes; the Node is written only when it changes.
With ``mps`` the MPS supervisor runs here too (``gpufrac.node.mps.service``): it gives the NRI handler
its hooks and the publisher the capability it enforces; without it, whether MPS serves is a setting
(``mps_running``).

Usage reporting (``gpufrac.node.reporting``: /metrics, collection, audit) reads the same mapping store the
NRI plugin writes, treats the GPUs of the latest inventory as managed, audits with the planner the plugin
injects by, and shares one ``EventRecorder`` on the Node and one set of counters with the MPS service
(wrapped in ``CountingMpsEvents``), so an MPS restart is an Event and a metric from one seam. Metrics do
not enter readiness: a node whose reporting is down still enforces. The audit needs the runtime's CRI
socket; when it is not there and the audit was not asked for explicitly (``gpufrac up`` has no CRI
runtime), the agent says so once and reports usage without auditing instead of warning every cycle.

Live resizes (``gpufrac.node.resize``): with ``memory_limits: driver`` and an API client, the agent watches
the pods bound to its node; when a running fraction's binding changes it sets the new limits on its
cgroup through the same enforcer, and each audit cycle finishes a shrink that waited for the use to fall.
Usage reporting sees a held-back limit as the one in force (``AllocationsInForce``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightkube import AsyncClient
from prometheus_client import CollectorRegistry

from gpufrac.kube.events import NORMAL, EventRecorder, ObjectRef
from gpufrac.node import labels as names
from gpufrac.node.config import NodeAgentSettings
from gpufrac.node.dra.ledger import NodeGpu
from gpufrac.node.dra.slices import ResourceSlicePublisher, device_name
from gpufrac.node.driver_upgrade import DriverUpgradeWatch
from gpufrac.node.gpu_faults import GpuFaultNotifier
from gpufrac.node.gpustack import SIMULATED_STACK, GpuStackGate
from gpufrac.node.heartbeat import NodeLease
from gpufrac.node.inject import EnvPlanner, InjectionPlan, pipe_leaf
from gpufrac.node.inventory.backend import (
    GpuInfo,
    GpuInventoryBackend,
    GpuMode,
    InventoryUnavailable,
    NodeInventory,
)
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.reserve import usable_mib
from gpufrac.node.mapping import AllocationRecord, MappingStore
from gpufrac.node.memlimit.condition import PodConditionWriter
from gpufrac.node.memlimit.driver import MemoryLimitDriver
from gpufrac.node.memlimit.enforcer import LimitEnforcer, limit_report
from gpufrac.node.metrics import CountingMpsEvents, EnforcementCounters, LimitReport
from gpufrac.node.mig.control import MigControl
from gpufrac.node.mig.executor import GpuLayoutExecutor, LayoutApplier
from gpufrac.node.mig.modes import WholeGpus
from gpufrac.node.mps.config import MpsSettings
from gpufrac.node.mps.events import NodeEventSink
from gpufrac.node.mps.hostpid import OUTSIDE_HOST_PID, outside_host_pid_namespace
from gpufrac.node.mps.mode import DriverVersion, NodeMpsCapability, capability_for
from gpufrac.node.mps.service import MpsService
from gpufrac.node.nri.handler import GpuInjector
from gpufrac.node.nri.plugin import NriPlugin, PluginIdentity
from gpufrac.node.reporting import UsageSettings, run_reporting
from gpufrac.node.resize import AllocationsInForce, PodResizeWatch, ResizeTracker
from gpufrac.node.usage.backend import GpuProcesses, ProcessUsageBackend
from gpufrac.node.usage.simulated import inventory_devices
from gpufrac.process.probes import ProbeServer

if TYPE_CHECKING:
    from gpufrac.node.dra.plugin import DraPlugin

log = logging.getLogger(__name__)


def make_limits_driver(
    settings: NodeAgentSettings, *, inventory: Callable[[], NodeInventory | None]
) -> MemoryLimitDriver:
    """The driver's per-cgroup memory limits: NVML (REAL) or the simulated driver (SIMULATED)."""
    if settings.limits_backend == "nvml":
        from gpufrac.node.memlimit.driver import NvmlMemoryLimits

        return NvmlMemoryLimits()
    from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits

    root = settings.limits_cgroup_root
    if settings.cgroup_root is None:  # the SIMULATED default: a cgroup v2 root of directories
        root.mkdir(parents=True, exist_ok=True)
        (root / "cgroup.controllers").touch()

    def gpus() -> Sequence[GpuInfo]:
        read = inventory()
        return read.gpus if read is not None else ()

    def driver_version() -> str:
        read = inventory()
        return read.driver_version if read is not None else settings.sim_driver

    return SimulatedMemoryLimits(
        path=settings.sim_memory_limits or settings.state_dir / "sim-memory-limits.json",
        gpus=gpus,
        driver_version=driver_version,
        cgroup_root=root,
    )


def make_backend(settings: NodeAgentSettings) -> GpuInventoryBackend:
    if settings.backend == "nvml":
        from gpufrac.node.inventory.nvml import NvmlInventory

        return NvmlInventory()
    from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag

    mig_state = settings.state_dir / "sim-mig.json"  # the simulated GPUs' MIG state outlives the agent
    if settings.sim_config is not None:
        return SimulatedInventory(
            node_name=settings.node_name, config=settings.sim_config, mig_state=mig_state
        )
    assert settings.sim_gpus is not None  # the settings validator guarantees one of the two
    return SimulatedInventory(
        node_name=settings.node_name,
        spec=parse_flag(settings.sim_gpus, driver=settings.sim_driver),
        mig_state=mig_state,
    )


def make_mig_control(settings: NodeAgentSettings, backend: GpuInventoryBackend) -> MigControl | None:
    """What changes MIG: NVML (REAL), or the simulated inventory itself (SIMULATED); None: nothing can."""
    if settings.backend == "nvml":
        from gpufrac.node.mig.nvml import NvmlMigControl

        return NvmlMigControl()
    return backend if hasattr(backend, "create_slice") else None  # type: ignore[return-value]


class _LoggedEvents:
    """The audit's Events as log lines, for an agent that does not talk to the API server (--no-publish)."""

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        log.warning("event %s %s on %s %s/%s: %s", type, reason, regarding.kind, regarding.namespace,
                    regarding.name, message)  # fmt: skip


def cri_socket_missing(endpoint: str) -> Path | None:
    """The socket path of a ``unix://`` CRI endpoint when nothing is there; None otherwise."""
    if not endpoint.startswith("unix://"):
        return None
    path = Path(endpoint.removeprefix("unix://"))
    return None if path.exists() else path


class NodeAgent:
    def __init__(
        self,
        *,
        settings: NodeAgentSettings,
        client: AsyncClient | None = None,
        backend: GpuInventoryBackend | None = None,
    ) -> None:
        self.settings = settings
        self._client = client
        self.backend = backend or make_backend(settings)
        self.store = MappingStore(directory=settings.state_dir)
        self._gpu_mib: dict[str, int] = {}
        self._inventory: NodeInventory | None = None
        self._managed_gpus: set[str] = set()  # usable GPUs of the latest inventory (the audit's strays)
        self._usable_gpus: tuple[GpuInfo, ...] | None = None  # what CreateContainer checks devices against
        self._inventory_tried = asyncio.Event()  # the first inventory read is over (read or not)
        #: The GPU Operator's upgrade state while this agent has let go of the driver for it; else None.
        self.upgrading: str | None = None
        self.size_passes = 0  # rounds of _refresh_gpu_sizes (tests wait on it instead of sleeping)
        self.upgrades = (
            DriverUpgradeWatch(client=client, node_name=settings.node_name)
            if client is not None and settings.publish
            else None
        )
        self.counters = EnforcementCounters()
        self.recorder = (
            EventRecorder(
                client=client, component="gpufrac-node-agent", instance=settings.node_name, workers=1
            )
            if client is not None
            else None
        )
        self.metrics_port: asyncio.Future[int] | None = None
        self.mps = (
            MpsService.for_node(
                node_name=settings.node_name,
                client=client,
                settings=MpsSettings(
                    control_bin=settings.mps_control_bin,
                    pipe_dir=settings.mps_pipe_dir,
                    log_dir=settings.mps_log_dir,
                    state_dir=settings.state_dir / "mps",
                    time_slicing_clients=settings.mps_time_slicing_clients,
                    handover=settings.mps_handover,
                    own_cgroup=settings.mps_own_cgroup,
                ),
                read_driver=lambda: self.backend.read().driver_version,
                on_change=lambda: self.publisher.poke() if self.publisher is not None else None,
                recorder=self.recorder,
                counted=lambda sink: CountingMpsEvents(sink=sink, counters=self.counters),
                claims=self._prepared_claims,
            )
            if settings.mps
            else None
        )
        self.conditions: PodConditionWriter | None = None
        #: The driver and toolkit versions the canary last ran on: a change of either runs it again.
        self._canary_stack: tuple[str, str | None] | None = None
        self._outside_host_pid = outside_host_pid_namespace()
        self.limits = (
            LimitEnforcer(
                driver=make_limits_driver(settings, inventory=lambda: self._inventory),
                gpu_uuid=self._gpu_uuid,
                cgroup_root=settings.limits_cgroup_root,
                proc_root=settings.usage.proc_root,
                events=self.recorder if self.recorder is not None else _LoggedEvents(),
                on_change=self._limits_changed,
                set_limits=settings.memory_limits == "driver",
                blind=self._mps_blind,
            )
            if settings.memory_limits != "off"
            else None
        )
        if client is not None and settings.publish:
            self.conditions = PodConditionWriter(
                client=client,
                records=self.store.allocations,
                booked=self.limits.booked if self.limits is not None else list,
                events=self.recorder,
            )
        #: Live resizes of running fractions (gpufrac.node.resize): the pods of this node, watched.
        self.resizes = (
            PodResizeWatch(
                client=client,
                node_name=settings.node_name,
                tracker=ResizeTracker(
                    store=self.store,
                    limits=self.limits,
                    events=self.recorder,
                    mps=self.mps.hooks if self.mps is not None else None,
                    shrink_timeout_s=settings.resize_shrink_timeout,
                ),
            )
            if client is not None
            and settings.publish
            and self.limits is not None
            and settings.memory_limits == "driver"
            else None
        )
        self.injector = GpuInjector(
            store=self.store,
            pipe_root=settings.pipe_root,
            container_pipe_dir=settings.container_pipe_dir,
            fail_open=settings.fail_open,
            device_mib=self._gpu_mib.get,
            node_gpus=lambda: self._usable_gpus,
            events=self.recorder if self.recorder is not None else _LoggedEvents(),
            counters=self.counters,
            hooks=self.mps.hooks if self.mps is not None else None,
            cdi_kind=settings.cdi_kind,
            foreign_gpus=settings.foreign_gpus,
            foreign_gpus_exempt=frozenset(settings.foreign_gpus_exempt_namespaces),
            shared_pipe_dir=str(settings.mps_pipe_dir) if self.mps is not None else None,
            shared_pipe_writable=settings.mps_classic_pipe_writable,
            limits=self.limits,
            cdi_dir=settings.cdi_dir if settings.dra else None,
        )
        self.plugin = NriPlugin(
            handler=self.injector,
            socket_path=settings.nri_socket,
            identity=PluginIdentity(name=settings.plugin_name, index=settings.plugin_index),
            on_state=self._nri_state,
        )
        self.publisher: InventoryPublisher | None = None
        #: The GPUs served whole (gpufrac.node.mig.modes): the layout executor's record, published as mode.
        self.whole_gpus = WholeGpus(path=settings.state_dir / "gpu-modes.json")
        self.stack_gate = GpuStackGate(
            client=client,
            node_name=settings.node_name,
            settings=settings.gpu_stack,
            fallback=SIMULATED_STACK if settings.backend == "simulated" else None,
        )
        if settings.publish:
            if client is None:
                raise ValueError("publishing the inventory needs an API client")
            self.publisher = InventoryPublisher(
                client=client,
                node_name=settings.node_name,
                backend=self.backend,
                capability=self._capability,
                nri_connected=self.plugin.synchronized.is_set,
                limits_canary=self._canary_problem,
                interval_s=settings.publish_interval_s,
                resync_s=settings.node_resync_s,
                taint=settings.taint,
                events=self.recorder if self.recorder is not None else _LoggedEvents(),
                stack_gate=self.stack_gate,
                memory_reserve=settings.memory_reserve,
                mps_reserve=settings.mps,
                on_inventory=GpuFaultNotifier(
                    node_name=settings.node_name,
                    store=self.store,
                    recorder=self.recorder if self.recorder is not None else _LoggedEvents(),
                ).observe,
                driver_upgrade=lambda: self.upgrading,
                slices=ResourceSlicePublisher(client=client, node_name=settings.node_name)
                if settings.dra
                else None,
                whole_gpus=self.whole_gpus,
            )
        #: MIG layout changes the scheduler asks for (gpufrac.node.mig.executor), on idle GPUs only.
        self.layouts: GpuLayoutExecutor | None = None
        control = make_mig_control(settings, self.backend) if settings.mig.layouts else None
        if self.publisher is not None and client is not None and control is not None:
            self.layouts = GpuLayoutExecutor(
                client=client,
                node_name=settings.node_name,
                applier=LayoutApplier(
                    backend=self.backend,
                    control=control,
                    whole=self.whole_gpus,
                    containers=self.store.allocations,
                    allow_gpu_reset=settings.mig.allow_gpu_reset,
                ),
                republish=self._republish_layout,
                interval_s=settings.publish_interval_s,
                events=self.recorder if self.recorder is not None else _LoggedEvents(),
                paused=lambda: self.upgrading,
            )
            if self.upgrades is not None:  # the own-node informer the driver-upgrade watch runs anyway
                self.upgrades.informer.add_handler(self.layouts)
                self.layouts.watch()
        self.dra_plugin: DraPlugin | None = None
        if settings.dra and client is not None:
            # Imported only here: its gRPC messages are generated from k8s.io/kubelet, and an agent
            # without --dra must not depend on them.
            from gpufrac.node.dra.plugin import DraPlugin

            self.dra_plugin = DraPlugin(
                client=client,
                node_name=settings.node_name,
                devices=self._dra_devices,
                kubelet_dir=settings.kubelet_dir,
                cdi_dir=settings.cdi_dir,
                pipe_root=str(settings.pipe_root),
                mps=self.mps.hooks if self.mps is not None else None,
                shared_pipe_dir=str(settings.mps_pipe_dir)
                if self.mps is not None and not settings.mps_classic_pipe_writable
                else None,
            )
        # The heartbeat: the node's Lease, renewed (gpufrac.node.heartbeat), never a Node write.
        self.lease = (
            NodeLease(
                client=client,
                node_name=settings.node_name,
                renew_s=settings.heartbeat_s,
                namespace=settings.lease_namespace,
            )
            if self.publisher is not None and client is not None
            else None
        )
        self.probes = ProbeServer(
            host=settings.health_host,
            port=settings.health_port,
            registry=CollectorRegistry(),
            healthy=lambda: (True, "event loop answering"),
            ready=self._ready,
        )

    def _dra_devices(self) -> dict[str, NodeGpu]:
        """The DRA plugin's view of the GPUs: the usable ones of the agent's inventory, with the memory
        the slice offers (usable MiB: the driver's and MPS's reserve taken off, as the publisher does)."""
        reserve, mps = self.settings.memory_reserve, self.settings.mps
        return {
            device_name(g): NodeGpu(
                uuid=g.uuid, index=g.index, usable_mib=usable_mib(g, settings=reserve, mps=mps)
            )
            for g in self._usable_gpus or ()
            if g.mode is GpuMode.FRACTIONS  # the slice offers fraction GPUs only (docs/dra.md)
        }

    def _prepared_claims(self) -> list[tuple[str, InjectionPlan]]:
        """The prepared DRA claims' shares, for the MPS live set (none without ``--dra``)."""
        return self.dra_plugin.prepared_plans() if self.dra_plugin is not None else []

    def _capability(self, driver: DriverVersion) -> NodeMpsCapability:
        if self.mps is not None:  # what the supervisor actually runs
            return self.mps.capability(driver)
        return capability_for(driver=driver, mps_running=self.settings.assume_mps_running)

    def _gpu_uuid(self, device: str) -> str | None:
        """The UUID of an assigned device (UUID, index or CDI name) among the usable GPUs; None if unknown."""
        name = device.partition("=")[2] if "=" in device else device
        for gpu in self._usable_gpus or ():
            if name in (gpu.uuid, str(gpu.index)):
                return gpu.uuid
        return None

    def _mps_blind(self, record: AllocationRecord) -> str | None:
        """Why a fraction whose GPU work goes through this node's MPS daemon cannot have its memory
        accounted to its cgroup (the daemon is outside the host PID namespace); None when it can."""
        if self.mps is None or record.pipe_dir in (
            None,
            pipe_leaf(root=str(self.settings.pipe_root), container_id=record.container_id),
        ):
            return None  # not routed through our MPS daemon: its own process allocates
        return OUTSIDE_HOST_PID if self._outside_host_pid else None

    def _limits_changed(self, pod_uid: str) -> None:
        if self.conditions is not None:
            self.conditions.poke(pod_uid)

    def _limit_report(self) -> LimitReport:
        assert self.limits is not None
        return limit_report(self.limits, self.store.allocations())

    def _canary_problem(self) -> str | None:
        if self.limits is None:
            return None
        result = self.limits.canary_result
        if result is None:
            return "the canary has not run yet"
        return None if result.passed else result.message

    async def _canary(self) -> None:
        """Try the driver's limit on a throwaway cgroup when the driver or the toolkit changed, or it has not
        passed yet."""
        assert self.limits is not None
        inventory = self._inventory
        if inventory is None or self.upgrading is not None:
            return
        result = self.limits.canary_result
        stack = (inventory.driver_version, self.stack_gate.toolkit)
        if result is not None and result.passed and stack == self._canary_stack:
            return
        await asyncio.to_thread(self.limits.canary, gpus=[g.uuid for g in inventory.fractionable])
        self._canary_stack = stack
        if result != self.limits.canary_result and self.publisher is not None:
            self.publisher.poke()

    async def _keep_limits(self) -> None:
        """The canary after a driver or toolkit change, and every running fraction's limits read back."""
        assert self.limits is not None
        while True:
            await asyncio.sleep(self.settings.memory_limit_audit_s)
            await self._canary()
            if self.upgrading is None:
                await asyncio.to_thread(self.limits.audit)
                if self.resizes is not None:  # a held-back shrink applied, timed out, or found at adoption
                    await self.resizes.after_audit()

    def _nri_state(self, synchronized: bool) -> None:
        log.info("nri: %s", "in the runtime's path" if synchronized else "not connected")
        if self.publisher is not None:
            self.publisher.poke()

    def _ready(self) -> tuple[bool, str]:
        if not self.plugin.synchronized.is_set():
            return False, f"NRI plugin not connected to {self.settings.nri_socket} ({self.plugin.last_error})"
        if self._usable_gpus is None:
            return False, "GPU inventory not read yet (GPU containers are refused until it is)"
        if self.publisher is not None and self.publisher.published is None:
            return False, "node inventory not published yet"
        return True, "NRI plugin synchronized" + (", node published" if self.publisher is not None else "")

    async def _refresh_gpu_sizes(self) -> None:
        """Keep whole-GPU sizes at hand for the mapping (CreateContainer must not read NVML)."""
        while True:
            inventory = self.publisher.inventory if self.publisher is not None else None
            if inventory is None and self.upgrading is None:  # NVML is let go of during an upgrade
                with contextlib.suppress(InventoryUnavailable):
                    inventory = await asyncio.to_thread(self.backend.read)
            if inventory is not None:
                self._adopt(inventory)
            self._inventory_tried.set()
            self.size_passes += 1
            await asyncio.sleep(self.settings.publish_interval_s)

    def _adopt(self, inventory: NodeInventory) -> None:
        """What CreateContainer, the mapping and usage reporting check against: the latest inventory."""
        self._inventory = inventory
        self._gpu_mib.clear()
        self._gpu_mib.update({g.uuid: g.mib for g in inventory.gpus})
        self._usable_gpus = inventory.usable
        usable = {g.uuid for g in inventory.usable}
        # In place, without a moment of "nothing managed": the collector reads it from a thread.
        self._managed_gpus |= usable
        self._managed_gpus &= usable

    async def _republish_layout(self) -> None:
        """After a MIG layout change: publish the new slices, and take them here at the same moment, so the
        first container the scheduler binds to a new slice is not refused as "not in this node's GPU
        inventory" until the next inventory pass."""
        assert self.publisher is not None
        await asyncio.wait_for(self.publisher.refresh(), timeout=30)
        if self.publisher.inventory is not None:
            self._adopt(self.publisher.inventory)

    def _inventory_gpus(self) -> Sequence[GpuProcesses]:
        """The inventory's GPUs and MIG slices without processes: the simulated process table is laid over
        them, as NVML reports a MIG slice as a device of its own."""
        inventory = self._inventory
        return inventory_devices(inventory.gpus if inventory is not None else ())

    async def _usage_backend(self) -> ProcessUsageBackend:
        if self.settings.process_backend == "simulated":
            from gpufrac.node.usage.simulated import SimulatedUsageFile

            return SimulatedUsageFile(path=self.settings.sim_usage, gpus=self._inventory_gpus)
        from gpufrac.node.usage.nvml import NvmlUsage

        while True:  # NVML can be down while the agent starts (driver upgrade); so is the inventory then
            try:
                return await asyncio.to_thread(NvmlUsage)
            except Exception as error:
                log.warning("usage: NVML not readable (%s); retrying", error)
                await asyncio.sleep(self.settings.usage.interval_s)

    def _usage_settings(self) -> UsageSettings:
        usage = self.settings.usage
        missing = cri_socket_missing(usage.cri_endpoint) if usage.audit else None
        if missing is not None and "audit" not in usage.model_fields_set:
            log.warning(
                "audit off: no CRI socket at %s (give --cri-endpoint, or --audit to keep retrying it)",
                missing,
            )
            return usage.model_copy(update={"audit": False})
        return usage

    async def _report(self) -> None:
        """Usage reporting and the audit; the port is in ``metrics_port`` once /metrics listens."""
        backend = await self._usage_backend()
        try:
            await run_reporting(
                settings=self._usage_settings(),
                node_name=self.settings.node_name,
                backend=backend,
                allocations=AllocationsInForce(store=self.store, limits=self.limits)
                if self.limits is not None
                else self.store,
                managed_gpus=self._managed_gpus,
                planner=EnvPlanner(
                    container_pipe_dir=self.settings.container_pipe_dir,
                    recorded=lambda container_id: self.store.get(container_id) is not None,
                ),
                events=self.recorder if self.recorder is not None else _LoggedEvents(),
                counters=self.counters,
                started=self.metrics_port if self.metrics_port and not self.metrics_port.done() else None,
                limits=self._limit_report if self.limits is not None else None,
            )
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()

    async def _gpu_users(self) -> None:
        """The duties that hold the driver (MPS, NVML usage), let go of while the driver is upgraded.

        When the GPU Operator starts a driver upgrade on the node, MPS is stopped (``quit``: its servers
        exit), usage reporting stops (its NVML handle closes), the inventory backend is closed, and the
        Node says ``DriverUpgradeInProgress``; nothing of the agent's holds ``/dev/nvidia*`` any more, so
        the driver can unload. When the label says the upgrade is done (or goes away), they start again
        and the next publish reads the new driver. A duty that fails ends the agent, as before.
        """
        duties: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}
        if self.mps is not None:
            duties["mps-supervisor"] = self.mps.run
        duties["usage-reporting"] = self._report
        running: list[asyncio.Task[None]] = []

        def start() -> None:
            running.extend(asyncio.create_task(duty(), name=name) for name, duty in duties.items())

        async def stop() -> None:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            running.clear()

        start()
        try:
            while True:
                waits: list[asyncio.Task[Any]] = list(running)
                changed = None
                if self.upgrades is not None:
                    changed = asyncio.create_task(self.upgrades.changed.wait())
                    waits.append(changed)
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if changed is not None and changed not in done:
                    changed.cancel()
                for task in done:
                    if task is not changed:
                        task.result()  # a duty's failure ends the agent
                        raise RuntimeError(f"{task.get_name()} ended unexpectedly")
                assert self.upgrades is not None
                self.upgrades.changed.clear()
                await self._follow_upgrade(self.upgrades.state, start=start, stop=stop)
        finally:
            await stop()

    async def _follow_upgrade(
        self,
        state: str | None,
        *,
        start: Callable[[], None],
        stop: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        if state is not None and self.upgrading is None:
            log.warning("driver upgrade (%s): stopping MPS and letting go of NVML", state)
            self.upgrading = state
            if self.publisher is not None:
                self.publisher.poke()  # not ready first: the scheduler stops placing before MPS goes
            await stop()
            await asyncio.to_thread(self.backend.close)
            self._event(f"the GPU Operator is upgrading the driver ({state}): MPS stopped, NVML released")
        elif state is None and self.upgrading is not None:
            log.info("driver upgrade done: reading the GPUs again and starting MPS")
            self.upgrading = None
            start()
            self._event("the driver upgrade is done: GPUs read again, MPS started")
        elif state is not None:
            self.upgrading = state
        if self.publisher is not None:
            self.publisher.poke()

    def _event(self, message: str) -> None:
        if self.recorder is None:
            return
        node = NodeEventSink(recorder=self.recorder, node_name=self.settings.node_name)
        node.emit(type=NORMAL, reason=names.REASON_DRIVER_UPGRADE, message=message)

    async def run(self) -> None:
        await self.probes.start()
        self.metrics_port = asyncio.get_running_loop().create_future()
        log.info(
            "node agent started",
            extra={
                "node": self.settings.node_name,
                "backend": self.settings.backend,
                "nri_socket": self.settings.nri_socket,
                "health_port": self.probes.port,
                "fail_open": self.settings.fail_open,
            },
        )
        sizes = asyncio.create_task(self._refresh_gpu_sizes(), name="gpu-sizes")
        # Enter the runtime's path once the GPUs are known, so that the first GPU containers are not
        # refused for an inventory not read yet; an unreadable one does not keep the plugin out (its
        # containers are refused with that reason instead of starting bare).
        try:
            async with asyncio.timeout(10):
                await self._inventory_tried.wait()
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            sizes.cancel()
            raise
        if self.limits is not None:  # before the node is first published: it is offered only once it passed
            await self._canary()
        if self.dra_plugin is not None:  # after the first inventory read: prepare maps devices through it
            await self.dra_plugin.start()
        tasks = [asyncio.create_task(self.plugin.run(), name="nri-plugin"), sizes]
        if self.publisher is not None:
            tasks.append(asyncio.create_task(self.publisher.run(), name="inventory-publisher"))
        if self.lease is not None:
            tasks.append(asyncio.create_task(self.lease.run(), name="heartbeat-lease"))
        if self.upgrades is not None:
            tasks.append(asyncio.create_task(self.upgrades.run(), name="driver-upgrades"))
        if self.limits is not None:
            tasks.append(asyncio.create_task(self._keep_limits(), name="memory-limits"))
        if self.conditions is not None:
            tasks.append(asyncio.create_task(self.conditions.run(), name="pod-conditions"))
        if self.resizes is not None:
            tasks.append(asyncio.create_task(self.resizes.run(), name="pod-resizes"))
        if self.layouts is not None:
            tasks.append(asyncio.create_task(self.layouts.run(), name="mig-layouts"))
        # MPS and usage reporting, paused around driver upgrades; cancelled with the publisher (MPS stops
        # the daemon in a finally; reporting closes CRI, then the metrics endpoint).
        tasks.append(asyncio.create_task(self._gpu_users(), name="gpu-users"))
        recording = (
            asyncio.create_task(self.recorder.run(), name="events") if self.recorder is not None else None
        )
        everything = asyncio.gather(*tasks)
        try:
            # Shielded: cancelling run() (SIGTERM) must not cancel every task at once through the gather;
            # the finally below stops them in its order, after deciding what MPS does.
            await asyncio.shield(everything)
        finally:
            # Order: tell the scheduler first, then leave the runtime's path, then stop answering probes.
            if self.mps is not None:  # an agent restart leaves MPS serving for the next agent to adopt
                self.mps.handover_on_exit = self.settings.mps_handover
            for task in tasks[2:]:
                task.cancel()
            if self.publisher is not None:
                try:
                    await asyncio.wait_for(self.publisher.mark_stopped(), timeout=5)
                except Exception as exc:  # the API may be gone too; shutting down must go on
                    log.warning("node agent: could not mark the node stopped: %s", exc)
            if self.dra_plugin is not None:  # the CDI specs stay: prepared claims survive a restart
                await self.dra_plugin.stop()
            for task in tasks[:2]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(BaseException):  # its outcome is the tasks', handled above
                await everything
            if recording is not None:  # after MPS and the audit: the Events of their last moments flush
                recording.cancel()
                await asyncio.gather(recording, return_exceptions=True)
            await self.probes.stop()
            self.store.close()
            self.backend.close()
            log.info("node agent stopped", extra={"node": self.settings.node_name})
