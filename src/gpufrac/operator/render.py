"""The node agent's DaemonSet for one GpuFractioningConfig, as a pure function of the config.

Pure so that what the cluster gets is unit-tested line by line and the reconciler only compares and
applies. The pod follows docs/node-agent.md:

- privileged and hostPID: the agent reads every GPU process's cgroup through the host's /proc (mounted
  read-only at ``/host/proc``, the agent's ``--proc-root``) and supervises MPS for the whole node;
- the NRI socket's directory, so the runtime calls the agent at CreateContainer;
- ``/run/nvidia/mps`` (the MPS pipe directory) and the state directory at the SAME paths as on the host:
  the agent answers the runtime with host paths to bind into containers, so its view must equal the host's;
- the CRI socket's directory (containerd's run directory by default), for the audit (without it the agent
  only reports usage);
- the toleration of the managed taint, which the agent itself puts on its node: without it a restarted
  agent could never come back to the node it manages;
- ``NVIDIA_VISIBLE_DEVICES=all`` with the utility capability (and compute with MPS), so the NVIDIA
  container toolkit mounts NVML and the MPS binaries into the privileged agent (``runtimeClassName``
  where the NVIDIA runtime is not the node's default).

The rendered manifest carries a hash of itself in an annotation; the reconciler applies only when the
hash on the cluster differs, so a Node heartbeat never turns into a write.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gpufrac.contract.keys import managed_toleration
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
MAX_NAME = 63


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
        f"--health-port={agent.health_port}",
        f"--metrics-port={agent.metrics_port}",
        "--fail-open" if agent.fail_open else "--fail-closed",
        "--mps" if agent.mps_enabled else "--no-mps",
    ]
    if not agent.taint:
        args.append("--no-taint")
    if agent.mps_enabled and agent.mps_control_bin:
        args.append(f"--mps-control-bin={agent.mps_control_bin}")
    args += [f"--log-level={agent.log_level}", "--log-format=json"]
    return args


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
    ]
    # Both sockets in one directory (containerd's NRI socket under /run/containerd): one mount, as the
    # API server refuses two volumes at one mountPath.
    if cri_dir != nri_dir:
        pairs.append(_host_dir("containerd", cri_dir))
    if config.agent.mps_enabled:
        pairs.append(_host_dir("mps-logs", MPS_LOG_DIR))
    return [v for v, _ in pairs], [m for _, m in pairs]


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "health"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def render_daemonset(config: ConfigSpec) -> dict[str, Any]:
    """The complete DaemonSet manifest (apps/v1) for ``config``, owned by the config."""
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
        "livenessProbe": _probe("/healthz", period=10, failures=3),
        # NRI synchronized and the Node published: the runtime's path has the plugin in it.
        "readinessProbe": _probe("/readyz", period=5, failures=1),
        "volumeMounts": mounts,
    }
    if agent.resources:
        container["resources"] = agent.resources
    template = {
        "metadata": {"labels": labels},
        "spec": {
            "serviceAccountName": SERVICE_ACCOUNT,
            "hostPID": True,
            "nodeSelector": dict(agent.node_selector),
            "tolerations": [managed_toleration(), *(dict(t) for t in agent.tolerations)],
            # SIGTERM sets the Node's condition False and leaves the runtime's path; give it the time.
            "terminationGracePeriodSeconds": 30,
            "containers": [container],
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
