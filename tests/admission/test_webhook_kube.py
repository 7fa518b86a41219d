"""The webhook in the real admission chain: kube-apiserver calls it over HTTPS, as in a cluster.

The server runs in this process on 127.0.0.1 with a throwaway CA; the webhook configurations point the
API server at it by URL with that CA bundle. Each test registers its own configurations, scoped to its
own namespace (other tests share the control plane) and removed afterwards.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from lightkube import ApiError, Client, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.core_v1 import Pod
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.configuration import webhook_configurations
from gpufrac.admission.review import DEFAULT_SCHEDULER_USER
from gpufrac.admission.server import AdmissionServer
from gpufrac.contract import keys
from gpufrac.contract.changes import changed_contract_keys
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NV = "nvidia.com/container."
#: What the mutating webhook adds to every pod whose container "app" asks for a GPU.
REQUIRES_GPUFRAC = {keys.nri_required_plugins_key("app"): keys.nri_required_plugins_value()}
USER = "alice@example.com"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls(tmp_path_factory.mktemp("webhook-tls"), hosts=["127.0.0.1"])


@dataclass
class Webhook:
    server: AdmissionServer
    namespace: str


def pod(name: str, annotations: dict[str, str] | None = None, **container: Any) -> Pod:
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "schedulerName": "gpufrac-scheduler",
            "containers": [{"name": "app", "image": "busybox", **container}],
        },
    }
    return codecs.from_dict(manifest)  # type: ignore[return-value]


def _wait_until_called(kube: Client, namespace: str) -> None:
    """Webhook configurations reach the API server through an informer; wait until ours is in effect."""
    deadline = time.monotonic() + 20
    while True:
        try:
            kube.create(pod("probe", {"gpu-fraction": "7"}), namespace=namespace, dry_run=True)
        except ApiError as error:
            if "validate.gpufrac.io" in (error.status.message or ""):
                return
            raise
        if time.monotonic() > deadline:
            raise AssertionError("the API server never called the webhook")
        time.sleep(0.2)


@pytest.fixture
def webhook(kube: Client, namespace: str, tls: TlsFiles) -> Iterator[Webhook]:
    server = AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0)
    server.start()
    name = f"gpufrac-test-{uuid.uuid4().hex[:8]}"
    mutating, validating = webhook_configurations(
        name=name,
        ca_bundle=tls.ca_bundle(),
        url=server.url(),
        namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": namespace}},
    )
    try:
        kube.create(codecs.from_dict(mutating))
        kube.create(codecs.from_dict(validating))
        _wait_until_called(kube, namespace)
        yield Webhook(server=server, namespace=namespace)
    finally:
        for kind in (MutatingWebhookConfiguration, ValidatingWebhookConfiguration):
            try:
                kube.delete(kind, name)
            except ApiError as error:
                if error.status.code != 404:
                    raise
        server.stop()


def rejection(create: Any) -> tuple[int, str]:
    with pytest.raises(ApiError) as raised:
        create()
    return raised.value.status.code or 0, raised.value.status.message or ""


def test_a_valid_pod_is_admitted_with_the_managed_toleration(kube: Client, webhook: Webhook) -> None:
    manifest = yaml.safe_load((EXAMPLES / "inference-sm-sharing.yaml").read_text())
    stored = kube.create(codecs.from_dict(manifest), namespace=webhook.namespace)
    assert stored.metadata.annotations == {**manifest["metadata"]["annotations"], **REQUIRES_GPUFRAC}
    tolerations = [(t.key, t.operator, t.effect) for t in stored.spec.tolerations or []]
    assert ("gpufrac.io/managed", "Exists", "NoSchedule") in tolerations


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        (
            {"gpu-fraction": "1.5"},
            'gpu-fraction="1.5" is invalid: a GPU fraction must be a number greater than 0 and less than 1',
        ),
        (
            {f"{NV}app.gpu-memory.request": "40Gi", f"{NV}app.gpu-memory.limit": "20Gi"},
            f'{NV}app.gpu-memory.limit="20Gi" is invalid: the limit must be at least the request',
        ),
        (
            {f"{NV}app.gpu-memory.request": "4096"},
            f'{NV}app.gpu-memory.request="4096" is invalid: the amount must be at least 1 MiB',
        ),
        (
            {f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpu-compute.mode": ""},
            f'{NV}app.gpu-compute.mode="" is invalid: the compute mode must be time-slicing or sm-sharing',
        ),
        (
            {f"{NV}trainer.gpu-memory.request": "1Gi"},
            f'{NV}trainer.gpu-memory.request="1Gi" is invalid: the pod has no container of that name',
        ),
        (
            {"gpu-fraction": "0.5", "gpu-memory": "4096"},
            'gpu-memory="4096" is invalid: a container\'s GPU request must be given in one form only',
        ),
    ],
)
def test_an_invalid_pod_is_rejected_with_the_contract_message(
    kube: Client, webhook: Webhook, annotations: dict[str, str], message: str
) -> None:
    code, shown = rejection(lambda: kube.create(pod("bad", annotations), namespace=webhook.namespace))
    assert code == 422
    assert shown.startswith('admission webhook "validate.gpufrac.io" denied the request: ')
    assert message in shown


def test_a_fraction_next_to_a_whole_gpu_is_rejected(kube: Client, webhook: Webhook) -> None:
    whole_and_fraction = pod("mixed", {"gpu-fraction": "0.5"}, resources={"limits": {"nvidia.com/gpu": "1"}})
    _, shown = rejection(lambda: kube.create(whole_and_fraction, namespace=webhook.namespace))
    assert "not both" in shown


def test_a_legacy_pod_is_stored_translated(kube: Client, webhook: Webhook) -> None:
    stored = kube.create(pod("legacy", {"gpu-memory": "4096", "team": "a"}), namespace=webhook.namespace)
    assert stored.metadata.annotations == {
        f"{NV}app.gpu-memory.request": "4096Mi",
        "team": "a",
        **REQUIRES_GPUFRAC,
    }
    assert (
        kube.get(Pod, "legacy", namespace=webhook.namespace).metadata.annotations
        == stored.metadata.annotations
    )


def test_whole_gpus_are_stored_as_an_exclusive_gpufrac_request(kube: Client, webhook: Webhook) -> None:
    whole = pod("whole", resources={"limits": {"nvidia.com/gpu": "2", "cpu": "1"}})
    stored = kube.create(whole, namespace=webhook.namespace)
    assert stored.metadata.annotations == {"gpufrac.io/container.app.gpus": "2", **REQUIRES_GPUFRAC}
    resources = stored.spec.containers[0].resources
    assert "nvidia.com/gpu" not in (resources.limits or {})
    assert "nvidia.com/gpu" not in (resources.requests or {})


def test_a_mig_resource_is_stored_as_gpufrac_mig_keys(kube: Client, webhook: Webhook) -> None:
    """A pod that asks only for ``nvidia.com/mig-<profile>`` reaches the webhook (its match condition
    names the MIG resources), which moves the request into the annotations the node reads."""
    sliced = pod("sliced", resources={"limits": {"nvidia.com/mig-1g.10gb": "2"}})
    stored = kube.create(sliced, namespace=webhook.namespace)
    assert stored.metadata.annotations == {
        keys.mig_key("app", keys.MIG_PROFILE): "1g.10gb",
        keys.mig_key("app", keys.MIG_COUNT): "2",
        **REQUIRES_GPUFRAC,
    }
    resources = stored.spec.containers[0].resources
    assert not any(r.startswith(keys.MIG_RESOURCE_PREFIX) for r in (resources.limits or {}))
    assert not any(r.startswith(keys.MIG_RESOURCE_PREFIX) for r in (resources.requests or {}))
    code, message = rejection(
        lambda: kube.create(
            pod("mixed", resources={"limits": {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpu": "1"}}),
            namespace=webhook.namespace,
        )
    )
    assert code == 422
    assert "a container asks for MIG slices or for other GPU keys" in message


@pytest.fixture
def users(kube: Client, namespace: str) -> None:
    """RBAC for an ordinary user and the scheduler's service account: both may manage pods here."""
    kube.create(
        Role(
            metadata=ObjectMeta(name="pods", namespace=namespace),
            rules=[
                PolicyRule(apiGroups=[""], resources=["pods"], verbs=["create", "get", "patch", "update"])
            ],
        )
    )
    _, _, sa_namespace, sa_name = DEFAULT_SCHEDULER_USER.split(":")
    kube.create(
        RoleBinding(
            metadata=ObjectMeta(name="pods", namespace=namespace),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="pods"),
            subjects=[
                Subject(kind="User", name=USER, apiGroup="rbac.authorization.k8s.io"),
                Subject(kind="ServiceAccount", name=sa_name, namespace=sa_namespace),
            ],
        )
    )


