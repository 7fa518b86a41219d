"""The node agent as one process: NRI plugin, GPU inventory publisher and health probes, started and
stopped together.

``run`` serves until cancelled (SIGTERM in ``gpufrac node-agent``). Shutdown order matters and is done
in one ``finally``: first the Node's readiness condition goes False (``NodeAgentStopped``), so the
scheduler stops placing GPU pods on a node where nothing would inject their limits; then the NRI
connection closes (the runtime carries on without the plugin); then the probes stop. A failure in one
step does not skip the next.

Readiness (/readyz) is "the NRI plugin is registered and synchronized with the runtime, and the Node
has been published" (when publishing); liveness (/healthz) is the event loop answering. With ``mps``
the MPS supervisor runs here too (``gpufrac.node.mps.service``): it gives the NRI handler its hooks and
the publisher the capability it enforces; without it, whether MPS serves is a setting (``mps_running``).
The usage reporter and audit join this assembly in later issues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from lightkube import AsyncClient
from prometheus_client import CollectorRegistry

from gpufrac.node.config import NodeAgentSettings
from gpufrac.node.inventory.backend import GpuInventoryBackend, InventoryUnavailable
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.mapping import MappingStore
from gpufrac.node.mps.config import MpsSettings
from gpufrac.node.mps.mode import DriverVersion, NodeMpsCapability, capability_for
from gpufrac.node.mps.service import MpsService
from gpufrac.node.nri.handler import GpuInjector
from gpufrac.node.nri.plugin import NriPlugin, PluginIdentity
from gpufrac.process.probes import ProbeServer

log = logging.getLogger(__name__)


def make_backend(settings: NodeAgentSettings) -> GpuInventoryBackend:
    if settings.backend == "nvml":
        from gpufrac.node.inventory.nvml import NvmlInventory

        return NvmlInventory()
    from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag

    if settings.sim_config is not None:
        return SimulatedInventory(node_name=settings.node_name, config=settings.sim_config)
    assert settings.sim_gpus is not None  # the settings validator guarantees one of the two
    return SimulatedInventory(
        node_name=settings.node_name, spec=parse_flag(settings.sim_gpus, driver=settings.sim_driver)
    )


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
        self.mps = (
            MpsService.for_node(
                node_name=settings.node_name,
                client=client,
                settings=MpsSettings(
                    control_bin=settings.mps_control_bin,
                    pipe_dir=settings.mps_pipe_dir,
                    log_dir=settings.mps_log_dir,
                    state_dir=settings.state_dir / "mps",
                ),
                read_driver=lambda: self.backend.read().driver_version,
                on_change=lambda: self.publisher.poke() if self.publisher is not None else None,
            )
            if settings.mps
            else None
        )
        self.injector = GpuInjector(
            store=self.store,
            pipe_root=settings.pipe_root,
            container_pipe_dir=settings.container_pipe_dir,
            fail_open=settings.fail_open,
            device_mib=self._gpu_mib.get,
            hooks=self.mps.hooks if self.mps is not None else None,
        )
        self.plugin = NriPlugin(
            handler=self.injector,
            socket_path=settings.nri_socket,
            identity=PluginIdentity(name=settings.plugin_name, index=settings.plugin_index),
            on_state=self._nri_state,
        )
        self.publisher: InventoryPublisher | None = None
        if settings.publish:
            if client is None:
                raise ValueError("publishing the inventory needs an API client")
            self.publisher = InventoryPublisher(
                client=client,
                node_name=settings.node_name,
                backend=self.backend,
                capability=self._capability,
                nri_connected=self.plugin.synchronized.is_set,
                interval_s=settings.publish_interval_s,
                heartbeat_s=settings.heartbeat_s,
            )
        self.probes = ProbeServer(
            host=settings.health_host,
            port=settings.health_port,
            registry=CollectorRegistry(),
            healthy=lambda: (True, "event loop answering"),
            ready=self._ready,
        )

    def _capability(self, driver: DriverVersion) -> NodeMpsCapability:
        if self.mps is not None:  # what the supervisor actually runs
            return self.mps.capability(driver)
        return capability_for(driver=driver, mps_running=self.settings.assume_mps_running)

    def _nri_state(self, synchronized: bool) -> None:
        log.info("nri: %s", "in the runtime's path" if synchronized else "not connected")
        if self.publisher is not None:
            self.publisher.poke()

    def _ready(self) -> tuple[bool, str]:
        if not self.plugin.synchronized.is_set():
            return False, f"NRI plugin not connected to {self.settings.nri_socket} ({self.plugin.last_error})"
        if self.publisher is not None and self.publisher.published is None:
            return False, "node inventory not published yet"
        return True, "NRI plugin synchronized" + (", node published" if self.publisher is not None else "")

    async def _refresh_gpu_sizes(self) -> None:
        """Keep whole-GPU sizes at hand for the mapping (CreateContainer must not read NVML)."""
        while True:
            inventory = self.publisher.inventory if self.publisher is not None else None
            if inventory is None:
                with contextlib.suppress(InventoryUnavailable):
                    inventory = await asyncio.to_thread(self.backend.read)
            if inventory is not None:
                self._gpu_mib.clear()
                self._gpu_mib.update({g.uuid: g.mib for g in inventory.gpus})
            await asyncio.sleep(self.settings.publish_interval_s)

    async def run(self) -> None:
        await self.probes.start()
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
        tasks = [
            asyncio.create_task(self.plugin.run(), name="nri-plugin"),
            asyncio.create_task(self._refresh_gpu_sizes(), name="gpu-sizes"),
        ]
        if self.publisher is not None:
            tasks.append(asyncio.create_task(self.publisher.run(), name="inventory-publisher"))
        if self.mps is not None:  # cancelled with the publisher; its run() stops the daemon in a finally
            tasks.append(asyncio.create_task(self.mps.run(), name="mps-supervisor"))
        try:
            await asyncio.gather(*tasks)
        finally:
            # Order: tell the scheduler first, then leave the runtime's path, then stop answering probes.
            for task in tasks[2:]:
                task.cancel()
            if self.publisher is not None:
                try:
                    await asyncio.wait_for(self.publisher.mark_stopped(), timeout=5)
                except Exception as exc:  # the API may be gone too; shutting down must go on
                    log.warning("node agent: could not mark the node stopped: %s", exc)
            for task in tasks[:2]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.probes.stop()
            self.store.close()
            self.backend.close()
            log.info("node agent stopped", extra={"node": self.settings.node_name})
