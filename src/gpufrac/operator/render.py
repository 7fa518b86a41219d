"""The node agent's DaemonSet for one GpuFractioningConfig, as a pure function of the config.

Pure so that what the cluster gets is unit-tested line by line and the reconciler only compares and
applies. The pod follows docs/node-agent.md:

- privileged and hostPID: the agent reads every GPU process's cgroup through the host's /proc (mounted
  read-only at ``/host/proc``, the agent's ``--proc-root``) and supervises MPS for the whole node;
- the NRI socket's directory, so the runtime calls the agent at CreateContainer;
- the host's ``/sys/fs/cgroup`` at the same path, read-write: the driver keys each container's GPU memory
  limit by the host path of its cgroup, and the canary makes (and removes) a throwaway cgroup there;
- ``/run/nvidia/mps`` (the MPS pipe directory) and the state directory at the SAME paths as on the host:
  the agent answers the runtime with host paths to bind into containers, so its view must equal the host's;
- only where the NVIDIA GPU Operator lets a GPU client run: its ``nvidia.com/gpu.deploy.client`` label is
  ``true`` or absent (no GPU Operator). The GPU Operator evicts the pods that select that label before it
  unloads the driver, and waits for them to go, so an agent that still held the driver (NVML, MPS) cannot
  make the unload fail with EBUSY; the agent itself lets go earlier, when the upgrade-state label moves
  (docs/node-agent.md, "Driver upgrades"), and comes back when the DaemonSet controller reschedules it;
- the CRI socket's directory (containerd's run directory by default), for the audit (without it the agent
  only reports usage);
- the toleration of the managed taint, which the agent itself puts on its node: without it a restarted
  agent could never come back to the node it manages;
- ``NVIDIA_VISIBLE_DEVICES=all`` with the utility capability (and compute with MPS), so the NVIDIA
  container toolkit mounts NVML and the MPS binaries into the privileged agent (``runtimeClassName``
  where the NVIDIA runtime is not the node's default).

Beside the agent runs its validating NRI plugin (``gpufrac node-agent-validator``, a second container of
the same pod, not privileged, with only the NRI socket's directory): it refuses a GPU container whose
final NRI adjustment lacks the agent's injection, which is what keeps a container from starting bare
while the agent hangs, dies or answers after the runtime's 2 s request timeout (docs/node-agent.md). It
must be a process of its own: a hung agent would hang a validator in its own process too. It follows the
agent's fail-open setting. ``nodeAgent.validator.enabled: false`` leaves it out; ``required_nri_plugins``
says which plugins the webhook must then require of GPU containers (both, or the agent's alone).

The agent's liveness probe restarts a hung agent within about 10 s (every 5 s, 2 s to answer, 2
failures; a startup probe gives the process up to 60 s to start first): an event loop that cannot
answer /healthz in 2 s cannot answer the runtime in its 2 s budget either, so it is out of the runtime's
path already; the validator keeps its containers from starting bare meanwhile, and the probe ends the
wait.

Host memory is sized from the GPU count (``agent_resources``), unless the spec gives ``resources``: the
MPS control daemon and its servers start in the agent's cgroup (they leave it for one of their own where
the agent can move them, docs/mps.md "Handover"; the headroom stays for nodes where it cannot), and
NVIDIA measured about 50 MiB per GPU server (a 256Mi limit failed on nodes with more than 5 GPUs). The
count is the most GPUs any selected node has (GPU feature discovery's ``nvidia.com/gpu.count``, or the
agent's own ``gpufrac.io/gpu-count``), rounded up to a multiple of ``GPU_COUNT_STEP`` so that a node
joining with a few more GPUs does not roll every agent — and MPS with it — on the cluster.

The rendered manifest carries a hash of itself in an annotation; the reconciler applies only when the
hash on the cluster differs, so a Node heartbeat never turns into a write.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from gpufrac.contract import keys
from gpufrac.contract.gpu_operator import DEPLOY_CLIENT_ALLOWED, DEPLOY_CLIENT_LABEL
from gpufrac.contract.keys import GPU_COUNT_LABEL, managed_toleration
from gpufrac.operator.resource import API_VERSION, KIND, ConfigSpec

APP_NAME = "gpufrac-node-agent"
#: The agent container's port serving /metrics (`kubectl gpufrac top` finds it by this name).
METRICS_PORT_NAME = "metrics"
SERVICE_ACCOUNT = "gpufrac-node-agent"
MANAGED_BY = "gpufrac-operator"
#: Names the config a DaemonSet belongs to (the informer selects on it; deletion finds orphans by it).
CONFIG_LABEL = "gpufrac.io/config"
HASH_ANNOTATION = "gpufrac.io/rendered-hash"

STATE_DIR = "/run/gpufrac/node-agent"
MPS_PIPE_DIR = "/run/nvidia/mps"
MPS_LOG_DIR = "/var/log/nvidia-mps"
PROC_ROOT = "/host/proc"
CGROUP_ROOT = "/sys/fs/cgroup"
#: The kubelet's root (plugin registration and plugin sockets) and the CDI spec directory the runtime
#: reads: the DRA driver's sockets and specs must sit at these host paths (docs/dra.md).
KUBELET_DIR = "/var/lib/kubelet"
CDI_DIR = "/var/run/cdi"
MAX_NAME = 63
#: The validator container's /healthz and /readyz (the agent's own ports are the spec's).
VALIDATOR_HEALTH_PORT = 8083
VALIDATOR_PORT_NAME = "validator"
VALIDATOR_RESOURCES = {"requests": {"cpu": "10m", "memory": "128Mi"}, "limits": {"memory": "128Mi"}}

#: Host memory of the agent container: the agent process itself (Python, the NRI connection, the usage
#: series) and, per GPU, its NVML and metrics share plus, with MPS, the GPU's MPS server.
AGENT_BASE_MIB = 256
AGENT_MIB_PER_GPU = 16
MPS_SERVER_MIB_PER_GPU = 50
GPU_COUNT_STEP = 8
#: Labels that say how many GPUs a node has: GPU feature discovery's, then the node agent's own.
GPU_COUNT_LABELS = ("nvidia.com/gpu.count", GPU_COUNT_LABEL)


def sized_gpu_count(counts: Iterable[int]) -> int:
    """The GPU count the agent is sized for: the largest, rounded up to ``GPU_COUNT_STEP`` (at least one
    step, also when no node says)."""
    most = max(counts, default=0)
    return max(1, math.ceil(most / GPU_COUNT_STEP)) * GPU_COUNT_STEP


def node_gpu_count(labels: Mapping[str, str]) -> int:
    """How many GPUs a node's labels say it has (0 when none says, or says nonsense)."""
    for key in GPU_COUNT_LABELS:
        value = labels.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def agent_resources(*, gpus: int, mps: bool) -> dict[str, Any]:
    """Requests and limits for an agent on nodes of up to ``gpus`` GPUs (request = limit for memory: the
    agent must not be the first evicted under memory pressure, its exit leaves GPU pods unenforced)."""
    per_gpu = AGENT_MIB_PER_GPU + (MPS_SERVER_MIB_PER_GPU if mps else 0)
    memory = f"{AGENT_BASE_MIB + gpus * per_gpu}Mi"
    return {"requests": {"cpu": "100m", "memory": memory}, "limits": {"memory": memory}}