def test_only_the_scheduler_may_write_devices(
    controlplane: ControlPlane, webhook: Webhook, users: None
) -> None:
    ns = webhook.namespace
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    devices = {f"{NV}app.gpus.devices": "GPU-0a1b"}
    with (
        controlplane.client(impersonate=USER, groups=["system:authenticated"], namespace=ns) as alice,
        controlplane.client(
            impersonate=DEFAULT_SCHEDULER_USER, groups=["system:serviceaccounts"], namespace=ns
        ) as scheduler,
    ):
        code, shown = rejection(lambda: alice.create(pod("forged", {**request, **devices})))
        assert code == 422
        assert (
            f'{NV}app.gpus.devices="GPU-0a1b" is invalid: only the scheduler may set or change this key'
            in shown
        )

        alice.create(pod("mine", request))
        code, shown = rejection(lambda: alice.patch(Pod, "mine", {"metadata": {"annotations": devices}}))
        assert code == 403 and "only the scheduler may set or change this key" in shown
        grown = {"metadata": {"annotations": {f"{NV}app.gpu-memory.request": "80Gi"}}}
        code, shown = rejection(lambda: alice.patch(Pod, "mine", grown))
        assert code == 403 and "cannot be changed" in shown

        bound = scheduler.patch(Pod, "mine", {"metadata": {"annotations": devices}})
        assert bound.metadata.annotations == {**request, **devices, **REQUIRES_GPUFRAC}
        alice.patch(Pod, "mine", {"metadata": {"labels": {"owner": "alice"}}})  # the rest stays editable
        assert scheduler.create(pod("placed", {**request, **devices})).metadata.annotations == {
            **request,
            **devices,
            **REQUIRES_GPUFRAC,
        }


