"""The ``GpuFractioningConfig`` resource and its spec, read once into typed values.

The CRD (``deploy/crds/gpufrac.io_gpufractioningconfigs.yaml``) is the schema and applies the defaults on
the server; the defaults are repeated here only so that a spec read from anywhere else (a unit test, an
object stored before a default was added) renders the same DaemonSet. Everything below the reconciler works
on ``ConfigSpec``, never on the raw dictionary the generic resource carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightkube.generic_resource import create_global_resource

from gpufrac.contract import keys

GROUP = keys.API_GROUP
VERSION = "v1alpha1"
KIND = "GpuFractioningConfig"
PLURAL = "gpufractioningconfigs"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

GpuFractioningConfig = create_global_resource(GROUP, VERSION, KIND, PLURAL)

DEFAULT_NAMESPACE = "gpufrac-system"
#: The label NVIDIA's GPU feature discovery puts on GPU nodes. Not ``gpufrac.io/managed``: the agent
#: writes that label itself, so selecting on it would never start the first agent.
DEFAULT_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
DEFAULT_NRI_SOCKET = "/var/run/nri/nri.sock"
DEFAULT_CRI_SOCKET = "/run/containerd/containerd.sock"
DEFAULT_METRICS_PORT = 9400
DEFAULT_HEALTH_PORT = 8082


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """``spec.nodeAgent``."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    runtime_class_name: str | None = None
    node_selector: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_NODE_SELECTOR))
    tolerations: tuple[dict[str, Any], ...] = ()
    resources: dict[str, Any] = field(default_factory=dict)
    fail_open: bool = False
    taint: bool = True
    mps_enabled: bool = False
    mps_control_bin: str | None = None
    mps_time_slicing_clients: bool = False
    gpu_toolkit_version: str | None = None
    gpu_device_plugin_version: str | None = None
    allow_unsupported_gpu_stack: bool = False
    dra_enabled: bool = False
    #: Run ``gpufrac node-agent-validator`` beside the agent (``spec.nodeAgent.validator.enabled``).
    validator_enabled: bool = True
    metrics_port: int = DEFAULT_METRICS_PORT
    health_port: int = DEFAULT_HEALTH_PORT
    nri_socket: str = DEFAULT_NRI_SOCKET
    cri_socket: str = DEFAULT_CRI_SOCKET
    #: Test clusters without GPUs only: the agent's simulated backend with these GPUs (``--sim-gpus``).
    simulated_gpus: str | None = None
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """A GpuFractioningConfig as the operator uses it: its identity and its spec."""

    name: str
    uid: str
    generation: int
    namespace: str
    agent: AgentSpec
    min_driver_major: int | None = None


def read_config(config: Any) -> ConfigSpec:
    """The typed spec of a ``GpuFractioningConfig`` object (the generic resource lightkube decodes).

    Raises ``ValueError`` when the spec lacks what the CRD requires (``nodeAgent.image``), which only an
    object written without the CRD's validation can.
    """
    meta = config.metadata
    spec = config.spec or {}
    agent = spec.get("nodeAgent") or {}
    if not agent.get("image"):
        raise ValueError("spec.nodeAgent.image is required")
    mps = agent.get("mps") or {}
    stack = agent.get("gpuStack") or {}
    selector = agent.get("nodeSelector")
    return ConfigSpec(
        name=meta.name,
        uid=meta.uid or "",
        generation=meta.generation or 0,
        namespace=spec.get("namespace") or DEFAULT_NAMESPACE,
        min_driver_major=spec.get("minDriverMajor"),
        agent=AgentSpec(
            image=agent["image"],
            image_pull_policy=agent.get("imagePullPolicy") or "IfNotPresent",
            runtime_class_name=agent.get("runtimeClassName") or None,
            node_selector=dict(DEFAULT_NODE_SELECTOR if selector is None else selector),
            tolerations=tuple(agent.get("tolerations") or ()),
            resources=dict(agent.get("resources") or {}),
            fail_open=bool(agent.get("failOpen", False)),
            taint=bool(agent.get("taint", True)),
            mps_enabled=bool(mps.get("enabled", False)),
            mps_control_bin=mps.get("controlBin") or None,
            mps_time_slicing_clients=bool(mps.get("timeSlicingClients", False)),
            gpu_toolkit_version=stack.get("toolkitVersion") or None,
            gpu_device_plugin_version=stack.get("devicePluginVersion") or None,
            allow_unsupported_gpu_stack=bool(stack.get("allowUnsupported", False)),
            dra_enabled=bool((agent.get("dra") or {}).get("enabled", False)),
            validator_enabled=bool((agent.get("validator") or {}).get("enabled", True)),
            metrics_port=int(agent.get("metricsPort", DEFAULT_METRICS_PORT)),
            health_port=int(agent.get("healthPort", DEFAULT_HEALTH_PORT)),
            nri_socket=agent.get("nriSocket") or DEFAULT_NRI_SOCKET,
            cri_socket=agent.get("criSocket") or DEFAULT_CRI_SOCKET,
            simulated_gpus=agent.get("simulatedGpus") or None,
            log_level=agent.get("logLevel") or "info",
        ),
    )
