"""The exact annotation, label and taint names of the contract, and the builders for per-container keys.

Every component spells a key through this module, never as a literal of its own: a typo in one component
would otherwise be a silent disagreement between the webhook, the scheduler and the node agent.

Per-container keys have the shape ``<prefix><container>.<suffix>``. Container names are DNS labels (no
dots), so splitting a key at the first dot after the prefix is unambiguous, and ``train`` never matches
``trainer``. Keys under ``nvidia.com/`` and ``kai.scheduler/`` are the NvFractions and KAI Scheduler
names, spelled exactly as they do; everything gpufrac adds lives under ``gpufrac.io/``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

# -- per-container NvFractions keys (nvidia.com/container.<c>.<suffix>) ---------------------------------

NVIDIA_CONTAINER_PREFIX = "nvidia.com/container."
MEMORY_REQUEST = "gpu-memory.request"
MEMORY_LIMIT = "gpu-memory.limit"
COMPUTE_MODE = "gpu-compute.mode"
COMPUTE_PORTION = "gpu-compute.portion"
DEVICES = "gpus.devices"
#: KAI Scheduler's user-settable compute share of a container (a portion in (0, 1]); the scheduler charges
#: it instead of the memory-proportional share on sm-sharing GPUs (KAI's
#: ``CalcGpuComputeRequestAnnotationForContainer``).
COMPUTE_REQUEST = "gpu-compute.request"

NVIDIA_CONTAINER_SUFFIXES = (
    MEMORY_REQUEST,
    MEMORY_LIMIT,
    COMPUTE_MODE,
    COMPUTE_PORTION,
    DEVICES,
    COMPUTE_REQUEST,
)

# -- KAI Scheduler's per-container portion limit (kai.scheduler/container.<c>.<suffix>) -------------------

KAI_CONTAINER_PREFIX = "kai.scheduler/container."
PORTION_LIMIT = "gpu-memory.portion.limit"

# -- gpufrac's own per-container keys (gpufrac.io/container.<c>.<suffix>) --------------------------------

GPUFRAC_CONTAINER_PREFIX = "gpufrac.io/container."
#: Whole, exclusive GPUs for a container. The webhook writes it when it removes ``nvidia.com/gpu: N`` from a
#: pod for our scheduler, so the kubelet's device plugin never hands out a GPU on a managed node.
WHOLE_GPUS = "gpus"

#: A resize request of a running fractional container (docs/user-guide.md, "Resizing a running fraction"):
#: the user writes the new amounts here, never into the binder-resolved ``nvidia.com/`` memory keys, which
#: are the node's only source; the scheduler decides, writes the new resolved MiB and removes these keys
#: in one patch (``gpufrac.contract.resize``, ``gpufrac.scheduler.resize``).
RESIZE_MEMORY_REQUEST = "resize.gpu-memory.request"
RESIZE_MEMORY_LIMIT = "resize.gpu-memory.limit"
RESIZE_FRACTION = "resize.gpu-fraction"
RESIZE_FRACTION_LIMIT = "resize.gpu-fraction.limit"
#: The new compute share of an sm-sharing container, a portion in (0, 1] (the request form of
#: ``COMPUTE_REQUEST``); the scheduler answers by rewriting the binder-owned ``COMPUTE_PORTION``.
RESIZE_COMPUTE_REQUEST = "resize.gpu-compute.request"
RESIZE_SUFFIXES = (
    RESIZE_MEMORY_REQUEST,
    RESIZE_MEMORY_LIMIT,
    RESIZE_FRACTION,
    RESIZE_FRACTION_LIMIT,
    RESIZE_COMPUTE_REQUEST,
)

#: MIG slices for a container (docs/mig.md, docs/user-guide.md "Hardware-isolated MIG slices"): a profile
#: as the device plugin names it (``1g.10gb``; the webhook writes it from ``nvidia.com/mig-1g.10gb``), how
#: many such slices (default 1), or instead of a profile the least memory of the slice
#: (``mig.gpu-memory: 20Gi``: the smallest profile with that much, on the model the scheduler picks).
MIG_PROFILE = "mig.profile"
MIG_COUNT = "mig.count"
MIG_MEMORY = "mig.gpu-memory"
MIG_SUFFIXES = (MIG_PROFILE, MIG_COUNT, MIG_MEMORY)

GPUFRAC_CONTAINER_SUFFIXES = (WHOLE_GPUS, *RESIZE_SUFFIXES, *MIG_SUFFIXES)

# -- pod-level KAI Scheduler forms ----------------------------------------------------------------------

GPU_FRACTION = "gpu-fraction"
GPU_FRACTION_LIMIT = "gpu-fraction.limit"
GPU_FRACTION_NUM_DEVICES = "gpu-fraction-num-devices"
GPU_FRACTION_CONTAINER_NAME = "gpu-fraction-container-name"
GPU_MEMORY = "gpu-memory"
GPU_MEMORY_LIMIT = "gpu-memory.limit"
#: KAI Scheduler's pod-level MPS switch (``"true"``: the fraction's processes are clients of an MPS server
#: and share SMs). gpufrac reads it as ``sm-sharing`` for the pod's fractional containers. Not in
#: ``POD_LEVEL_KEYS``: alone it asks for nothing, so it does not send a pod to the webhook.
KAI_MPS = "mps"

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
#: The NVIDIA device plugin's MIG resources (``mixed`` strategy): ``nvidia.com/mig-<profile>``, e.g.
#: ``nvidia.com/mig-1g.10gb``.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

QUEUE_LABEL = "gpufrac.io/queue"
KAI_QUEUE_LABEL = "kai.scheduler/queue"
#: On a Namespace (set by the cluster admin): the queue of the namespace's pods that name none.
NAMESPACE_DEFAULT_QUEUE_LABEL = "gpufrac.io/default-queue"

#: The API group of gpufrac's resources (GpuFractioningConfig, Queue) and of KAI Scheduler's Queue
#: (scheduling.run.ai/v2), which the scheduler reads (docs/queues.md).
API_GROUP = "gpufrac.io"
#: The ``Queue`` resource (deploy/crds/gpufrac.io_queues.yaml): version and plural, read by the scheduler
#: and the webhook.
QUEUE_API_VERSION = "v1alpha1"
QUEUE_PLURAL = "queues"
KAI_SCHEDULING_API_GROUP = "scheduling.run.ai"
#: A pod's gang: scheduler-plugins' coscheduling label, and KAI Scheduler's pod annotation; each names a
#: PodGroup object of the pod's namespace whose ``spec.minMember`` pods must start together.
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KAI_POD_GROUP_ANNOTATION = "pod-group-name"

#: Managed GPU nodes carry this taint so that other schedulers stay off them; pods of our scheduler that
#: ask for a GPU get the matching toleration from the webhook.
MANAGED_TAINT_KEY = "gpufrac.io/managed"
MANAGED_TAINT_VALUE = "true"
MANAGED_TAINT_EFFECT = "NoSchedule"
MANAGED_LABEL = "gpufrac.io/managed"
NODE_GPUS_ANNOTATION = "gpufrac.io/gpus"
#: A Node's wanted GPU modes and MIG layouts (the scheduler writes it) and where each stands (the node
#: agent writes it): docs/mig.md, "Layout changes".
NODE_GPU_LAYOUT_ANNOTATION = "gpufrac.io/gpu-layout"
NODE_GPU_LAYOUT_STATUS_ANNOTATION = "gpufrac.io/gpu-layout-status"
NODE_READY_CONDITION = "gpu-fractioning.nvidia.com/Ready"
# The reasons gpufrac's node agent writes on NODE_READY_CONDITION. NVIDIA's GPU-fractioning operator writes
# the same condition type with reasons of its own, so a reason outside this set is another node stack's.
NODE_REASON_READY = "GpuFractioningReady"
NODE_REASON_INVENTORY_UNAVAILABLE = "GpuInventoryUnavailable"
NODE_REASON_NO_GPUS = "NoUsableGpus"
NODE_REASON_NRI_NOT_CONNECTED = "NriPluginNotConnected"
NODE_REASON_NO_ENFORCEABLE_MODE = "NoEnforceableComputeMode"
NODE_REASON_AGENT_STOPPED = "NodeAgentStopped"
# GPU stack gates (gpufrac.node.gpustack): the stack below gpufrac would not enforce the injected limits.
NODE_REASON_OPERAND_UNSUPPORTED = "GPUOperandVersionUnsupported"
NODE_REASON_DRIVER_UNSUPPORTED = "GPUDriverVersionUnsupported"
#: The GPU Operator's ClusterPolicy exists and its ``status.state`` is not ``ready``: its operands (the
#: toolkit's memory-limit hook among them) may be missing, rolling or failing on this node.
NODE_REASON_GPU_OPERATOR_NOT_READY = "GPUOperatorNotReady"
#: Node label: whether the node passed the GPU stack gate, failed it, or runs on its escape hatch.
GPU_STACK_GATE_LABEL = "gpufrac.io/gpu-stack-gate"
#: Written by the operator, with status Unknown, when a node agent's Lease expired (the agent was killed,
#: hangs, or cannot reach the API server): the node's last word may be stale, as the node lifecycle
#: controller marks a silent kubelet's Ready Unknown.
NODE_REASON_AGENT_HEARTBEAT_EXPIRED = "NodeAgentHeartbeatExpired"
#: The GPU Operator is upgrading the node's driver (``gpufrac.contract.gpu_operator``): MPS is drained and
#: the agent has let go of NVML, so that the driver can unload.
NODE_REASON_DRIVER_UPGRADE = "DriverUpgradeInProgress"
#: Node readiness while the driver's per-cgroup memory limit has not passed the agent's canary.
NODE_REASON_MEMORY_LIMIT_CANARY_FAILED = "GpuMemoryLimitCanaryFailed"
NODE_AGENT_REASONS = frozenset(
    {
        NODE_REASON_OPERAND_UNSUPPORTED,
        NODE_REASON_DRIVER_UNSUPPORTED,
        NODE_REASON_GPU_OPERATOR_NOT_READY,
        NODE_REASON_READY,
        NODE_REASON_INVENTORY_UNAVAILABLE,
        NODE_REASON_NO_GPUS,
        NODE_REASON_NRI_NOT_CONNECTED,
        NODE_REASON_NO_ENFORCEABLE_MODE,
        NODE_REASON_AGENT_STOPPED,
        NODE_REASON_AGENT_HEARTBEAT_EXPIRED,
        NODE_REASON_DRIVER_UPGRADE,
        NODE_REASON_MEMORY_LIMIT_CANARY_FAILED,
    }
)
#: Pod condition written by the node agent: True only when every fractional container of the pod on the
#: node had its GPU memory limits read back from the driver equal to its plan (docs/node-agent.md).
POD_MEMORY_ENFORCED_CONDITION = "GpuMemoryEnforced"
POD_REASON_LIMITS_READ_BACK = "LimitsReadBack"
POD_REASON_LIMITS_NOT_IN_FORCE = "LimitsNotInForce"
POD_REASON_LIMITS_NOT_VERIFIED = "LimitsNotVerified"
#: Pod condition written by the scheduler while a resize request (``RESIZE_SUFFIXES``) waits: status True,
#: reason ``Deferred`` (no room on the pod's GPUs now; retried as room frees) or ``Infeasible`` (larger
#: than the GPU, or against the queue's limit). Removed when the resize is done or withdrawn. Not
#: Kubernetes' ``PodResizePending``: the kubelet owns that one for CPU and memory.
POD_RESIZE_PENDING_CONDITION = "gpufrac.io/GpuResizePending"
POD_REASON_RESIZE_DEFERRED = "Deferred"
POD_REASON_RESIZE_INFEASIBLE = "Infeasible"
#: Pod condition written by the node agent while a decided resize is not fully in force on the node
#: (reasons ``Applying``, ``WaitingForUsage``, ``LimitBelowUsage``: ``gpufrac.node.resize``); named here
#: for its readers (``kubectl gpufrac explain``).
POD_RESIZE_IN_PROGRESS_CONDITION = "gpufrac.io/GpuResizeInProgress"
#: The scheduler's Events about resizes: done (Normal) and refused (Warning).
EVENT_REASON_RESIZED = "Resized"
EVENT_REASON_RESIZE_INFEASIBLE = "ResizeInfeasible"
#: The namespace of the node agents' heartbeat Leases, one per node named after it (the kubelet's are in
#: ``kube-node-lease``). The agent renews its own; the scheduler and the operator watch them.
NODE_LEASE_NAMESPACE = "gpufrac-node-lease"
#: The node agent's readiness while another node stack writes NODE_READY_CONDITION. The agent then stops
#: writing that condition (it would flap between the two writers) and says so here instead.
NODE_REASON_CONFLICTING_STACK = "ConflictingNodeStack"
#: Set by the node agent, to what it found, while another GPU-fractioning node stack writes
#: NODE_READY_CONDITION on the node; absent otherwise. The scheduler places nothing on such a node.
NODE_STACK_CONFLICT_ANNOTATION = "gpufrac.io/node-stack-conflict"
#: How many GPUs the node publishes; the node agent writes it, the operator sizes the agent's memory by it.
GPU_COUNT_LABEL = "gpufrac.io/gpu-count"
#: The NVIDIA driver's major version, under the name the GPU-fractioning operator (KAI) uses for it; the
#: node agent writes it, the operator gates on it (``GpuFractioningConfig.spec.minDriverMajor``).
DRIVER_MAJOR_LABEL = "gpu-fractioning.kai.scheduler/nvidia-driver-version.major"
#: The GPU model when every published GPU of the node is the same model (absent otherwise): the node agent
#: writes it, and required node affinity on it is how a pod says "only these models" to the scheduler.
GPU_MODEL_LABEL = "gpufrac.io/gpu-model"
#: The node agent's capability labels: ``gpufrac.io/compute-mode.<mode>: "true"|"false"`` say which
#: compute modes the node can enforce memory for; the scheduler never places a mode a node cannot enforce.
COMPUTE_MODE_LABEL_PREFIX = "gpufrac.io/compute-mode."

#: The CDI kind NVIDIA's CDI specs give whole GPUs (``nvidia.com/gpu=<index|uuid|all>``): what the node
#: agent requests for a GPU given by UUID or index, and what a simulated node's CDI spec declares.
CDI_GPU_KIND = "nvidia.com/gpu"
#: The CDI kind of the NVIDIA device plugin's own specs, which KAI Scheduler's binder writes into
#: ``.gpus.devices`` when the device plugin uses CDI (``k8s.device-plugin.nvidia.com/gpu=<uuid>``).
DEVICE_PLUGIN_CDI_GPU_KIND = "k8s.device-plugin.nvidia.com/gpu"

DEFAULT_SCHEDULER_NAME = "gpufrac-scheduler"
#: A pod's own placement policy (``binpack``, ``spread``, ``kai``, ``fgd``, ``fgd-align``), overriding
#: the scheduler's configured one; an unknown name makes the pod unschedulable with the known names.
PLACEMENT_POLICY_ANNOTATION = "gpufrac.io/placement-policy"
#: A pod's opt-out (value ``"true"``) from the mutating webhook giving a pod that asks for a GPU fraction
#: and names no scheduler gpufrac's scheduler name.
KEEP_SCHEDULER_NAME_ANNOTATION = "gpufrac.io/keep-scheduler-name"
#: A pod's consent to be moved by consolidation (value ``"true"``): the scheduler may evict it so that a
#: pending pod fits, when a new home for it exists elsewhere. Honoured only for a pod a controller owns
#: (an ownerReference with ``controller: true``), which recreates it; a bare pod is never moved.
MOVABLE_ANNOTATION = "gpufrac.io/movable"


# -- Dynamic Resource Allocation (resource.k8s.io/v1; docs/dra.md) ------------------------------------------

#: The DRA driver name of gpufrac's node agent: its ResourceSlices, the DeviceClasses of the chart and
#: the claims' allocations all carry it. A DNS subdomain of ours (at most 63 characters).
DRA_DRIVER_NAME = "gpu.gpufrac.io"
#: The consumable capacity of each published GPU device: usable MiB as the inventory reports them.
#: A claim asks for its share with ``capacity.requests.memory``.
DRA_MEMORY_CAPACITY = "memory"
#: The consumable compute share of each GPU device, in percent of its SMs (value 100). An sm-sharing
#: claim asks for its portion with ``capacity.requests.compute`` (``25``: MPS active-thread percentage 25);
#: a claim that names none consumes 0, so time-slicing claims never use it up.
DRA_COMPUTE_CAPACITY = "compute"
#: Device attributes users select on (CEL: ``device.attributes["gpu.gpufrac.io"].model``). Names are
#: C identifiers of at most 32 characters (resource.k8s.io/v1 ``DeviceMaxIDLength``).
DRA_ATTRIBUTE_MODEL = "model"
DRA_ATTRIBUTE_UUID = "uuid"
DRA_ATTRIBUTE_INDEX = "index"
DRA_ATTRIBUTE_DRIVER_MAJOR = "driverMajor"
#: One boolean attribute per compute mode: whether the node can enforce that mode's limits right now
#: (the same capability as the ``COMPUTE_MODE_LABEL_PREFIX`` labels); ``node.dra.slices`` maps the modes.
DRA_ATTRIBUTE_TIME_SLICING = "timeSlicing"
DRA_ATTRIBUTE_SM_SHARING = "smSharing"
#: The CDI kind of the specs our DRA driver writes at prepare: ``gpu.gpufrac.io/claim=<claim uid>-<device>``.
#: A container with such a device holds a share gpufrac placed and prepared (never a foreign GPU).
DRA_CDI_KIND = f"{DRA_DRIVER_NAME}/claim"
#: The opaque configuration each of the chart's DeviceClasses hands our driver with an allocation
#: (``spec.config[].opaque.parameters``): ``{"apiVersion", "kind", "computeMode": <mode>}``; a claim's
#: own configuration may add ``"memoryLimit": <quantity>`` (a limit above the consumed share). The
#: kubelet plugin reads them at prepare.
DRA_CONFIG_API_VERSION = "gpu.gpufrac.io/v1alpha1"
DRA_CONFIG_KIND = "GpuShareConfig"
DRA_CONFIG_COMPUTE_MODE = "computeMode"
DRA_CONFIG_MEMORY_LIMIT = "memoryLimit"
#: The chart's DeviceClass per compute mode is ``<mode>.<driver>`` (``time-slicing.gpu.gpufrac.io``).
#: The finalizer kube-scheduler puts on a ResourceClaim before it allocates it
#: (k8s.io/api/resource/v1 ``Finalizer``): the claim is not deleted while allocated;
#: kube-controller-manager removes it when it deallocates. gpufrac-scheduler allocates the same way.
DRA_CLAIM_FINALIZER = "resource.kubernetes.io/delete-protection"

#: ``gpufrac up`` runs its node agents as local processes, not pods: it names their metrics URLs (data:
#: node name -> URL) in this ConfigMap, where ``kubectl gpufrac top`` finds them when no agent pod runs.
LOCAL_NODE_AGENTS_NAMESPACE = "gpufrac-system"
LOCAL_NODE_AGENTS_CONFIGMAP = "gpufrac-local-node-agents"

#: The name the node agent registers with the runtime's NRI (``PluginIdentity``), and the one GPU
#: containers require.
NRI_PLUGIN_NAME = "gpufrac"
#: The name the agent's validating plugin (``gpufrac node-agent-validator``) registers with; GPU containers
#: require it too where the validator runs (the webhook's ``--required-nri-plugin``).
NRI_VALIDATOR_PLUGIN_NAME = f"{NRI_PLUGIN_NAME}-validator"
#: NRI's own annotation (github.com/containerd/nri, ``plugin.RequiredPluginsAnnotation``): a YAML list of
#: NRI plugins that must process the container. With containerd's built-in NRI validator enabled
#: (``[plugins."io.containerd.nri.v1.nri".default_validator] enable = true``) the runtime refuses to
#: create the container while one of them is not connected -- fail-closed even when the node agent is
#: down. The mutating webhook writes it for every container that asks for a GPU.
#: ``<key>/pod`` and ``<key>/container.<name>`` are its scoped forms; NRI reads the container's first.
NRI_REQUIRED_PLUGINS_ANNOTATION = "required-plugins.noderesource.dev"
NRI_REQUIRED_PLUGINS_PREFIX = f"{NRI_REQUIRED_PLUGINS_ANNOTATION}/container."


def nri_required_plugins_key(container: str) -> str:
    return f"{NRI_REQUIRED_PLUGINS_PREFIX}{container}"


def nri_required_plugins_value(plugins: Sequence[str] = (NRI_PLUGIN_NAME,)) -> str:
    """The annotation's value: ``plugins`` (the agent's alone by default), as the YAML (JSON) list NRI's
    validator reads."""
    return json.dumps(list(plugins))


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


def compute_request_key(container: str) -> str:
    return container_key(container, COMPUTE_REQUEST)


def devices_key(container: str) -> str:
    return container_key(container, DEVICES)


def portion_limit_key(container: str) -> str:
    """``kai.scheduler/container.<container>.gpu-memory.portion.limit``."""
    return f"{KAI_CONTAINER_PREFIX}{container}.{PORTION_LIMIT}"


def whole_gpus_key(container: str) -> str:
    """``gpufrac.io/container.<container>.gpus``."""
    return f"{GPUFRAC_CONTAINER_PREFIX}{container}.{WHOLE_GPUS}"


def mig_key(container: str, suffix: str) -> str:
    """``gpufrac.io/container.<container>.<suffix>`` for one of ``MIG_SUFFIXES``."""
    return f"{GPUFRAC_CONTAINER_PREFIX}{container}.{suffix}"


def mig_resource(profile: str) -> str:
    """``nvidia.com/mig-<profile>``."""
    return f"{MIG_RESOURCE_PREFIX}{profile}"


def resize_key(container: str, suffix: str) -> str:
    """``gpufrac.io/container.<container>.<suffix>`` for one of ``RESIZE_SUFFIXES``."""
    return f"{GPUFRAC_CONTAINER_PREFIX}{container}.{suffix}"


def is_resize_key(key: str) -> bool:
    """Whether ``key`` is a resize request key (``gpufrac.io/container.<c>.resize.*``)."""
    split = split_container_key(key)
    return split is not None and split.prefix == GPUFRAC_CONTAINER_PREFIX and split.suffix in RESIZE_SUFFIXES


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
    return key in POD_LEVEL_KEYS or key == KAI_MPS or split_container_key(key) is not None


# -- the API server's rule for annotation keys ----------------------------------------------------------

#: The longest name part of a qualified name (the part after ``<prefix>/``).
QUALIFIED_NAME_MAX_CHARS = 63
#: The longest prefix of a qualified name (a DNS-1123 subdomain).
QUALIFIED_PREFIX_MAX_CHARS = 253
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", re.ASCII)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII)


@functools.lru_cache(maxsize=4096)  # a scheduler checks the same few keys for every pod it binds
def annotation_key_problem(key: str) -> str | None:
    """Why the API server would refuse ``key`` as an annotation key, in its own words; None if it is valid.

    The API server checks annotation keys with ``IsQualifiedName`` on the lower-cased key
    (k8s.io/apimachinery, pkg/api/validation/objectmeta.go): an optional DNS-1123 subdomain prefix of at
    most 253 characters and a ``/``, then a name of at most 63 characters that starts and ends with an
    alphanumeric character and holds only alphanumerics, ``-``, ``_`` and ``.``. A Binding's annotations
    are merged into the pod WITHOUT this check, so whatever the scheduler writes must pass it here first:
    a pod holding an invalid key fails every later update, finalizer removal included.
    """
    parts = key.lower().split("/")
    if len(parts) > 2:
        return "a qualified name has at most one '/', between an optional DNS subdomain prefix and the name"
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            return "the prefix part must be non-empty"
        if len(prefix) > QUALIFIED_PREFIX_MAX_CHARS:
            return f"the prefix part must be no more than {QUALIFIED_PREFIX_MAX_CHARS} characters"
        if not _DNS_SUBDOMAIN.fullmatch(prefix):
            return "the prefix part must be a lowercase DNS-1123 subdomain"
    if not name:
        return "the name part must be non-empty"
    if len(name) > QUALIFIED_NAME_MAX_CHARS:
        return f"the name part must be no more than {QUALIFIED_NAME_MAX_CHARS} characters, it has {len(name)}"
    if not _QUALIFIED_NAME.fullmatch(name):
        return (
            "the name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return None


#: Kubernetes' well-known topology labels (the kubelet sets the hostname, cloud providers the zone): the
#: keys pod affinity and spread constraints usually name, and what simulated nodes carry.
HOSTNAME_LABEL = "kubernetes.io/hostname"
ZONE_LABEL = "topology.kubernetes.io/zone"