def test_with_the_webhook_down_only_gpu_pods_are_blocked(kube: Client, webhook: Webhook) -> None:
    ns = webhook.namespace
    kube.create(pod("plain-before"), namespace=ns)
    webhook.server.stop()

    _, shown = rejection(lambda: kube.create(pod("gpu", {"gpu-fraction": "0.5"}), namespace=ns))
    assert "gpufrac.io" in shown and "failed calling webhook" in shown
    _, shown = rejection(
        lambda: kube.create(pod("whole", resources={"limits": {"nvidia.com/gpu": "1"}}), namespace=ns)
    )
    assert "failed calling webhook" in shown

    assert kube.create(pod("plain"), namespace=ns).metadata.name == "plain"
    kube.patch(Pod, "plain-before", {"metadata": {"labels": {"still": "editable"}}}, namespace=ns)


@pytest.fixture
def binders(kube: Client, namespace: str) -> None:
    """RBAC for an ordinary user and the scheduler's service account: both may bind pods here."""
    kube.create(
        Role(
            metadata=ObjectMeta(name="binders", namespace=namespace),
            rules=[
                PolicyRule(apiGroups=[""], resources=["pods"], verbs=["get"]),
                PolicyRule(apiGroups=[""], resources=["pods/binding"], verbs=["create"]),
            ],
        )
    )
    _, _, sa_namespace, sa_name = DEFAULT_SCHEDULER_USER.split(":")
    kube.create(
        RoleBinding(
            metadata=ObjectMeta(name="binders", namespace=namespace),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="binders"),
            subjects=[
                Subject(kind="User", name=USER, apiGroup="rbac.authorization.k8s.io"),
                Subject(kind="ServiceAccount", name=sa_name, namespace=sa_namespace),
            ],
        )
    )


def bind(http: httpx2.Client, namespace: str, name: str, annotations: dict[str, str] | None = None) -> Any:
    """POST a Binding to ``node-1`` (lightkube cannot decode the Status a Binding answers)."""
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "annotations": annotations or {}},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"},
    }
    return http.post(f"/api/v1/namespaces/{namespace}/pods/{name}/binding", json=binding)


