"""Queues bound to namespaces at the front door (issue 34): the webhook in the real admission chain,
reading Queues and Namespaces from the API server (``KubeQueueBook``), against a tenant that is a
ServiceAccount with pod rights only in its own namespace.

The matchConditions are the API server's own CEL: these tests also prove that a relabelling update
reaches the webhook at all (before, only contract annotation changes did).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube import ApiError, Client, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import PatchType

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.configuration import webhook_configurations
from gpufrac.admission.queue_book import GpufracQueue, KubeQueueBook
from gpufrac.admission.review import AdmissionPolicy
from gpufrac.admission.server import AdmissionServer
from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube

CRD_FILE = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "gpufrac.io_queues.yaml"
FRACTION = {"gpu-fraction": "0.5"}


def pod(name: str, labels: dict[str, str] | None = None, *, priority_class: str | None = None) -> Pod:
    spec: dict = {
        "schedulerName": keys.DEFAULT_SCHEDULER_NAME,
        "containers": [{"name": "app", "image": "busybox"}],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": FRACTION, "labels": labels or {}},
        "spec": spec,
    }
    return codecs.from_dict(manifest)  # type: ignore[return-value]


def refused(call) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as raised:
        call()
    assert raised.value.status.code == 403, raised.value.status
    return raised.value.status.message or ""


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls(tmp_path_factory.mktemp("queue-webhook-tls"), hosts=["127.0.0.1"])


@pytest.fixture(scope="module")
def queue_crd(kube: Client) -> None:
    (crd,) = codecs.load_all_yaml(CRD_FILE.read_text())
    kube.apply(crd, field_manager="gpufrac-tests", force=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = kube.get(CustomResourceDefinition, crd.metadata.name)
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            return
        time.sleep(0.1)
    pytest.fail("the Queue CRD did not become Established")


@pytest.fixture
def cluster(kube: Client, namespace: str, queue_crd: None) -> Iterator[dict[str, str]]:
    """Team a (the test's namespace, the tenant's) and team b, each with a queue bound to it; q-a is
    team a's default queue and bounds priorities at 1000."""
    tag = uuid.uuid4().hex[:6]
    team_b = f"{namespace[:50]}-b"
    q_a, q_b = f"q-a-{tag}", f"q-b-{tag}"
    kube.create(Namespace(metadata=ObjectMeta(name=team_b)))
    kube.patch(Namespace, namespace, {"metadata": {"labels": {keys.NAMESPACE_DEFAULT_QUEUE_LABEL: q_a}}})
    kube.create(
        GpufracQueue(metadata=ObjectMeta(name=q_a), spec={"namespaces": [namespace], "maxPriority": 1000})
    )
    kube.create(GpufracQueue(metadata=ObjectMeta(name=q_b), spec={"namespaces": [team_b]}))
    try:
        yield {"team_a": namespace, "team_b": team_b, "q_a": q_a, "q_b": q_b}
    finally:
        for name in (q_a, q_b):
            kube.delete(GpufracQueue, name)
        kube.delete(Namespace, team_b)


@pytest.fixture
def webhook(
    controlplane: ControlPlane, kube: Client, tls: TlsFiles, cluster: dict[str, str]
) -> Iterator[KubeQueueBook]:
    book = KubeQueueBook(client=controlplane.async_client)
    book.start()
    assert book.wait_ready(30), "the queue book never read the cluster"
    server = AdmissionServer(
        cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, policy=AdmissionPolicy(queues=book)
    )
    server.start()
    name = f"gpufrac-queues-{uuid.uuid4().hex[:8]}"
    mutating, validating = webhook_configurations(
        name=name,
        ca_bundle=tls.ca_bundle(),
        url=server.url(),
        namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": cluster["team_a"]}},
    )
    try:
        kube.create(codecs.from_dict(mutating))
        kube.create(codecs.from_dict(validating))
        deadline = time.monotonic() + 20
        while True:  # the configurations reach the API server through an informer
            try:
                kube.create(
                    pod("probe", {keys.QUEUE_LABEL: cluster["q_b"]}),
                    namespace=cluster["team_a"],
                    dry_run=True,
                )
            except ApiError as error:
                if "validate.gpufrac.io" in (error.status.message or ""):
                    break
                raise
            assert time.monotonic() < deadline, "the API server never called the webhook"
            time.sleep(0.2)
        yield book
    finally:
        for kind in (MutatingWebhookConfiguration, ValidatingWebhookConfiguration):
            kube.delete(kind, name)
        server.stop()
        book.stop()


