"""What a GpuFractioningConfig turns into: the node agent's DaemonSet, checked field by field."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.models.meta_v1 import ObjectMeta

from gpufrac.contract.gpu_operator import DEPLOY_CLIENT_LABEL
from gpufrac.contract.keys import MANAGED_TAINT_KEY
from gpufrac.operator.render import daemonset_name, render_daemonset, required_nri_plugins, sized_gpu_count
from gpufrac.operator.resource import GpuFractioningConfig, read_config
from gpufrac.placement.model import NodeSelectorRequirement, NodeSelectorTerm, SelectorOperator


def config(**agent: Any) -> Any:
    spec: dict[str, Any] = {"nodeAgent": {"image": "registry.example/gpufrac:1.2", **agent}}
    return GpuFractioningConfig(metadata=ObjectMeta(name="prod", uid="uid-1", generation=3), spec=spec)


def render(**agent: Any) -> dict[str, Any]:
    return render_daemonset(read_config(config(**agent)))


def container(ds: dict[str, Any], name: str = "node-agent") -> dict[str, Any]:
    (found,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def validator(ds: dict[str, Any]) -> dict[str, Any]:
    return container(ds, "node-agent-validator")


def mounts(ds: dict[str, Any]) -> dict[str, tuple[str, str, bool]]:
    """mountPath -> (volume, host path, read-only)."""
    volumes = {
        v["name"]: v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v
    }
    return {
        m["mountPath"]: (m["name"], volumes[m["name"]], m.get("readOnly", False))
        for m in container(ds)["volumeMounts"]
    }


def test_the_agent_runs_privileged_in_the_host_pid_namespace_under_its_service_account() -> None:
    ds = render()
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["serviceAccountName"] == "gpufrac-node-agent"
    # As root: the image runs as 65532, which can neither write the host-path state directory nor connect
    # to the runtime's sockets (the real install's agent failed with Permission denied).
    assert container(ds)["securityContext"] == {"privileged": True, "runAsUser": 0}
    assert container(ds)["image"] == "registry.example/gpufrac:1.2"
    assert container(ds)["imagePullPolicy"] == "IfNotPresent"
    assert ds["metadata"] == ds["metadata"] | {
        "name": "gpufrac-node-agent-prod",
        "namespace": "gpufrac-system",
    }


def test_host_paths_are_mounted_where_the_agent_expects_them() -> None:
    ds = render(nriSocket="/run/containerd/nri/nri.sock")
    got = mounts(ds)
    assert got["/run/containerd/nri"] == ("nri", "/run/containerd/nri", False)
    assert got["/run/nvidia/mps"][1:] == ("/run/nvidia/mps", False)
    # The agent hands host paths under its state dir to the runtime: same path inside and out.
    assert got["/run/gpufrac/node-agent"][1:] == ("/run/gpufrac/node-agent", False)
    # The host's /proc, read-only, at the agent's --proc-root.
    assert got["/host/proc"] == ("host-proc", "/proc", True)
    args = container(ds)["args"]
    assert "--proc-root=/host/proc" in args
    assert "--nri-socket=/run/containerd/nri/nri.sock" in args
    assert "--state-dir=/run/gpufrac/node-agent" in args


def test_args_follow_the_spec() -> None:
    default = container(render())["args"]
    assert default[:3] == ["node-agent", "--node-name=$(NODE_NAME)", "--backend=nvml"]
    assert {
        "--fail-closed",
        "--no-mps",
        "--metrics-port=9400",
        "--health-port=8082",
        "--log-level=info",
    } <= set(default)
    assert not any(a.startswith("--mps-control-bin") for a in default)

    custom = container(
        render(
            failOpen=True,
            mps={"enabled": True, "controlBin": "/opt/mps-control"},
            metricsPort=9500,
            logLevel="debug",
        )
    )["args"]
    assert {"--fail-open", "--mps", "--mps-control-bin=/opt/mps-control", "--metrics-port=9500"} <= set(
        custom
    )
    assert "--log-level=debug" in custom
    assert "--fail-closed" not in custom and "--no-mps" not in custom


def test_mps_gets_its_log_directory_only_when_enabled() -> None:
    assert "/var/log/nvidia-mps" not in mounts(render())
    assert "/var/log/nvidia-mps" in mounts(render(mps={"enabled": True}))


def test_node_name_comes_from_the_downward_api() -> None:
    env = container(render())["env"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in env


def test_probes_hit_the_agents_health_port() -> None:
    c = container(render(healthPort=9100))
    assert {"name": "health", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert "--health-port=9100" in c["args"]


def test_a_hung_agent_is_restarted_within_ten_seconds() -> None:
    """A loop that cannot answer in 2 s cannot answer the runtime's 2 s budget either: two such misses,
    5 s apart, restart it."""
    probe = container(render())["livenessProbe"]
    assert (probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]) == (5, 2, 2)
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 10
    # ...once started: a slow start on a loaded node gets a minute, not a crash loop.
    startup = container(render())["startupProbe"]
    assert startup["httpGet"] == probe["httpGet"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 60


def test_the_validator_is_left_out_when_disabled_and_the_required_plugins_follow() -> None:
    """What the webhook must require is what the DaemonSet runs: naming the validator where none runs
    would refuse every GPU container; leaving it out where it runs lets one start while it is away."""
    assert [c["name"] for c in render()["spec"]["template"]["spec"]["containers"]] == [
        "node-agent",
        "node-agent-validator",
    ]
    assert required_nri_plugins(read_config(config())) == ("gpufrac", "gpufrac-validator")
    off = render(validator={"enabled": False})
    assert [c["name"] for c in off["spec"]["template"]["spec"]["containers"]] == ["node-agent"]
    assert required_nri_plugins(read_config(config(validator={"enabled": False}))) == ("gpufrac",)


def test_the_validator_runs_beside_the_agent_with_the_nri_socket_only() -> None:
    ds = render(nriSocket="/run/containerd/nri/nri.sock", failOpen=True, logLevel="debug")
    v, agent = validator(ds), container(ds)
    assert v["image"] == agent["image"] and v["command"] == ["gpufrac"]
    assert v["args"][0] == "node-agent-validator"
    assert {"--nri-socket=/run/containerd/nri/nri.sock", "--fail-open", "--log-level=debug"} <= set(v["args"])
    assert "--fail-closed" in validator(render())["args"]
    # The runtime's socket directory and nothing else of the host; not privileged, no capability; a
    # read-only root and nothing writable (the command loads without a temporary directory).
    assert v["volumeMounts"] == [{"name": "nri", "mountPath": "/run/containerd/nri"}]
    assert v["securityContext"]["readOnlyRootFilesystem"] is True
    assert "privileged" not in v["securityContext"]
    assert v["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert v["securityContext"]["allowPrivilegeEscalation"] is False
    # Its own probes, on a port the agent's defaults do not use.
    (port,) = v["ports"]
    assert port["containerPort"] not in {p["containerPort"] for p in agent["ports"]}
    assert v["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert v["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert v["startupProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert f"--health-port={port['containerPort']}" in v["args"]
    assert v["resources"]["limits"]["memory"] == v["resources"]["requests"]["memory"]


def test_the_managed_taint_is_always_tolerated_and_the_spec_adds_to_it() -> None:
    extra = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    tolerations = render(tolerations=[extra])["spec"]["template"]["spec"]["tolerations"]
    assert tolerations[0]["key"] == MANAGED_TAINT_KEY and tolerations[0]["operator"] == "Exists"
    assert extra in tolerations
    assert render()["spec"]["template"]["spec"]["tolerations"][0]["key"] == MANAGED_TAINT_KEY


def test_node_selector_defaults_to_gpu_nodes_and_follows_the_spec() -> None:
    assert render()["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert render(nodeSelector={"pool": "a100"})["spec"]["template"]["spec"]["nodeSelector"] == {
        "pool": "a100"
    }


def test_resources_are_passed_through_and_otherwise_sized_from_the_gpu_count() -> None:
    asked = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    assert container(render(resources=asked))["resources"] == asked
    # Not asked: sized for 8 GPUs (one step) — 256 MiB of agent, 16 per GPU, and 50 per GPU's MPS server.
    assert container(render())["resources"]["limits"] == {"memory": f"{256 + 8 * 16}Mi"}
    with_mps = render_daemonset(read_config(config(mps={"enabled": True})), gpus_per_node=16)
    assert container(with_mps)["resources"] == {
        "requests": {"cpu": "100m", "memory": f"{256 + 16 * 66}Mi"},
        "limits": {"memory": f"{256 + 16 * 66}Mi"},
    }
    # A 6-GPU node's agent with MPS gets more than the 256Mi that failed NVIDIA's daemon on > 5 GPUs.
    assert sized_gpu_count([6, 2]) == 8 and sized_gpu_count([9]) == 16 and sized_gpu_count([]) == 8


def test_the_config_owns_its_daemonset() -> None:
    (owner,) = render()["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "gpufrac.io/v1alpha1",
        "kind": "GpuFractioningConfig",
        "name": "prod",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_the_selector_matches_the_pods_it_creates() -> None:
    ds = render()
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_the_hash_changes_with_the_spec_and_only_with_it() -> None:
    def digest(ds: dict[str, Any]) -> str:
        return str(ds["metadata"]["annotations"]["gpufrac.io/rendered-hash"])

    assert digest(render()) == digest(render())
    assert digest(render()) != digest(render(logLevel="debug"))
    assert digest(render()) != digest(render(image="registry.example/gpufrac:1.3"))


@pytest.mark.parametrize("name", ["a", "x" * 44])
def test_daemonset_names_are_dns_labels(name: str) -> None:
    assert len(daemonset_name(name)) <= 63


def test_a_spec_without_an_image_is_refused() -> None:
    obj = GpuFractioningConfig(metadata=ObjectMeta(name="x"), spec={"nodeAgent": {}})
    with pytest.raises(ValueError, match="image"):
        read_config(obj)


def test_the_toolkit_is_asked_for_nvml_and_with_mps_for_the_mps_binaries() -> None:
    def env(ds: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e["value"] for e in container(ds)["env"] if "value" in e}

    assert env(render()) == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}
    assert env(render(mps={"enabled": True}))["NVIDIA_DRIVER_CAPABILITIES"] == "utility,compute"


def test_runtime_class_only_when_asked() -> None:
    assert "runtimeClassName" not in render()["spec"]["template"]["spec"]
    assert render(runtimeClassName="nvidia")["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_the_gpu_stack_gate_and_its_escape_hatch_reach_the_agent() -> None:
    assert not any(a.startswith(("--gpu-", "--allow-unsupported")) for a in container(render())["args"])
    args = container(
        render(
            gpuStack={"toolkitVersion": "1.20.1", "devicePluginVersion": "0.20.1", "allowUnsupported": True},
            mps={"enabled": True, "timeSlicingClients": True},
        )
    )["args"]
    assert {
        "--gpu-toolkit-version=1.20.1",
        "--gpu-device-plugin-version=0.20.1",
        "--allow-unsupported-gpu-stack",
        "--mps-time-slicing-clients",
    } <= set(args)


@pytest.mark.parametrize(
    ("labels", "runs"),
    [
        ({}, True),  # no GPU Operator on the node
        ({DEPLOY_CLIENT_LABEL: "true"}, True),
        ({DEPLOY_CLIENT_LABEL: "false"}, False),  # the GPU Operator evicts its clients to unload the driver
        ({DEPLOY_CLIENT_LABEL: "paused-for-driver-upgrade"}, False),
    ],
)
def test_the_agent_runs_only_where_the_gpu_operator_lets_gpu_clients_run(
    labels: dict[str, str], runs: bool
) -> None:
    """Judged by the scheduler's own node-affinity semantics (terms ORed, expressions ANDed)."""
    required = render()["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    terms = [
        NodeSelectorTerm(
            match_expressions=tuple(
                NodeSelectorRequirement(
                    key=e["key"], operator=SelectorOperator(e["operator"]), values=tuple(e.get("values", ()))
                )
                for e in term["matchExpressions"]
            )
        )
        for term in required["nodeSelectorTerms"]
    ]
    assert any(t.matches(labels) for t in terms) is runs