def test_only_the_scheduler_may_bind_with_devices(
    controlplane: ControlPlane, kube: Client, webhook: Webhook, binders: None
) -> None:
    ns = webhook.namespace
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    devices = {f"{NV}app.gpus.devices": "GPU-0a1b"}
    for name in ("target", "plain", "later"):
        kube.create(pod(name, request), namespace=ns)
    with (
        controlplane.http(impersonate=USER, groups=["system:authenticated"]) as alice,
        controlplane.http(impersonate=DEFAULT_SCHEDULER_USER, groups=["system:serviceaccounts"]) as scheduler,
    ):
        answer = bind(alice, ns, "target", devices)
        assert answer.status_code == 403, answer.text
        message = answer.json()["message"]
        assert message.startswith('admission webhook "validate-binding.gpufrac.io" denied the request: ')
        assert message.endswith(
            f'{NV}app.gpus.devices="GPU-0a1b" is invalid: only the scheduler may set or change this key.'
        )
        untouched = kube.get(Pod, "target", namespace=ns)
        assert not untouched.spec.nodeName and untouched.metadata.annotations == {
            **request,
            **REQUIRES_GPUFRAC,
        }

        answer = bind(scheduler, ns, "target", devices)
        assert answer.status_code == 201, answer.text
        bound = kube.get(Pod, "target", namespace=ns)
        assert bound.spec.nodeName == "node-1" and bound.metadata.annotations == {
            **request,
            **devices,
            **REQUIRES_GPUFRAC,
        }

        webhook.server.stop()  # a binding without contract keys never depends on the webhook
        answer = bind(alice, ns, "plain", {"team": "a"})
        assert answer.status_code == 201, answer.text
        assert kube.get(Pod, "plain", namespace=ns).spec.nodeName == "node-1"
        answer = bind(scheduler, ns, "later", devices)  # one that carries them waits for the webhook
        assert answer.status_code >= 500 and "failed calling webhook" in answer.json()["message"]


def _grant(
    kube: Client, namespace: str, name: str, rules: list[PolicyRule], *, scheduler: bool = True
) -> None:
    """A Role with ``rules`` for the tenant (and, unless told otherwise, the scheduler's account)."""
    kube.create(Role(metadata=ObjectMeta(name=name, namespace=namespace), rules=rules))
    _, _, sa_namespace, sa_name = DEFAULT_SCHEDULER_USER.split(":")
    subjects = [Subject(kind="User", name=USER, apiGroup="rbac.authorization.k8s.io")]
    if scheduler:
        subjects.append(Subject(kind="ServiceAccount", name=sa_name, namespace=sa_namespace))
    kube.create(
        RoleBinding(
            metadata=ObjectMeta(name=name, namespace=namespace),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name=name),
            subjects=subjects,
        )
    )


def bind_namespaced(http: httpx2.Client, namespace: str, name: str, annotations: dict[str, str]) -> Any:
    """POST a Binding to the namespaced ``bindings`` resource, the second door to a pod's node."""
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"},
    }
    return http.post(f"/api/v1/namespaces/{namespace}/bindings", json=binding)


def test_a_tenant_may_not_bind_with_devices_through_the_namespaced_bindings_endpoint(
    controlplane: ControlPlane, kube: Client, webhook: Webhook
) -> None:
    ns = webhook.namespace
    _grant(kube, ns, "bindings", [PolicyRule(apiGroups=[""], resources=["bindings"], verbs=["create"])])
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    devices = {f"{NV}app.gpus.devices": "GPU-0a1b,GPU-2c3d"}
    kube.create(pod("target", request), namespace=ns)
    with (
        controlplane.http(impersonate=USER, groups=["system:authenticated"]) as alice,
        controlplane.http(impersonate=DEFAULT_SCHEDULER_USER, groups=["system:serviceaccounts"]) as scheduler,
    ):
        answer = bind_namespaced(alice, ns, "target", devices)
        assert answer.status_code == 403, answer.text
        message = answer.json()["message"]
        assert message.startswith('admission webhook "validate-binding.gpufrac.io" denied the request: ')
        assert f'{NV}app.gpus.devices="GPU-0a1b,GPU-2c3d" is invalid: only the scheduler' in message
        untouched = kube.get(Pod, "target", namespace=ns)
        assert not untouched.spec.nodeName and untouched.metadata.annotations == {
            **request,
            **REQUIRES_GPUFRAC,
        }

        answer = bind_namespaced(scheduler, ns, "target", devices)
        assert answer.status_code == 201, answer.text
        bound = kube.get(Pod, "target", namespace=ns)
        assert bound.spec.nodeName == "node-1" and bound.metadata.annotations == {
            **request,
            **REQUIRES_GPUFRAC,
            **devices,
        }