def daemonset_name(config_name: str) -> str:
    """``gpufrac-node-agent-<config>``; the CRD keeps config names short enough for a DNS label."""
    return f"{APP_NAME}-{config_name}"[:MAX_NAME].rstrip("-.")


def selector_labels(config_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, CONFIG_LABEL: config_name}


def agent_args(config: ConfigSpec) -> list[str]:
    """The ``gpufrac node-agent`` arguments the spec asks for (docs/node-agent.md, "Running it")."""
    agent = config.agent
    args = [
        "node-agent",
        "--node-name=$(NODE_NAME)",
        *(
            ["--backend=simulated", f"--sim-gpus={agent.simulated_gpus}"]
            if agent.simulated_gpus
            else ["--backend=nvml"]
        ),
        f"--nri-socket={agent.nri_socket}",
        f"--cri-endpoint=unix://{agent.cri_socket}",
        f"--state-dir={STATE_DIR}",
        f"--proc-root={PROC_ROOT}",
        f"--cgroup-root={CGROUP_ROOT}",
        f"--health-port={agent.health_port}",
        f"--metrics-port={agent.metrics_port}",
        "--fail-open" if agent.fail_open else "--fail-closed",
        "--mps" if agent.mps_enabled else "--no-mps",
    ]
    if not agent.taint:
        args.append("--no-taint")
    if agent.mps_enabled and agent.mps_control_bin:
        args.append(f"--mps-control-bin={agent.mps_control_bin}")
    if agent.mps_enabled and agent.mps_time_slicing_clients:
        args.append("--mps-time-slicing-clients")
    if agent.gpu_toolkit_version:
        args.append(f"--gpu-toolkit-version={agent.gpu_toolkit_version}")
    if agent.gpu_device_plugin_version:
        args.append(f"--gpu-device-plugin-version={agent.gpu_device_plugin_version}")
    if agent.allow_unsupported_gpu_stack:
        args.append("--allow-unsupported-gpu-stack")
    if agent.dra_enabled:
        args += ["--dra", f"--kubelet-dir={KUBELET_DIR}", f"--cdi-dir={CDI_DIR}"]
    args += [f"--log-level={agent.log_level}", "--log-format=json"]
    return args


