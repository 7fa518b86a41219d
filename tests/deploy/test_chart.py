"""The Helm chart without a cluster: lint, what each switch renders, the scheduler's configuration, the
webhooks against gpufrac.admission.configuration (the single source of truth), the generated TLS."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import padding
from helm_chart import CHART, CRD, helm, kinds, one, render

from gpufrac.admission.command import admission
from gpufrac.admission.configuration import ServiceRef, webhook_configurations
from gpufrac.contract import keys
from gpufrac.scheduler.config import SchedulerConfig

NS = "gpufrac-system"
COMPONENTS = {
    "scheduler": {("Deployment", "gpufrac-scheduler"), ("ServiceAccount", "gpufrac-scheduler")},
    "admission": {("Deployment", "gpufrac-admission"), ("Service", "gpufrac-admission")},
    "operator": {("Deployment", "gpufrac-operator"), ("GpuFractioningConfig", "default")},
}


def test_helm_lint_passes() -> None:
    done = helm("lint", CHART, "--strict", "--namespace", NS)
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def test_defaults_render_every_component(tmp_path: Path) -> None:
    objects = render(tmp_path=tmp_path)
    found = kinds(objects)
    for component, expected in COMPONENTS.items():
        assert expected <= found, f"{component}: missing {expected - found}"
    assert ("ServiceAccount", "gpufrac-node-agent") in found
    assert {("MutatingWebhookConfiguration", "gpufrac-gpufrac-admission")} <= found
    for obj in objects:
        if obj["kind"] in ("Deployment", "ServiceAccount", "Service", "Secret", "ConfigMap"):
            assert obj["metadata"]["namespace"] == NS, obj["metadata"]["name"]
        if obj["kind"] in ("Role", "RoleBinding"):  # the node Leases' namespace is the only other one
            assert obj["metadata"]["namespace"] in (NS, keys.NODE_LEASE_NAMESPACE), obj["metadata"]["name"]
    # One image, one entry point: every container runs `gpufrac <component>`.
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "ghcr.io/gpufrac/gpufrac:0.1.0"
        assert container["args"][0] == deployment["metadata"]["name"].removeprefix("gpufrac-")
    assert one(objects, "Deployment", "gpufrac-scheduler")["spec"]["replicas"] == 2
    assert one(objects, "Deployment", "gpufrac-admission")["spec"]["replicas"] == 2


def test_the_master_switch_renders_nothing(tmp_path: Path) -> None:
    assert render({"enabled": False}, tmp_path=tmp_path) == []


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_each_switch_removes_its_component_only(tmp_path: Path, component: str) -> None:
    found = kinds(render({component: {"enabled": False}}, tmp_path=tmp_path))
    assert not COMPONENTS[component] & found
    for other, expected in COMPONENTS.items():
        if other != component:
            assert expected <= found, f"switching off {component} lost {other}"


def test_crds_come_from_deploy_crds(tmp_path: Path) -> None:
    """The chart's crds/ is deploy/crds (a symlink Helm follows): one source for the CRD."""
    assert (CHART / "crds").resolve() == CRD.parent
    done = helm("show", "crds", CHART)
    crds = sorted(
        (doc for doc in yaml.safe_load_all(done.stdout) if doc), key=lambda d: d["metadata"]["name"]
    )
    expected = sorted(
        (yaml.safe_load(f.read_text()) for f in CRD.parent.glob("*.yaml")),
        key=lambda d: d["metadata"]["name"],
    )
    assert [c["metadata"]["name"] for c in crds] == ["gpufractioningconfigs.gpufrac.io", "queues.gpufrac.io"]
    assert crds == expected
    # A packaged chart carries the files themselves, not the link.
    helm("package", CHART, "--destination", tmp_path)
    (archive,) = tmp_path.glob("gpufrac-*.tgz")
    packaged = helm("show", "crds", archive)
    assert (
        sorted(
            (doc for doc in yaml.safe_load_all(packaged.stdout) if doc), key=lambda d: d["metadata"]["name"]
        )
        == crds
    )