def patch_status(http: httpx2.Client, namespace: str, name: str, patch: dict[str, Any]) -> Any:
    return http.patch(
        f"/api/v1/namespaces/{namespace}/pods/{name}/status",
        content=json.dumps(patch),
        headers={"Content-Type": "application/merge-patch+json"},
    )


def test_a_tenant_with_status_rights_may_not_forge_devices_or_grow_the_request(
    controlplane: ControlPlane, kube: Client, webhook: Webhook
) -> None:
    ns = webhook.namespace
    _grant(
        kube,
        ns,
        "status",
        [
            PolicyRule(apiGroups=[""], resources=["pods"], verbs=["create", "get"]),
            PolicyRule(apiGroups=[""], resources=["pods/status"], verbs=["patch", "update"]),
        ],
    )
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    with (
        controlplane.client(impersonate=USER, groups=["system:authenticated"], namespace=ns) as alice_pods,
        controlplane.http(impersonate=USER, groups=["system:authenticated"]) as alice,
        controlplane.http(impersonate=DEFAULT_SCHEDULER_USER, groups=["system:serviceaccounts"]) as scheduler,
    ):
        alice_pods.create(pod("mine", request))
        forged = {"metadata": {"annotations": {f"{NV}app.gpus.devices": "GPU-0a1b"}}}
        answer = patch_status(alice, ns, "mine", forged)
        assert answer.status_code == 403, answer.text
        message = answer.json()["message"]
        assert message.startswith('admission webhook "validate.gpufrac.io" denied the request: ')
        assert (
            f'{NV}app.gpus.devices="GPU-0a1b" is invalid: only the scheduler may set or change this key.'
            in (message)
        )
        grown = {"metadata": {"annotations": {f"{NV}app.gpu-memory.request": "300Gi"}}}
        answer = patch_status(alice, ns, "mine", grown)
        assert answer.status_code == 403 and "cannot be changed" in answer.json()["message"]
        assert kube.get(Pod, "mine", namespace=ns).metadata.annotations == {**request, **REQUIRES_GPUFRAC}

        # A status write that leaves the contract alone is still the tenant's to make.
        condition = {"type": "example.com/Ready", "status": "True"}
        answer = patch_status(alice, ns, "mine", {"status": {"conditions": [condition]}})
        assert answer.status_code == 200, answer.text
        # The scheduler may (it never needs to; the rule is the same as for the pod itself).
        answer = patch_status(scheduler, ns, "mine", forged)
        assert answer.status_code == 200, answer.text


def test_with_the_webhook_down_only_updates_of_contract_keys_fail(
    controlplane: ControlPlane, kube: Client, webhook: Webhook
) -> None:
    """A webhook outage used to fail every update of a GPU pod (the kubelet's status writes, labels,
    finalizers); only an update that changes a contract key needs the webhook, and it still fails closed."""
    ns = webhook.namespace
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    kube.create(pod("gpu", request), namespace=ns)
    webhook.server.stop()

    kube.patch(Pod, "gpu", {"metadata": {"labels": {"team": "a"}}}, namespace=ns)
    kube.patch(Pod, "gpu", {"metadata": {"annotations": {"example.com/note": "x"}}}, namespace=ns)
    kube.patch(Pod, "gpu", {"metadata": {"finalizers": ["example.com/keep"]}}, namespace=ns)
    kube.patch(Pod, "gpu", {"metadata": {"finalizers": None}}, namespace=ns)
    with controlplane.http() as http:
        answer = patch_status(
            http, ns, "gpu", {"status": {"conditions": [{"type": "x/Y", "status": "True"}]}}
        )
        assert answer.status_code == 200, answer.text
    stored = kube.get(Pod, "gpu", namespace=ns)
    assert stored.metadata.labels == {"team": "a"}
    assert stored.metadata.annotations == {**request, **REQUIRES_GPUFRAC, "example.com/note": "x"}

    for change in (
        {f"{NV}app.gpu-memory.request": "2Gi"},
        {f"{NV}app.gpus.devices": "GPU-0a1b"},
        {f"{NV}app.gpu-memory.request": None},
    ):
        _, shown = rejection(
            lambda c=change: kube.patch(Pod, "gpu", {"metadata": {"annotations": c}}, namespace=ns)
        )
        assert 'failed calling webhook "validate.gpufrac.io"' in shown
    with controlplane.http() as http:
        answer = patch_status(
            http, ns, "gpu", {"metadata": {"annotations": {f"{NV}app.gpus.devices": "GPU-1"}}}
        )
        assert answer.status_code >= 500
        assert 'failed calling webhook "validate.gpufrac.io"' in answer.json()["message"]
    assert kube.get(Pod, "gpu", namespace=ns).metadata.annotations == {
        **request,
        **REQUIRES_GPUFRAC,
        "example.com/note": "x",
    }