def test_dra_adds_the_driver_flags_and_the_kubelet_and_cdi_paths_only_when_enabled() -> None:
    plain = render()
    assert "--dra" not in container(plain)["args"]
    assert "/var/run/cdi" not in mounts(plain)
    ds = render(dra={"enabled": True})
    assert {"--dra", "--kubelet-dir=/var/lib/kubelet", "--cdi-dir=/var/run/cdi"} <= set(container(ds)["args"])
    got = mounts(ds)
    # The kubelet dials the socket paths the agent reports, and the runtime reads the specs it writes:
    # each is mounted at its host path, and of the kubelet's plugins only the driver's own directory.
    assert got["/var/lib/kubelet/plugins_registry"][1:] == ("/var/lib/kubelet/plugins_registry", False)
    assert got["/var/lib/kubelet/plugins/gpu.gpufrac.io"][1:] == (
        "/var/lib/kubelet/plugins/gpu.gpufrac.io",
        False,
    )
    assert got["/var/run/cdi"][1:] == ("/var/run/cdi", False)


def test_simulated_gpus_switch_the_agent_to_its_simulated_backend() -> None:
    """A test cluster without GPUs (tests/install/): the agent reports the spec's simulated GPUs instead of
    reading NVML, which does not exist there."""
    args = container(render(simulatedGpus="4xH100-80GB:81559"))["args"]
    assert "--backend=simulated" in args and "--sim-gpus=4xH100-80GB:81559" in args
    assert "--backend=nvml" not in args
    assert "--backend=nvml" in container(render())["args"]