def required_nri_plugins(config: ConfigSpec) -> tuple[str, ...]:
    """The NRI plugins this DaemonSet puts on every node, which the webhook's ``--required-nri-plugin``
    must name (the chart derives its flags from the same ``nodeAgent.validator.enabled``): the agent, and
    its validator when it runs. Naming a plugin the node does not run refuses every GPU container there."""
    if config.agent.validator_enabled:
        return (keys.NRI_PLUGIN_NAME, keys.NRI_VALIDATOR_PLUGIN_NAME)
    return (keys.NRI_PLUGIN_NAME,)


def validator_args(config: ConfigSpec) -> list[str]:
    """The ``gpufrac node-agent-validator`` arguments: the agent's NRI socket and failure policy."""
    agent = config.agent
    return [
        "node-agent-validator",
        f"--nri-socket={agent.nri_socket}",
        f"--health-port={VALIDATOR_HEALTH_PORT}",
        "--fail-open" if agent.fail_open else "--fail-closed",
        f"--log-level={agent.log_level}",
        "--log-format=json",
    ]


Volume = dict[str, Any]
Mount = dict[str, Any]


def _host_dir(
    name: str, path: str, *, mount_at: str | None = None, read_only: bool = False
) -> tuple[Volume, Mount]:
    volume: Volume = {"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    mount: dict[str, Any] = {"name": name, "mountPath": mount_at or path}
    if read_only:
        volume["hostPath"]["type"] = "Directory"
        mount["readOnly"] = True
    return volume, mount


def _mounts(config: ConfigSpec) -> tuple[list[Volume], list[Mount]]:
    nri_dir = config.agent.nri_socket.rsplit("/", 1)[0] or "/"
    cri_dir = config.agent.cri_socket.rsplit("/", 1)[0] or "/"
    pairs = [
        _host_dir("nri", nri_dir),
        _host_dir("mps-pipes", MPS_PIPE_DIR),
        _host_dir("state", STATE_DIR),
        _host_dir("host-proc", "/proc", mount_at=PROC_ROOT, read_only=True),
        # The host's cgroups at the same path: the driver's per-cgroup memory limit is keyed by the host
        # path of each container's cgroup, and the canary makes a throwaway cgroup there.
        _host_dir("cgroup", CGROUP_ROOT),
    ]
    # Both sockets in one directory (containerd's NRI socket under /run/containerd): one mount, as the
    # API server refuses two volumes at one mountPath.
    if cri_dir != nri_dir:
        pairs.append(_host_dir("containerd", cri_dir))
    if config.agent.mps_enabled:
        pairs.append(_host_dir("mps-logs", MPS_LOG_DIR))
    if config.agent.dra_enabled:  # the kubelet dials the paths the agent names: same path inside and out
        pairs += [
            _host_dir("plugins-registry", f"{KUBELET_DIR}/plugins_registry"),
            _host_dir("dra-plugin", f"{KUBELET_DIR}/plugins/{keys.DRA_DRIVER_NAME}"),
            _host_dir("cdi", CDI_DIR),
        ]
    return [v for v, _ in pairs], [m for _, m in pairs]


def _probe(path: str, *, period: int, failures: int, port: str = "health") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _startup_probe(port: str = "health") -> dict[str, Any]:
    """/healthz while the process starts (imports, the first inventory read): up to 60 s before the
    liveness probe's 10 s applies, so a slow start on a loaded node is not a crash loop."""
    return _probe("/healthz", period=2, failures=30, port=port)


def gpu_client_affinity() -> dict[str, Any]:
    """Required node affinity: the GPU Operator's client label is ``true``, or it is not there at all.

    Node selector terms are ORed, so a cluster without the GPU Operator (no label) still runs the agent.
    """
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": DEPLOY_CLIENT_LABEL, "operator": "DoesNotExist"}]},
                    {
                        "matchExpressions": [
                            {"key": DEPLOY_CLIENT_LABEL, "operator": "In", "values": [DEPLOY_CLIENT_ALLOWED]}
                        ]
                    },
                ]
            }
        }
    }