# Annotation changes to a GPU pod, to compare the matchCondition's CEL with the Python rule it encodes
# (contract.changes.changed_contract_keys): near misses of every contract prefix and pod-level key.
CHANGES = [
    {"gpu-fraction": "0.5"},
    {"gpu-fractions": "0.5"},
    {"gpu-memory.limit": "1Gi"},
    {"kai.scheduler/container.app.gpu-memory.portion.limit": "0.7"},
    {"kai.scheduler/queue": "a"},
    {"gpufrac.io/container.app.gpus": "1"},
    {"gpufrac.io/placement-policy": "spread"},
    {"nvidia.com/container": "x"},
    {"nvidia.com/container.app.gpu-compute.mode": "sm-sharing"},
    {"example.com/container.app.gpus.devices": "x"},
]


def test_with_the_webhook_down_an_update_fails_exactly_when_it_changes_a_contract_key(
    kube: Client, webhook: Webhook
) -> None:
    ns = webhook.namespace
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    kube.create(pod("gpu", request), namespace=ns)
    webhook.server.stop()
    outcomes = []
    for change in CHANGES:
        try:
            kube.patch(Pod, "gpu", {"metadata": {"annotations": change}}, namespace=ns)
            blocked = False
        except ApiError as error:
            assert "failed calling webhook" in (error.status.message or ""), error.status.message
            blocked = True
        changed = bool(changed_contract_keys(request, {**request, **change}))
        outcomes.append((change, blocked, changed))
        if not blocked:  # back to the pod's own annotations for the next change
            kube.patch(Pod, "gpu", {"metadata": {"annotations": dict.fromkeys(change)}}, namespace=ns)
    assert [(c, blocked) for c, blocked, _ in outcomes] == [(c, changed) for c, _, changed in outcomes]
    assert sum(1 for _, blocked, _ in outcomes if blocked) == 5


