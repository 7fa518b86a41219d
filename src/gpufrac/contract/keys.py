"""The exact annotation, label and taint names of the contract, and the builders for per-container keys.

Every component spells a key through this module, never as a literal of its own: a typo in one component
would otherwise be a silent disagreement between the webhook, the scheduler and the node agent.

Per-container keys have the shape ``<prefix><container>.<suffix>``. Container names are DNS labels (no
dots), so splitting a key at the first dot after the prefix is unambiguous, and ``train`` never matches
``trainer``. Keys under ``nvidia.com/`` and ``kai.scheduler/`` are the NvFractions and KAI Scheduler
names, spelled exactly as they do; everything gpufrac adds lives under ``gpufrac.io/``.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- per-container NvFractions keys (nvidia.com/container.<c>.<suffix>) ---------------------------------

NVIDIA_CONTAINER_PREFIX = "nvidia.com/container."
MEMORY_REQUEST = "gpu-memory.request"
MEMORY_LIMIT = "gpu-memory.limit"
COMPUTE_MODE = "gpu-compute.mode"
COMPUTE_PORTION = "gpu-compute.portion"
DEVICES = "gpus.devices"

NVIDIA_CONTAINER_SUFFIXES = (MEMORY_REQUEST, MEMORY_LIMIT, COMPUTE_MODE, COMPUTE_PORTION, DEVICES)

# -- KAI Scheduler's per-container portion limit (kai.scheduler/container.<c>.<suffix>) -------------------

KAI_CONTAINER_PREFIX = "kai.scheduler/container."
PORTION_LIMIT = "gpu-memory.portion.limit"

# -- gpufrac's own per-container keys (gpufrac.io/container.<c>.<suffix>) --------------------------------

GPUFRAC_CONTAINER_PREFIX = "gpufrac.io/container."
#: Whole, exclusive GPUs for a container. The webhook writes it when it removes ``nvidia.com/gpu: N`` from a
#: pod for our scheduler, so the kubelet's device plugin never hands out a GPU on a managed node.
WHOLE_GPUS = "gpus"

GPUFRAC_CONTAINER_SUFFIXES = (WHOLE_GPUS,)

# -- pod-level KAI Scheduler forms ----------------------------------------------------------------------

GPU_FRACTION = "gpu-fraction"
GPU_FRACTION_LIMIT = "gpu-fraction.limit"
GPU_FRACTION_NUM_DEVICES = "gpu-fraction-num-devices"
GPU_FRACTION_CONTAINER_NAME = "gpu-fraction-container-name"
GPU_MEMORY = "gpu-memory"
GPU_MEMORY_LIMIT = "gpu-memory.limit"

POD_LEVEL_KEYS = (
    GPU_FRACTION,
    GPU_FRACTION_LIMIT,
    GPU_FRACTION_NUM_DEVICES,
    GPU_FRACTION_CONTAINER_NAME,
    GPU_MEMORY,
    GPU_MEMORY_LIMIT,
)

# -- resources, labels, taints, node inventory ----------------------------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"

QUEUE_LABEL = "gpufrac.io/queue"
KAI_QUEUE_LABEL = "kai.scheduler/queue"

#: Managed GPU nodes carry this taint so that other schedulers stay off them; pods of our scheduler that
#: ask for a GPU get the matching toleration from the webhook.
MANAGED_TAINT_KEY = "gpufrac.io/managed"
MANAGED_TAINT_VALUE = "true"
MANAGED_TAINT_EFFECT = "NoSchedule"
MANAGED_LABEL = "gpufrac.io/managed"
NODE_GPUS_ANNOTATION = "gpufrac.io/gpus"
NODE_READY_CONDITION = "gpu-fractioning.nvidia.com/Ready"
#: The NVIDIA driver's major version, under the name the GPU-fractioning operator (KAI) uses for it; the
#: node agent writes it, the operator gates on it (``GpuFractioningConfig.spec.minDriverMajor``).
DRIVER_MAJOR_LABEL = "gpu-fractioning.kai.scheduler/nvidia-driver-version.major"
#: The node agent's capability labels: ``gpufrac.io/compute-mode.<mode>: "true"|"false"`` say which
#: compute modes the node can enforce memory for; the scheduler never places a mode a node cannot enforce.
COMPUTE_MODE_LABEL_PREFIX = "gpufrac.io/compute-mode."

DEFAULT_SCHEDULER_NAME = "gpufrac-scheduler"
#: A pod's own placement policy (``binpack``, ``spread``, ``kai``, ``fgd``, ``fgd-align``), overriding
#: the scheduler's configured one; an unknown name makes the pod unschedulable with the known names.
PLACEMENT_POLICY_ANNOTATION = "gpufrac.io/placement-policy"


#: The name the node agent registers with the runtime's NRI (``PluginIdentity``), and the one GPU
#: containers require.
NRI_PLUGIN_NAME = "gpufrac"
#: NRI's own annotation (github.com/containerd/nri, ``plugin.RequiredPluginsAnnotation``): a YAML list of
#: NRI plugins that must process the container. With containerd's built-in NRI validator enabled
#: (``[plugins."io.containerd.nri.v1.nri".default_validator] enable = true``) the runtime refuses to
#: create the container while one of them is not connected -- fail-closed even when the node agent is
#: down. The mutating webhook writes it for every container that asks for a GPU.
NRI_REQUIRED_PLUGINS_PREFIX = "required-plugins.noderesource.dev/container."


def nri_required_plugins_key(container: str) -> str:
    return f"{NRI_REQUIRED_PLUGINS_PREFIX}{container}"


def nri_required_plugins_value() -> str:
    """The annotation's value: our plugin, as the YAML (JSON) list NRI's validator reads."""
    return f'["{NRI_PLUGIN_NAME}"]'


def container_key(container: str, suffix: str) -> str:
    """``nvidia.com/container.<container>.<suffix>``."""
    return f"{NVIDIA_CONTAINER_PREFIX}{container}.{suffix}"


def memory_request_key(container: str) -> str:
    return container_key(container, MEMORY_REQUEST)


def memory_limit_key(container: str) -> str:
    return container_key(container, MEMORY_LIMIT)


def compute_mode_key(container: str) -> str:
    return container_key(container, COMPUTE_MODE)


def compute_portion_key(container: str) -> str:
    return container_key(container, COMPUTE_PORTION)


def devices_key(container: str) -> str:
    return container_key(container, DEVICES)


def portion_limit_key(container: str) -> str:
    """``kai.scheduler/container.<container>.gpu-memory.portion.limit``."""
    return f"{KAI_CONTAINER_PREFIX}{container}.{PORTION_LIMIT}"


def whole_gpus_key(container: str) -> str:
    """``gpufrac.io/container.<container>.gpus``."""
    return f"{GPUFRAC_CONTAINER_PREFIX}{container}.{WHOLE_GPUS}"


BINDER_OWNED_SUFFIXES = (DEVICES, COMPUTE_PORTION)


def is_binder_owned(key: str) -> bool:
    """Whether only the scheduler (the binder) may write ``key``: device assignment and compute portion."""
    split = split_container_key(key)
    return (
        split is not None
        and split.prefix == NVIDIA_CONTAINER_PREFIX
        and split.suffix in BINDER_OWNED_SUFFIXES
    )


def managed_toleration() -> dict[str, str]:
    """The toleration a pod needs to run on a managed node (any value of the taint)."""
    return {"key": MANAGED_TAINT_KEY, "operator": "Exists", "effect": MANAGED_TAINT_EFFECT}


@dataclass(frozen=True, slots=True)
class ContainerKey:
    """A per-container key taken apart: ``<prefix><container>.<suffix>``."""

    prefix: str
    container: str
    suffix: str


CONTAINER_PREFIXES = (NVIDIA_CONTAINER_PREFIX, KAI_CONTAINER_PREFIX, GPUFRAC_CONTAINER_PREFIX)


def split_container_key(key: str) -> ContainerKey | None:
    """Take a per-container key apart; None when ``key`` has none of the per-container prefixes.

    The container is everything up to the first dot after the prefix (possibly empty, for a malformed
    key), the suffix everything after it (possibly empty).
    """
    for prefix in CONTAINER_PREFIXES:
        if key.startswith(prefix):
            container, _, suffix = key[len(prefix) :].partition(".")
            return ContainerKey(prefix=prefix, container=container, suffix=suffix)
    return None


def is_contract_key(key: str) -> bool:
    """Whether ``key`` belongs to the GPU contract (per-container or pod-level form)."""
    return key in POD_LEVEL_KEYS or split_container_key(key) is not None