def render_daemonset(config: ConfigSpec, *, gpus_per_node: int = GPU_COUNT_STEP) -> dict[str, Any]:
    """The complete DaemonSet manifest (apps/v1) for ``config``, owned by the config; ``gpus_per_node``
    (``sized_gpu_count``) sizes the agent's memory when the spec does not give ``resources``."""
    agent = config.agent
    labels = {
        **selector_labels(config.name),
        "app.kubernetes.io/instance": config.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/part-of": "gpufrac",
    }
    volumes, mounts = _mounts(config)
    container: dict[str, Any] = {
        "name": "node-agent",
        "image": agent.image,
        "imagePullPolicy": agent.image_pull_policy,
        "command": ["gpufrac"],
        "args": agent_args(config),
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            # The NVIDIA container toolkit gives a privileged container every GPU and, for these
            # capabilities, the driver's NVML (utility) and the MPS binaries (compute).
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {
                "name": "NVIDIA_DRIVER_CAPABILITIES",
                "value": "utility,compute" if agent.mps_enabled else "utility",
            },
        ],
        # Root as well as privileged: the image's user is 65532, and the agent creates its state and MPS
        # directories on host paths the kubelet made root's, and connects to root's NRI and CRI sockets.
        "securityContext": {"privileged": True, "runAsUser": 0},
        "ports": [
            {"name": "health", "containerPort": agent.health_port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": agent.metrics_port, "protocol": "TCP"},
        ],
        # A hung agent is restarted within ~10 s (module docstring), once it has started.
        "startupProbe": _startup_probe(),
        "livenessProbe": _probe("/healthz", period=5, failures=2),
        # NRI synchronized and the Node published: the runtime's path has the plugin in it.
        "readinessProbe": _probe("/readyz", period=5, failures=1),
        "volumeMounts": mounts,
    }
    container["resources"] = agent.resources or agent_resources(gpus=gpus_per_node, mps=agent.mps_enabled)
    nri_mount = next(m for m in mounts if m["name"] == "nri")
    validator: dict[str, Any] = {
        "name": "node-agent-validator",
        "image": agent.image,
        "imagePullPolicy": agent.image_pull_policy,
        "command": ["gpufrac"],
        "args": validator_args(config),
        # Root for the runtime's root-owned NRI socket (the owner's bits, no capability needed); nothing else.
        "securityContext": {
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "ports": [{"name": VALIDATOR_PORT_NAME, "containerPort": VALIDATOR_HEALTH_PORT, "protocol": "TCP"}],
        "startupProbe": _startup_probe(VALIDATOR_PORT_NAME),
        "livenessProbe": _probe("/healthz", period=5, failures=2, port=VALIDATOR_PORT_NAME),
        "readinessProbe": _probe("/readyz", period=5, failures=1, port=VALIDATOR_PORT_NAME),
        # Nothing writable: the gpufrac command asks for a temporary directory only in the subcommand
        # that needs one (the webhook's generated certificate), never to load.
        "volumeMounts": [nri_mount],
        "resources": VALIDATOR_RESOURCES,
    }
    template = {
        "metadata": {"labels": labels},
        "spec": {
            "serviceAccountName": SERVICE_ACCOUNT,
            "hostPID": True,
            "nodeSelector": dict(agent.node_selector),
            "affinity": gpu_client_affinity(),
            "tolerations": [managed_toleration(), *(dict(t) for t in agent.tolerations)],
            # SIGTERM sets the Node's condition False and leaves the runtime's path; give it the time.
            "terminationGracePeriodSeconds": 30,
            "containers": [container, validator] if agent.validator_enabled else [container],
            "volumes": volumes,
        },
    }
    if agent.runtime_class_name:
        template["spec"]["runtimeClassName"] = agent.runtime_class_name
    manifest: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": daemonset_name(config.name),
            "namespace": config.namespace,
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": config.name,
                    "uid": config.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(config.name)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": template,
        },
    }
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    manifest["metadata"]["annotations"] = {HASH_ANNOTATION: digest}
    return manifest