@pytest.fixture
def tenant(controlplane: ControlPlane, kube: Client, cluster: dict[str, str]) -> Iterator[Client]:
    """A ServiceAccount of team a with pod rights there only."""
    ns = cluster["team_a"]
    kube.create(
        Role(
            metadata=ObjectMeta(name="tenant", namespace=ns),
            rules=[
                PolicyRule(apiGroups=[""], resources=["pods"], verbs=["create", "get", "patch", "update"])
            ],
        )
    )
    kube.create(
        RoleBinding(
            metadata=ObjectMeta(name="tenant", namespace=ns),
            roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="tenant"),
            subjects=[Subject(kind="ServiceAccount", name="tenant", namespace=ns)],
        )
    )
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
    with controlplane.client(
        impersonate=f"system:serviceaccount:{ns}:tenant", groups=groups, namespace=ns
    ) as c:
        yield c


def test_a_tenant_cannot_create_a_pod_in_another_teams_queue_by_either_label_or_above_its_priority(
    webhook: KubeQueueBook, tenant: Client, cluster: dict[str, str]
) -> None:
    team_a, team_b, q_a, q_b = cluster["team_a"], cluster["team_b"], cluster["q_a"], cluster["q_b"]
    rule = f"is refused: queue {q_b} admits only namespace {team_b}, not namespace {team_a}"
    for label in (keys.QUEUE_LABEL, keys.KAI_QUEUE_LABEL):
        message = refused(lambda label=label: tenant.create(pod("foreign", {label: q_b})))
        assert (
            message
            == f'admission webhook "validate.gpufrac.io" denied the request: label {label}="{q_b}" {rule}'
        )
    # system-cluster-critical is allowed in any namespace by the API server; the queue bounds it.
    message = refused(
        lambda: tenant.create(
            pod("critical", {keys.QUEUE_LABEL: q_a}, priority_class="system-cluster-critical")
        )
    )
    assert (
        f"queue {q_a} allows pod priorities up to 1000 (spec.maxPriority), "
        "and this pod's priority is 2000000000" in message
    )
    # Without a label the namespace's default queue applies, with its bound.
    message = refused(lambda: tenant.create(pod("critical", priority_class="system-cluster-critical")))
    assert (
        f'the default queue of namespace {team_a} (label {keys.NAMESPACE_DEFAULT_QUEUE_LABEL}="{q_a}")'
        in message
    )
    assert tenant.create(pod("own", {keys.QUEUE_LABEL: q_a})).metadata.labels == {keys.QUEUE_LABEL: q_a}
    assert tenant.create(pod("unlabelled")).metadata.name == "unlabelled"


def test_a_tenant_cannot_relabel_its_pod_into_another_teams_queue(
    webhook: KubeQueueBook, tenant: Client, cluster: dict[str, str]
) -> None:
    q_a, q_b = cluster["q_a"], cluster["q_b"]
    tenant.create(pod("mine", {keys.QUEUE_LABEL: q_a}))
    for label in (keys.QUEUE_LABEL, keys.KAI_QUEUE_LABEL):
        message = refused(
            lambda label=label: tenant.patch(Pod, "mine", {"metadata": {"labels": {label: q_b}}})
        )
        assert f'label {label}="{q_b}" is refused' in message
    # Other label edits, and dropping the label into the namespace's own default queue, pass.
    tenant.patch(Pod, "mine", {"metadata": {"labels": {"app": "x"}}})
    tenant.patch(Pod, "mine", {"metadata": {"labels": {keys.QUEUE_LABEL: None}}}, patch_type=PatchType.MERGE)
    assert tenant.get(Pod, "mine").metadata.labels == {"app": "x"}
