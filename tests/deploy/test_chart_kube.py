"""The chart against the real API server of testenv/: every rendered object is accepted (server-side
dry run, with the CRD installed for real), the ServiceAccounts' RBAC allows what the components do and
no more, and `helm install` itself installs the chart."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from helm_chart import CHART, CRD, helm, one, render

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane

# kind -> (URL prefix of its group/version, plural, namespaced); an unknown kind fails the test.
RESOURCES = {
    "Namespace": ("/api/v1", "namespaces", False),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),
    "Service": ("/api/v1", "services", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets", True),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        False,
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingwebhookconfigurations",
        False,
    ),
    "GpuFractioningConfig": ("/apis/gpufrac.io/v1alpha1", "gpufractioningconfigs", False),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}
# Webhooks installed for real must not reach other tests' pods: no namespace carries this label.
NOWHERE = {"admission": {"namespaceSelector": {"matchLabels": {"gpufrac-test/never": "true"}}}}


def collection(obj: dict[str, Any]) -> str:
    prefix, plural, namespaced = RESOURCES[obj["kind"]]
    if namespaced:
        return f"{prefix}/namespaces/{obj['metadata']['namespace']}/{plural}"
    return f"{prefix}/{plural}"


def create(http: httpx2.Client, obj: dict[str, Any], *, dry_run: bool) -> httpx2.Response:
    params = {"fieldManager": "gpufrac-tests", **({"dryRun": "All"} if dry_run else {})}
    return http.post(collection(obj), json=obj, params=params)


@pytest.fixture(scope="module")
def crd(controlplane: ControlPlane) -> None:
    """The GpuFractioningConfig CRD, applied for real (server-side apply: idempotent) and Established."""
    name = yaml.safe_load(CRD.read_text())["metadata"]["name"]
    url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
    with controlplane.http() as http:
        answer = http.patch(
            url,
            content=CRD.read_bytes(),
            params={"fieldManager": "gpufrac-tests", "force": "true"},
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        assert answer.status_code in (200, 201), answer.text
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conditions = (http.get(url).json().get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            time.sleep(0.2)
    raise AssertionError(f"CRD {name} not Established within 30 s")


def test_every_rendered_object_is_accepted_by_the_api_server(
    controlplane: ControlPlane, crd: None, namespace: str, tmp_path: Path
) -> None:
    release = f"dry-{uuid.uuid4().hex[:6]}"
    values = {"operator": {"config": {"name": f"config-{release}"}}}  # cluster-scoped: a name of its own
    objects = render(values, tmp_path=tmp_path, namespace=namespace, release=release)
    assert {o["kind"] for o in objects} == set(RESOURCES)
    with controlplane.http() as http:
        # The Roles in the node Leases' namespace need it to exist (a dry run of it creates nothing).
        lease_namespace = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": keys.NODE_LEASE_NAMESPACE},
        }
        assert create(http, lease_namespace, dry_run=False).status_code in (201, 409)
        for obj in objects:
            answer = create(http, obj, dry_run=True)
            if obj["kind"] == "Namespace" and answer.status_code == 409:
                continue  # the node Leases' namespace, shared by every release: it exists now
            assert answer.status_code == 201, f"{obj['kind']} {obj['metadata']['name']}: {answer.text}"
        # The dry run is not a formality: an invalid object is refused.
        broken = one(objects, "GpuFractioningConfig")
        broken["spec"]["nodeAgent"]["imagePullPolicy"] = "Sometimes"
        assert create(http, broken, dry_run=True).status_code == 422


def _allowed(http: httpx2.Client, user: str, namespace: str, verb: str, resource: str, **more: str) -> bool:
    group, _, resource = resource.rpartition(":")
    plural, _, subresource = resource.partition("/")
    attributes = {"verb": verb, "resource": plural, "group": group, "namespace": namespace, **more}
    if subresource:
        attributes["subresource"] = subresource
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            "resourceAttributes": attributes,
        },
    }
    answer = http.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", json=review)
    assert answer.status_code == 201, answer.text
    return bool(answer.json()["status"].get("allowed"))


@pytest.fixture
def installed_rbac(controlplane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[str]:
    """The chart's ServiceAccounts, Roles and ClusterRoles (and bindings) created for real in
    ``namespace``; cluster-scoped ones are named after a unique release and removed afterwards."""
    release = f"rbac-{uuid.uuid4().hex[:6]}"
    objects = render(tmp_path=tmp_path, namespace=namespace, release=release)
    rbac = [
        o
        for o in objects
        if o["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    ]
    with controlplane.http() as http:
        lease_namespace = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": keys.NODE_LEASE_NAMESPACE},
        }
        assert create(http, lease_namespace, dry_run=False).status_code in (201, 409)
        for obj in rbac:
            answer = create(http, obj, dry_run=False)
            assert answer.status_code == 201, answer.text
    yield namespace
    with controlplane.http() as http:
        for obj in rbac:
            if obj["kind"].startswith("Cluster"):
                http.delete(f"{collection(obj)}/{obj['metadata']['name']}")


# (verb, resource as [group:]plural[/subresource], namespace or "" for cluster scope)
SCHEDULER_DOES = [
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("get", "pods", "team-a"),
    ("patch", "pods", "team-a"),
    ("create", "pods/binding", "team-a"),
    ("patch", "pods/status", "team-a"),
    ("list", "nodes", ""),
    ("watch", "nodes", ""),
    ("patch", "nodes", ""),  # dynamic MIG layouts: gpufrac.io/gpu-layout only (admission policy)
    # affinity terms' namespaceSelector; bound volumes' node affinity (#19)
    ("list", "namespaces", ""),
    ("watch", "namespaces", ""),
    ("list", "persistentvolumeclaims", ""),
    ("watch", "persistentvolumeclaims", ""),
    ("list", "persistentvolumes", ""),
    ("watch", "persistentvolumes", ""),
    ("create", "events", "team-a"),
    ("patch", "events", "team-a"),
    ("watch", "gpufrac.io:queues", ""),
    ("patch", "gpufrac.io:queues/status", ""),
    ("list", "scheduling.run.ai:queues", ""),
    ("watch", "scheduling.run.ai:queues", ""),
]
SCHEDULER_MUST_NOT = [
    ("update", "gpufrac.io:queues", ""),  # the spec is the administrator's; the scheduler writes status
    ("patch", "scheduling.run.ai:queues/status", ""),  # KAI's queue status is KAI's
    ("delete", "nodes", ""),
    ("patch", "nodes/status", ""),  # the inventory and conditions are the node agent's
    ("delete", "pods", "team-a"),
    ("create", "pods", "team-a"),
    ("update", "pods", "team-a"),
    ("get", "secrets", "team-a"),
    ("patch", "persistentvolumeclaims", "team-a"),
    ("delete", "namespaces", ""),
    ("update", "persistentvolumes", ""),
    ("create", "pods/eviction", "team-a"),
    ("update", "coordination.k8s.io:leases", "team-a"),  # leases only in its own namespace
]


def test_scheduler_rbac_allows_what_it_calls_and_nothing_else(
    controlplane: ControlPlane, installed_rbac: str
) -> None:
    ns = installed_rbac
    user = f"system:serviceaccount:{ns}:gpufrac-scheduler"
    with controlplane.http() as http:
        for verb, resource, where in SCHEDULER_DOES:
            assert _allowed(http, user, where, verb, resource), f"scheduler cannot {verb} {resource}"
        for verb, resource, where in SCHEDULER_MUST_NOT:
            assert not _allowed(http, user, where, verb, resource), f"scheduler may {verb} {resource}"
        for verb in ("get", "create", "update"):
            assert _allowed(http, user, ns, verb, "coordination.k8s.io:leases")
        for verb in ("list", "watch"):  # the node agents' heartbeats
            assert _allowed(http, user, keys.NODE_LEASE_NAMESPACE, verb, "coordination.k8s.io:leases")
        assert not _allowed(http, user, keys.NODE_LEASE_NAMESPACE, "update", "coordination.k8s.io:leases")
    # And as the ServiceAccount itself (impersonated), on real requests.
    with controlplane.http(impersonate=user) as http:
        assert http.get("/api/v1/nodes").status_code == 200
        assert http.get(f"/api/v1/namespaces/{ns}/pods").status_code == 200
        assert http.delete("/api/v1/nodes/no-such-node").status_code == 403
        assert http.get(f"/api/v1/namespaces/{ns}/secrets").status_code == 403


def test_operator_and_node_agent_rbac(controlplane: ControlPlane, installed_rbac: str) -> None:
    ns = installed_rbac
    operator = f"system:serviceaccount:{ns}:gpufrac-operator"
    agent = f"system:serviceaccount:{ns}:gpufrac-node-agent"
    with controlplane.http() as http:
        assert _allowed(http, operator, "", "watch", "gpufrac.io:gpufractioningconfigs")
        assert _allowed(http, operator, "", "patch", "gpufrac.io:gpufractioningconfigs/status")
        assert _allowed(http, operator, "", "update", "gpufrac.io:gpufractioningconfigs/finalizers")
        assert not _allowed(http, operator, "", "update", "gpufrac.io:gpufractioningconfigs")
        for verb in ("get", "create", "patch", "delete"):
            assert _allowed(http, operator, ns, verb, "apps:daemonsets")
        assert _allowed(http, operator, "", "watch", "apps:daemonsets")  # its informer is cluster-wide
        assert _allowed(http, operator, ns, "update", "coordination.k8s.io:leases")
        assert _allowed(http, operator, "", "list", "nodes")
        assert not _allowed(http, operator, "default", "create", "apps:daemonsets")
        assert not _allowed(http, operator, "default", "patch", "apps:daemonsets")
        assert not _allowed(http, operator, "", "patch", "nodes")
        assert _allowed(http, operator, "", "patch", "nodes/status")  # a silent agent's node: Unknown
        assert _allowed(http, operator, keys.NODE_LEASE_NAMESPACE, "watch", "coordination.k8s.io:leases")
        # The agent renews its node's Lease there, and cannot reach the leader-election Leases.
        for verb in ("get", "create", "update"):
            assert _allowed(http, agent, keys.NODE_LEASE_NAMESPACE, verb, "coordination.k8s.io:leases")
            assert not _allowed(http, agent, ns, verb, "coordination.k8s.io:leases")
        assert _allowed(http, agent, "", "patch", "nodes")
        assert _allowed(http, agent, "", "patch", "nodes/status")
        assert _allowed(http, agent, "", "watch", "nodes")  # its own, for the driver-upgrade label
        assert _allowed(http, agent, "team-a", "create", "events")
        # It watches the pods (its informer selects its node's: a live resize changes their amounts), and
        # writes none of them.
        for verb in ("get", "list", "watch"):
            assert _allowed(http, agent, "", verb, "pods")
        assert not _allowed(http, agent, "", "delete", "nodes")
        assert not _allowed(http, agent, "team-a", "patch", "pods")
        assert not _allowed(http, agent, "team-a", "create", "pods/binding")


def test_helm_install_and_upgrade_keep_the_webhook_certificate(
    controlplane: ControlPlane, crd: None, namespace: str, tmp_path: Path
) -> None:
    """The one command, against the real API server: install creates the objects; an upgrade looks the
    TLS Secret up and keeps the CA the webhooks trust."""
    release = f"inst-{uuid.uuid4().hex[:6]}"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({**NOWHERE, "operator": {"config": {"create": False}}}))
    common = ("--namespace", namespace, "--kubeconfig", controlplane.kubeconfig, "--values", values)
    helm("install", release, CHART, *common)
    try:
        with controlplane.http() as http:
            secret = http.get(f"/api/v1/namespaces/{namespace}/secrets/gpufrac-admission-tls")
            assert secret.status_code == 200
            ca = secret.json()["data"]["ca.crt"]
            webhooks = (
                "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                f"{release}-gpufrac-admission"
            )
            assert http.get(webhooks).json()["webhooks"][0]["clientConfig"]["caBundle"] == ca
            deployment = http.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/gpufrac-scheduler")
            assert deployment.status_code == 200
            helm("upgrade", release, CHART, *common)
            assert http.get(webhooks).json()["webhooks"][0]["clientConfig"]["caBundle"] == ca
            again = http.get(f"/api/v1/namespaces/{namespace}/secrets/gpufrac-admission-tls").json()
            assert again["data"]["ca.crt"] == ca
    finally:
        helm("uninstall", release, *common[:4], check=False)