def test_the_cri_socket_is_named_and_its_directory_mounted() -> None:
    """The audit reads containers through the runtime's CRI socket: the default is containerd's, and a
    runtime elsewhere (k3s: /run/k3s/containerd) is reached at the path the spec names."""
    default = render()
    assert "--cri-endpoint=unix:///run/containerd/containerd.sock" in container(default)["args"]
    assert mounts(default)["/run/containerd"] == ("containerd", "/run/containerd", False)
    k3s = render(criSocket="/run/k3s/containerd/containerd.sock")
    assert "--cri-endpoint=unix:///run/k3s/containerd/containerd.sock" in container(k3s)["args"]
    assert mounts(k3s)["/run/k3s/containerd"] == ("containerd", "/run/k3s/containerd", False)


def test_sockets_in_one_directory_are_mounted_once() -> None:
    """containerd's NRI socket next to its CRI socket: one volume, since the API server refuses a pod
    with two mounts at the same path (the DaemonSet would never be created)."""
    ds = render(nriSocket="/run/containerd/nri.sock", criSocket="/run/containerd/containerd.sock")
    paths = [m["mountPath"] for m in container(ds)["volumeMounts"]]
    assert paths.count("/run/containerd") == 1 and len(paths) == len(set(paths))
    assert "--cri-endpoint=unix:///run/containerd/containerd.sock" in container(ds)["args"]