def test_scheduler_config_is_valid_and_leases_stay_in_the_release_namespace(tmp_path: Path) -> None:
    values = {"scheduler": {"config": {"policy": "binpack", "leader_election": {"lease_namespace": "x"}}}}
    objects = render(values, tmp_path=tmp_path, namespace="gpu-ops")
    configmap = one(objects, "ConfigMap", "gpufrac-scheduler")
    config = SchedulerConfig.model_validate(yaml.safe_load(configmap["data"]["scheduler.yaml"]))
    assert config.policy == "binpack"
    assert config.leader_election.enabled
    assert config.leader_election.lease_namespace == "gpu-ops"
    assert config.http_port == 10259
    container = one(objects, "Deployment", "gpufrac-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert "--config=/etc/gpufrac/scheduler.yaml" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == config.http_port


def _expected_webhooks(namespace: str, ca_bundle: bytes) -> dict[str, dict[str, Any]]:
    mutating, validating = webhook_configurations(
        name="unused", ca_bundle=ca_bundle, service=ServiceRef(namespace=namespace, name="gpufrac-admission")
    )
    return {w["name"]: w for w in [*mutating["webhooks"], *validating["webhooks"]]}


@pytest.mark.parametrize("namespace", ["gpufrac-system", "other"])
def test_webhooks_match_the_python_configuration(tmp_path: Path, namespace: str) -> None:
    """Rules, matchConditions, failurePolicy and the rest equal what webhook_configurations returns for
    the chart's Service; a difference means: run scripts/gen-chart-webhooks."""
    objects = render(tmp_path=tmp_path, namespace=namespace)
    mutating = one(objects, "MutatingWebhookConfiguration")
    validating = one(objects, "ValidatingWebhookConfiguration")
    rendered = {w["name"]: w for w in [*mutating["webhooks"], *validating["webhooks"]]}
    ca = base64.b64decode(rendered["mutate.gpufrac.io"]["clientConfig"]["caBundle"])
    expected = _expected_webhooks(namespace, ca)
    assert [w["name"] for w in mutating["webhooks"]] == ["mutate.gpufrac.io"]
    assert [w["name"] for w in validating["webhooks"]] == [
        "validate.gpufrac.io",
        "validate-binding.gpufrac.io",
    ]
    for name, webhook in expected.items():
        assert rendered[name] == webhook, f"{name} differs from gpufrac.admission.configuration"


def test_admission_trusts_only_the_chart_scheduler(tmp_path: Path) -> None:
    objects = render(
        {"admission": {"extraSchedulerUsers": ["alice"]}}, tmp_path=tmp_path, namespace="gpu-ops"
    )
    args = one(objects, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    users = [a.removeprefix("--scheduler-user=") for a in args if a.startswith("--scheduler-user=")]
    assert users == ["system:serviceaccount:gpu-ops:gpufrac-scheduler", "alice"]
    assert "--tls-cert=/etc/gpufrac/tls/tls.crt" in args and "--tls-key=/etc/gpufrac/tls/tls.key" in args


def test_generated_certificate_is_signed_by_the_webhooks_ca_for_the_service(tmp_path: Path) -> None:
    objects = render(tmp_path=tmp_path, namespace="gpu-ops")
    secret = one(objects, "Secret", "gpufrac-admission-tls")
    ca_pem = base64.b64decode(secret["data"]["ca.crt"])
    bundle = one(objects, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(bundle) == ca_pem
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    ca.public_key().verify(  # raises unless the CA signed it
        cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm
    )
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert "gpufrac-admission.gpu-ops.svc" in names


def test_the_admission_webhook_keeps_a_replica_through_drains_and_node_pressure(tmp_path: Path) -> None:
    """failurePolicy Fail makes the webhook part of the control plane for GPU pods: a drain must not take
    every replica at once, and node pressure must not evict it first."""
    objects = render(tmp_path=tmp_path)
    deployment = one(objects, "Deployment", "gpufrac-admission")
    pod_spec = deployment["spec"]["template"]
    assert pod_spec["spec"]["priorityClassName"] == "system-cluster-critical"
    budget = one(objects, "PodDisruptionBudget", "gpufrac-admission")
    assert budget["metadata"]["namespace"] == NS
    assert budget["spec"]["minAvailable"] == 1
    selected = budget["spec"]["selector"]["matchLabels"]
    assert selected == deployment["spec"]["selector"]["matchLabels"]
    assert selected.items() <= pod_spec["metadata"]["labels"].items()

    own_class = render({"admission": {"priorityClassName": "gpu-control"}}, tmp_path=tmp_path)
    assert one(own_class, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"][
        "priorityClassName"
    ] == ("gpu-control")
    no_class = render({"admission": {"priorityClassName": ""}}, tmp_path=tmp_path)
    assert (
        "priorityClassName"
        not in one(no_class, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"]
    )
    # One replica: a budget of one would block every drain of its node, so none is rendered.
    single = kinds(render({"admission": {"replicas": 1}}, tmp_path=tmp_path))
    assert ("PodDisruptionBudget", "gpufrac-admission") not in single
    assert ("PodDisruptionBudget", "gpufrac-admission") not in kinds(
        render({"admission": {"podDisruptionBudget": {"enabled": False}}}, tmp_path=tmp_path)
    )


def test_the_node_leases_namespace_is_the_one_the_components_use(tmp_path: Path) -> None:
    """The chart cannot import the contract: this is where its literal is held to it."""
    objects = render(tmp_path=tmp_path)
    assert one(objects, "Namespace")["metadata"]["name"] == keys.NODE_LEASE_NAMESPACE
    agent = one(objects, "Role", "gpufrac-gpufrac-node-agent")
    assert agent["metadata"]["namespace"] == keys.NODE_LEASE_NAMESPACE
    assert agent["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]
    assert SchedulerConfig().node_lease_namespace == keys.NODE_LEASE_NAMESPACE


def test_the_admission_webhook_gets_its_connection_cap_and_idle_timeout(tmp_path: Path) -> None:
    cli = typer.Typer()
    cli.command()(admission)
    command = typer.main.get_command(cli)
    for values, cap, idle in [({}, 256, 10.0), ({"maxConnections": 64, "idleTimeoutSeconds": 2.5}, 64, 2.5)]:
        objects = render({"admission": values}, tmp_path=tmp_path)
        pod = one(objects, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[0] == "admission"
        params = command.make_context("admission", args[1:]).params  # the CLI accepts what the chart passes
        assert (params["max_connections"], params["idle_timeout"]) == (cap, idle)


@pytest.mark.parametrize("validator", [True, False], ids=["validator", "no validator"])
def test_the_webhook_requires_the_nri_plugins_the_operator_runs(tmp_path: Path, validator: bool) -> None:
    """One switch, operator.config.spec.nodeAgent.validator.enabled, decides both what the operator puts
    on each node and what the webhook requires of GPU containers (``--required-nri-plugin``); without the
    chart's operator the chart cannot know that a validator runs and requires the agent alone."""
    from gpufrac.operator.render import render_daemonset, required_nri_plugins
    from gpufrac.operator.resource import GpuFractioningConfig, read_config

    cli = typer.Typer()
    cli.command()(admission)
    command = typer.main.get_command(cli)

    def required(objects: list[dict[str, Any]]) -> tuple[str, ...]:
        args = one(objects, "Deployment", "gpufrac-admission")["spec"]["template"]["spec"]["containers"][0]
        return tuple(command.make_context("admission", args["args"][1:]).params["required_nri_plugin"])

    spec = {"nodeAgent": {"validator": {"enabled": validator}}}
    objects = render({"operator": {"config": {"spec": spec}}}, tmp_path=tmp_path)
    config = one(objects, "GpuFractioningConfig", "default")
    config["metadata"]["uid"] = "uid"
    rendered = read_config(GpuFractioningConfig.from_dict(config))
    containers = [c["name"] for c in render_daemonset(rendered)["spec"]["template"]["spec"]["containers"]]
    assert required(objects) == required_nri_plugins(rendered)
    assert ("node-agent-validator" in containers) is validator
    assert required(objects) == (
        (keys.NRI_PLUGIN_NAME, keys.NRI_VALIDATOR_PLUGIN_NAME) if validator else (keys.NRI_PLUGIN_NAME,)
    )
    without_operator = render({"operator": {"enabled": False}}, tmp_path=tmp_path)
    assert required(without_operator) == (keys.NRI_PLUGIN_NAME,)