@pytest.mark.parametrize(
    ("subresource", "body"),
    [
        ("ephemeralcontainers", {"spec": {"ephemeralContainers": [{"name": "debug", "image": "busybox"}]}}),
        (
            "resize",
            {
                "spec": {
                    "containers": [
                        {"name": "app", "resources": {"requests": {"cpu": "200m"}, "limits": {"cpu": "200m"}}}
                    ]
                }
            },
        ),
    ],
)
def test_the_other_pod_subresources_cannot_change_annotations(
    controlplane: ControlPlane, kube: Client, namespace: str, subresource: str, body: dict[str, Any]
) -> None:
    """docs/security.md relies on it: no webhook guards these doors because the API server keeps the
    metadata of the stored pod for them. If a Kubernetes release changed that, this test fails first."""
    request = {f"{NV}app.gpu-memory.request": "1Gi"}
    cpu = {"requests": {"cpu": "100m"}, "limits": {"cpu": "100m"}}
    kube.create(pod("p", request, resources=cpu), namespace=namespace)
    forged = {**body, "metadata": {"annotations": {f"{NV}app.gpus.devices": "GPU-0a1b"}}}
    with controlplane.http() as http:
        answer = http.patch(
            f"/api/v1/namespaces/{namespace}/pods/p/{subresource}",
            content=json.dumps(forged),
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
    assert answer.status_code == 200, answer.text  # the write itself succeeds ...
    assert kube.get(Pod, "p", namespace=namespace).metadata.annotations == request  # ... without the key


def _kubectl_create(controlplane: ControlPlane, namespace: str, manifest: dict[str, Any]) -> tuple[str, str]:
    import subprocess

    done = subprocess.run(
        ["kubectl", f"--kubeconfig={controlplane.kubeconfig}", "-n", namespace, "create", "-f", "-"],
        input=json.dumps(manifest),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_a_fraction_without_a_scheduler_gets_ours_and_a_misspelled_key_a_warning(
    kube: Client, webhook: Webhook, controlplane: ControlPlane
) -> None:
    """Before, a GPU pod without schedulerName waited forever in silence, and a pod whose only GPU key
    was misspelled (gpu-fractions) was admitted without a word and ran with no GPU."""
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "no-scheduler", "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"containers": [{"name": "app", "image": "busybox"}]},
    }
    _kubectl_create(controlplane, webhook.namespace, plain)
    stored = kube.get(Pod, "no-scheduler", namespace=webhook.namespace)
    assert stored.spec.schedulerName == "gpufrac-scheduler"
    assert ("gpufrac.io/managed", "Exists", "NoSchedule") in [
        (t.key, t.operator, t.effect) for t in stored.spec.tolerations or []
    ]

    kept = json.loads(json.dumps(plain))
    kept["metadata"] = {
        "name": "keeps-default",
        "annotations": {"gpu-fraction": "0.5", keys.KEEP_SCHEDULER_NAME_ANNOTATION: "true"},
    }
    _kubectl_create(controlplane, webhook.namespace, kept)
    assert (
        kube.get(Pod, "keeps-default", namespace=webhook.namespace).spec.schedulerName == "default-scheduler"
    )

    typo = json.loads(json.dumps(plain))
    typo["metadata"] = {"name": "typo", "annotations": {"gpu-fractions": "0.5"}}
    _, stderr = _kubectl_create(controlplane, webhook.namespace, typo)
    assert 'Warning: annotation "gpu-fractions" is not a key gpufrac reads' in stderr
    assert 'did you mean "gpu-fraction"?' in stderr
    # no GPU asked, so no scheduler name given
    assert kube.get(Pod, "typo", namespace=webhook.namespace).spec.schedulerName == "default-scheduler"


def test_a_tenant_may_resize_a_placed_pod_through_patch_and_update_and_nothing_else(
    controlplane: ControlPlane, webhook: Webhook, users: None
) -> None:
    """A namespaced user (pods rights in its namespace only) writes resize requests on its placed pod, by
    merge patch and by a full update; every other contract key stays the scheduler's or fixed."""
    ns = webhook.namespace
    bound = {f"{NV}app.gpu-memory.request": "4096Mi", f"{NV}app.gpu-memory.limit": "4096Mi"}
    devices = {f"{NV}app.gpus.devices": "GPU-0a1b"}
    resize = keys.resize_key("app", keys.RESIZE_MEMORY_REQUEST)
    with (
        controlplane.client(impersonate=USER, groups=["system:authenticated"], namespace=ns) as alice,
        controlplane.client(
            impersonate=DEFAULT_SCHEDULER_USER, groups=["system:serviceaccounts"], namespace=ns
        ) as scheduler,
    ):
        running = pod("running", {**bound, **devices})
        running.spec.nodeName = "node-1"
        scheduler.create(running)
        patched = alice.patch(Pod, "running", {"metadata": {"annotations": {resize: "8Gi"}}})
        assert patched.metadata.annotations[resize] == "8Gi"
        current = alice.get(Pod, "running")
        current.metadata.annotations[resize] = "6Gi"
        assert alice.replace(current).metadata.annotations[resize] == "6Gi"

        code, shown = rejection(
            lambda: alice.patch(
                Pod, "running", {"metadata": {"annotations": {f"{NV}app.gpu-memory.request": "8Gi"}}}
            )
        )
        assert code == 403 and f"to resize, set {resize}" in shown
        code, shown = rejection(
            lambda: alice.patch(Pod, "running", {"metadata": {"annotations": {resize: "lots"}}})
        )
        assert code == 422 and "must be a Kubernetes quantity" in shown
        alice.create(pod("pending", bound))
        code, shown = rejection(
            lambda: alice.patch(Pod, "pending", {"metadata": {"annotations": {resize: "8Gi"}}})
        )
        assert code == 403 and "the pod is not placed yet" in shown
        # The scheduler's decision: the new amounts and the request removed, in one patch.
        decided = {
            f"{NV}app.gpu-memory.request": "6144Mi",
            f"{NV}app.gpu-memory.limit": "6144Mi",
            resize: None,
        }
        done = scheduler.patch(Pod, "running", {"metadata": {"annotations": decided}})
        assert resize not in done.metadata.annotations
        assert done.metadata.annotations[f"{NV}app.gpu-memory.request"] == "6144Mi"
