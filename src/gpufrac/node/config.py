"""Settings of the node agent: a YAML file (``--config``) with flags on top, validated in one place.

Defaults are a production node's: NVML for the GPUs, containerd's NRI socket, state under /run (tmpfs:
the mapping is a cache that Synchronize rebuilds, and containers do not outlive a reboot either).
``backend: simulated`` with ``sim_gpus`` or ``sim_config`` runs the same agent on a machine without GPUs
(tests, ``gpufrac up``).

Usage reporting and the audit have their own section, ``usage:`` (``gpufrac.node.reporting.UsageSettings``);
flags for it are merged into the file's section key by key, so ``--metrics-port`` does not drop the
file's ``usage.interval_s``. Which backend reads GPU processes follows the inventory backend unless
``usage_backend`` says otherwise: NVML with NVML, the simulated table (``sim_usage``) with the simulation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpufrac.contract import keys
from gpufrac.contract.keys import CDI_GPU_KIND
from gpufrac.node.gpustack import GpuStackSettings
from gpufrac.node.inject import CDI_KIND_PATTERN, CONTAINER_PIPE_DIR
from gpufrac.node.inventory.reserve import MemoryReserveSettings
from gpufrac.node.mig.executor import MigSettings
from gpufrac.node.mps.hostcgroup import CGROUP_NAME
from gpufrac.node.nri.handler import ForeignGpuPolicy
from gpufrac.node.nri.plugin import DEFAULT_SOCKET
from gpufrac.node.reporting import UsageSettings


class NodeAgentSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    node_name: str = Field(min_length=1)
    kubeconfig: Path | None = None
    publish: bool = Field(True, description="write the inventory and readiness on the Node")
    taint: bool = Field(
        True,
        description="taint the Node gpufrac.io/managed=true:NoSchedule so that only gpufrac's scheduler "
        "places pods on it; off when another scheduler (KAI Scheduler) places the GPU pods",
    )
    dra: bool = Field(
        False,
        description="the DRA driver gpu.gpufrac.io (docs/dra.md): publish the node's GPUs as a ResourceSlice "
        "and serve the kubelet's DRA plugin; off by default until it is tested on a real kubelet",
    )
    kubelet_dir: Path = Field(
        Path("/var/lib/kubelet"), description="the kubelet's root: plugins_registry/ and plugins/ (DRA)"
    )
    cdi_dir: Path = Field(Path("/var/run/cdi"), description="where the DRA plugin writes claims' CDI specs")
    nri_socket: str = DEFAULT_SOCKET
    plugin_name: str = keys.NRI_PLUGIN_NAME  # the webhook names it in every GPU pod's required plugins
    plugin_index: str = Field("10", pattern=r"^[0-9]{2}$")
    backend: Literal["nvml", "simulated"] = "nvml"
    sim_gpus: str | None = Field(None, description="COUNTxMODEL[:MIB] groups, e.g. 8xH100-80GB")
    sim_config: Path | None = Field(None, description="YAML file of simulated GPUs, re-read on change")
    sim_driver: str = "615.20.01"
    mps_running: bool | None = Field(
        None,
        description="whether MPS serves on this node (sm-sharing capability) until the MPS supervisor "
        "reports it; default: yes for the simulated backend, no for NVML",
    )
    mps: bool = Field(False, description="run and supervise the MPS control daemon (docs/mps.md)")
    mps_control_bin: str = "nvidia-cuda-mps-control"
    mps_pipe_dir: Path = Path("/run/nvidia/mps")
    mps_log_dir: Path = Path("/var/log/nvidia-mps")
    mps_handover: bool = Field(
        True,
        description="leave the MPS daemon serving when the agent stops and adopt it when the next one "
        "starts, so that an agent upgrade does not cut off running sm-sharing processes (docs/mps.md)",
    )
    mps_own_cgroup: str | None = Field(
        "gpufrac-mps",
        pattern=CGROUP_NAME.pattern,
        description="with mps_handover: the cgroup of its own, in every host hierarchy, that the MPS daemon "
        "is moved into so that replacing the agent's pod does not kill it (needs the privileged, hostPID "
        "agent; where it cannot, an Event MpsDaemonInAgentCgroup says so); null: leave it in the agent's",
    )
    mps_classic_pipe_writable: bool = Field(
        False,
        description="mount classic MPS's shared pipe directory read-write into sm-sharing containers "
        "(default read-only: docs/node-agent.md)",
    )
    mps_time_slicing_clients: bool = Field(
        False,
        description="time-slicing containers become MPS clients of the default server (memory accounting "
        "and the pinned-memory variable as a second guard where the toolkit's memory-limit hook is "
        "missing); opt-in: it exposes the MPS control socket to them (docs/mps.md)",
    )
    state_dir: Path = Path("/run/gpufrac/node-agent")
    mps_pipe_root: Path | None = Field(
        None, description="host leaf directories (default <state_dir>/mps-pipes)"
    )
    container_pipe_dir: str = CONTAINER_PIPE_DIR
    fail_open: bool = False
    foreign_gpus: ForeignGpuPolicy = Field(
        "report",
        description="a container outside gpufrac that got one of this node's GPUs from the device plugin: "
        "report it (Event, metric) or refuse to create it (docs/node-agent.md)",
    )
    foreign_gpus_exempt_namespaces: tuple[str, ...] = Field(
        (),
        description="namespaces whose GPU containers outside gpufrac are neither reported nor refused "
        "(the GPU Operator's and gpufrac's own, whose pods set NVIDIA_VISIBLE_DEVICES in their manifests)",
    )
    cdi_kind: str = Field(
        CDI_GPU_KIND,
        description="the CDI kind (vendor/class) requested for each GPU a container is given by UUID or "
        "index, as <cdi_kind>=<device>; the NVIDIA toolkit's spec (named by UUID) must exist on the "
        "node. Empty: no such request, for nodes without CDI specs (docs/node-agent.md)",
    )
    gpu_stack: GpuStackSettings = Field(
        default_factory=GpuStackSettings,
        description="the GPU stack gate: where the toolkit and device plugin versions come from, and the "
        "escape hatch (gpufrac.node.gpustack, docs/node-agent.md)",
    )
    memory_reserve: MemoryReserveSettings = Field(
        default_factory=MemoryReserveSettings,
        description="GPU memory held back from scheduling per GPU: the driver's reserve where it does not "
        "report it, and the MPS server's with --mps (gpufrac.node.inventory.reserve)",
    )
    mig: MigSettings = Field(
        default_factory=MigSettings,
        description="MIG layout changes the scheduler asks for (gpufrac.node.mig, docs/node-agent.md, MIG)",
    )
    memory_limits: Literal["driver", "verify", "off"] = Field(
        "driver",
        description="driver: set and read back every fractional container's GPU memory limit through the "
        "driver's per-cgroup API (NVML, r615+) before it starts, fail closed, keep it in force; verify: only "
        "read back what the toolkit's hook set, fail closed and report, never set; off: the toolkit's "
        "variables only, nothing verified and no GpuMemoryEnforced condition (docs/node-agent.md)",
    )
    memory_limits_backend: Literal["nvml", "simulated"] | None = Field(
        None, description="what sets the limits; default: the same kind as ``backend``"
    )
    cgroup_root: Path | None = Field(
        None,
        description="where the agent sees the host's cgroup filesystem; default /sys/fs/cgroup, or with the "
        "simulated limits backend <state_dir>/cgroupfs (SIMULATED cgroups, made by the simulated runtime)",
    )
    sim_memory_limits: Path | None = Field(
        None, description="the simulated driver's limits (JSON; default <state_dir>/sim-memory-limits.json)"
    )
    memory_limit_audit_s: float = Field(
        10.0, gt=0, description="how often every running fraction's limits are read back from the driver"
    )
    resize_shrink_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds a live resize that lowers a container's hard GPU memory limit below its use "
        "waits for the use to fall before the pod says LimitBelowUsage (the old hard limit stays until the "
        "use falls or the pod is resized again; docs/node-agent.md, 'Resizing a running fraction')",
    )
    health_host: str = "0.0.0.0"
    health_port: int = Field(8082, ge=0, le=65535)
    publish_interval_s: float = Field(5.0, gt=0)
    heartbeat_s: float = Field(
        10.0, gt=0, description="seconds between renewals of the node's Lease (the agent's heartbeat)"
    )
    lease_namespace: str = Field(
        keys.NODE_LEASE_NAMESPACE, min_length=1, description="namespace of the node's heartbeat Lease"
    )
    node_resync_s: float = Field(
        600.0,
        gt=0,
        description="seconds between re-assertions of an unchanged Node (repairs, not heartbeats)",
    )
    usage: UsageSettings = Field(default_factory=UsageSettings)
    usage_backend: Literal["nvml", "simulated"] | None = Field(
        None, description="what reads GPU processes; default: the same kind as ``backend``"
    )
    sim_usage: Path | None = Field(
        None, description="JSON table of simulated GPU processes, re-read every sample; none: idle GPUs"
    )

    @model_validator(mode="after")
    def _cdi_kind_is_a_kind(self) -> NodeAgentSettings:
        if self.cdi_kind and CDI_KIND_PATTERN.fullmatch(self.cdi_kind) is None:
            raise ValueError(
                f"cdi_kind={self.cdi_kind!r} is invalid: it must be a CDI kind vendor/class "
                "(e.g. nvidia.com/gpu), or empty to request no CDI devices"
            )
        return self

    @model_validator(mode="after")
    def _dra_publishes(self) -> NodeAgentSettings:
        if self.dra and not self.publish:
            raise ValueError(
                "dra=True with publish=False is invalid: the DRA driver publishes the GPUs as a "
                "ResourceSlice and maps claims back through the same inventory, so it needs publish"
            )
        return self

    @model_validator(mode="after")
    def _simulation_is_described(self) -> NodeAgentSettings:
        if self.backend == "simulated" and (self.sim_gpus is None) == (self.sim_config is None):
            raise ValueError("the simulated backend needs exactly one of sim_gpus or sim_config")
        return self

    @property
    def limits_backend(self) -> Literal["nvml", "simulated"]:
        return self.memory_limits_backend or self.backend

    @property
    def limits_cgroup_root(self) -> Path:
        if self.cgroup_root is not None:
            return self.cgroup_root
        return self.state_dir / "cgroupfs" if self.limits_backend == "simulated" else Path("/sys/fs/cgroup")

    @property
    def pipe_root(self) -> Path:
        return self.mps_pipe_root or self.state_dir / "mps-pipes"

    @property
    def process_backend(self) -> Literal["nvml", "simulated"]:
        return self.usage_backend or self.backend

    @property
    def assume_mps_running(self) -> bool:
        return self.mps_running if self.mps_running is not None else self.backend == "simulated"


def load_settings(path: Path | None, **flags: Any) -> NodeAgentSettings:
    """The file's settings (if any) overridden by every flag that was given (not None)."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the node agent configuration must be a mapping")
        data.update(loaded)
    for key, value in flags.items():
        if isinstance(value, dict):  # a section: merge the given flags into the file's keys
            given = {k: v for k, v in value.items() if v is not None}
            if given:
                data[key] = {**(data.get(key) or {}), **given}
        elif value is not None:
            data[key] = value
    return NodeAgentSettings(**data)
