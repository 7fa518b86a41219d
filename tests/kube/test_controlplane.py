"""The testenv control plane behaves as a cluster's API server does, on the points gpufrac relies on.

Each test pins a behaviour the scheduler, the webhook or the node agent depends on — pods waiting
for a binder, the Binding subresource, optimistic concurrency, 410 Gone after compaction, RBAC with
impersonation, service-account tokens, admission webhooks, state surviving a restart — so that a
change of Kubernetes version or of the control plane's flags that breaks one of them shows up here
first, with a plain name.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import httpx2
import pytest
from lightkube import ApiError, AsyncClient, Client, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.models.admissionregistration_v1 import (
    RuleWithOperations,
    ValidatingWebhook,
    WebhookClientConfig,
)
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.admissionregistration_v1 import ValidatingWebhookConfiguration
from lightkube.resources.authentication_v1 import SelfSubjectReview
from lightkube.resources.core_v1 import Namespace, Node, Pod, ServiceAccount, ServiceAccountToken
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

from gpufrac.local.controlplane import BINARY_ENV, ControlPlane, ControlPlaneError, find_binary

pytestmark = pytest.mark.kube

T = TypeVar("T")


def pod(name: str, *, labels: dict[str, str] | None = None) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, labels=labels),
        spec=PodSpec(containers=[Container(name="main", image="registry.invalid/app:1")]),
    )


def bind(http: httpx2.Client, *, namespace: str, pod_name: str, node_name: str) -> httpx2.Response:
    """POST a Binding to the pod's binding subresource, as a scheduler does.

    Sent as plain HTTP because the API server answers with a ``Status``, not the ``Binding`` that
    lightkube 1.0 decodes the answer of ``create(PodBinding(...))`` into (it fails on the missing
    ``target``); the request is the one any client sends.
    """
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": pod_name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node_name},
    }
    return http.post(f"/api/v1/namespaces/{namespace}/pods/{pod_name}/binding", json=body)


def eventually(probe: Callable[[], T], *, retry_on: Callable[[ApiError], bool], timeout: float = 10.0) -> T:
    """``probe()``'s result once it stops failing with an error ``retry_on`` accepts.

    The API server's authorizer and admission read their configuration (Roles, webhook
    configurations) through informers, so a change takes effect a moment after it is written.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return probe()
        except ApiError as exc:
            if not retry_on(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


@pytest.fixture
def http(controlplane: ControlPlane) -> Iterator[httpx2.Client]:
    with controlplane.http() as client:
        yield client


@pytest.fixture
def node(kube: Client) -> Iterator[str]:
    name = f"node-{uuid.uuid4().hex[:8]}"
    kube.create(Node(metadata=ObjectMeta(name=name)))
    yield name
    kube.delete(Node, name)


# -- the control plane itself ------------------------------------------------------------------


def test_it_is_ready_with_the_default_namespace(controlplane: ControlPlane, kube: Client) -> None:
    assert controlplane.running
    assert controlplane.server.startswith("https://127.0.0.1:")
    assert controlplane.readyz() == 200
    assert kube.get(Namespace, "default").status.phase == "Active"


def test_a_missing_binary_names_the_command_that_builds_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ControlPlaneError, match="make testenv"):
        find_binary()


def test_a_failed_start_reports_the_log(tmp_path: Path) -> None:
    cp = ControlPlane(data_dir=tmp_path / "cp", apiserver_args=["--no-such-flag=1"])
    with pytest.raises(ControlPlaneError, match="exited with code 1") as raised:
        cp.start()
    assert "unknown flag: --no-such-flag" in str(raised.value)
    assert not cp.running


# -- pods, nodes, binding -----------------------------------------------------------------------


def test_a_pod_stays_pending_until_something_binds_it(kube: Client, namespace: str) -> None:
    created = kube.create(pod("web"), namespace=namespace)
    assert created.status.phase == "Pending"
    assert created.spec.nodeName is None
    # ServiceAccount admission is off (no controller creates `default` accounts): pods are
    # admitted without one rather than rejected.
    assert created.spec.serviceAccountName is None
    assert [p.metadata.name for p in kube.list(Pod, namespace=namespace)] == ["web"]
    assert kube.get(Pod, "web", namespace=namespace).status.phase == "Pending"


def test_a_new_node_is_tainted_not_ready_by_admission(kube: Client, node: str) -> None:
    # TaintNodesByCondition runs as in a real cluster: a scheduler must tolerate or clear this taint.
    taints = {(t.key, t.effect) for t in kube.get(Node, node).spec.taints or []}
    assert ("node.kubernetes.io/not-ready", "NoSchedule") in taints


def test_the_binding_subresource_assigns_a_node_once(
    kube: Client, http: httpx2.Client, namespace: str, node: str
) -> None:
    kube.create(pod("job"), namespace=namespace)
    first = bind(http, namespace=namespace, pod_name="job", node_name=node)
    assert first.status_code == 201
    assert (first.json()["kind"], first.json()["status"]) == ("Status", "Success")

    bound = kube.get(Pod, "job", namespace=namespace)
    assert bound.spec.nodeName == node
    scheduled = [c for c in bound.status.conditions or [] if c.type == "PodScheduled"]
    assert [c.status for c in scheduled] == ["True"]

    again = bind(http, namespace=namespace, pod_name="job", node_name=node)
    assert again.status_code == 409
    assert "already assigned" in again.json()["message"]


async def test_a_watch_delivers_the_creation_and_the_binding(
    akube: AsyncClient, http: httpx2.Client, namespace: str, node: str
) -> None:
    listing = akube.list(Pod, namespace=namespace)
    assert [p async for p in listing] == []
    watch = akube.watch(Pod, namespace=namespace, resource_version=listing.resourceVersion)
    try:
        # Created before the watch request is sent: starting from the list's version, the watch
        # must still deliver it.
        await akube.create(pod("w"), namespace=namespace)
        async with asyncio.timeout(10):
            kind, obj = await anext(watch)
        assert (kind, obj.metadata.name, obj.spec.nodeName) == ("ADDED", "w", None)

        assert bind(http, namespace=namespace, pod_name="w", node_name=node).status_code == 201
        async with asyncio.timeout(10):
            kind, obj = await anext(watch)
        assert (kind, obj.metadata.name, obj.spec.nodeName) == ("MODIFIED", "w", node)
    finally:
        await watch.aclose()


def test_a_patch_with_a_stale_resource_version_is_a_conflict(kube: Client, namespace: str) -> None:
    stale = kube.create(pod("p"), namespace=namespace).metadata.resourceVersion
    current = kube.patch(Pod, "p", {"metadata": {"labels": {"round": "1"}}}, namespace=namespace)
    assert current.metadata.resourceVersion != stale

    with pytest.raises(ApiError) as conflict:
        kube.patch(
            Pod, "p", {"metadata": {"resourceVersion": stale, "labels": {"round": "2"}}}, namespace=namespace
        )
    assert conflict.value.status.code == 409
    assert conflict.value.status.reason == "Conflict"
    assert kube.get(Pod, "p", namespace=namespace).metadata.labels == {"round": "1"}

    patched = kube.patch(
        Pod,
        "p",
        {"metadata": {"resourceVersion": current.metadata.resourceVersion, "labels": {"round": "2"}}},
        namespace=namespace,
    )
    assert patched.metadata.labels == {"round": "2"}


# -- 410 Gone after etcd compaction ------------------------------------------------------------


async def _watch_until_gone(client: AsyncClient, namespace: str, version: str, *, timeout: float) -> ApiError:
    """Watch from ``version`` until the API server answers 410 instead of replaying events.

    The API server compacts etcd every --etcd-compaction-interval, up to the revision it saw one
    interval before, so a version is gone after at most two or three intervals; asking until it is
    makes the test independent of where the timer stands.
    """
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        watch = client.watch(Pod, namespace=namespace, resource_version=version)
        try:
            async with asyncio.timeout(5):
                await anext(watch)  # an event after `version` exists, so this never waits long
        except ApiError as exc:
            if exc.status.code == 410:
                return exc
            raise
        finally:
            await watch.aclose()
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"resourceVersion {version} still watchable after {timeout}s")
        await asyncio.sleep(0.5)


async def test_a_watch_from_a_compacted_version_is_gone_and_a_relist_recovers(tmp_path: Path) -> None:
    # Its own control plane: compaction every second, and no watch cache, so the watch is served
    # by etcd and "too old" means "compacted", the way a long-disconnected client meets it.
    cp = ControlPlane(
        data_dir=tmp_path / "cp", apiserver_args=["--etcd-compaction-interval=1s", "--watch-cache=false"]
    )
    await asyncio.to_thread(cp.start)
    client = cp.async_client()
    try:
        await client.create(Namespace(metadata=ObjectMeta(name="gone")))
        old = (await client.create(pod("p"), namespace="gone")).metadata.resourceVersion
        for i in range(3):
            await client.patch(Pod, "p", {"metadata": {"labels": {"round": str(i)}}}, namespace="gone")

        gone = await _watch_until_gone(client, "gone", old, timeout=30)
        assert gone.status.code == 410

        # Recovery as an informer does it: relist, then watch from the list's version.
        listing = client.list(Pod, namespace="gone")
        assert [(p.metadata.name, p.metadata.labels) async for p in listing] == [("p", {"round": "2"})]
        watch = client.watch(Pod, namespace="gone", resource_version=listing.resourceVersion)
        try:
            await client.create(pod("q"), namespace="gone")
            async with asyncio.timeout(10):
                kind, obj = await anext(watch)
            assert (kind, obj.metadata.name) == ("ADDED", "q")
        finally:
            await watch.aclose()
    finally:
        await client.close()
        assert await asyncio.to_thread(cp.stop) == 0


# -- identities: RBAC, impersonation, service-account tokens -------------------------------------


def test_rbac_decides_what_an_impersonated_service_account_may_do(
    controlplane: ControlPlane, kube: Client, namespace: str
) -> None:
    kube.create(ServiceAccount(metadata=ObjectMeta(name="reader")), namespace=namespace)
    kube.create(pod("p"), namespace=namespace)
    user = f"system:serviceaccount:{namespace}:reader"

    with controlplane.client(impersonate=user) as reader:
        info = reader.create(SelfSubjectReview()).status.userInfo
        assert info.username == user
        assert {
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        } <= set(info.groups)

        with pytest.raises(ApiError) as denied:
            list(reader.list(Pod, namespace=namespace))
        assert denied.value.status.code == 403

        kube.create(
            Role(
                metadata=ObjectMeta(name="pod-reader"),
                rules=[PolicyRule(apiGroups=[""], resources=["pods"], verbs=["get", "list"])],
            ),
            namespace=namespace,
        )
        kube.create(
            RoleBinding(
                metadata=ObjectMeta(name="reader-reads-pods"),
                subjects=[Subject(kind="ServiceAccount", name="reader", namespace=namespace)],
                roleRef=RoleRef(apiGroup="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
            ),
            namespace=namespace,
        )
        names = eventually(
            lambda: [p.metadata.name for p in reader.list(Pod, namespace=namespace)],
            retry_on=lambda exc: exc.status.code == 403,
        )
        assert names == ["p"]

        # Read access only: writes and other namespaces stay forbidden.
        with pytest.raises(ApiError) as write:
            reader.create(pod("q"), namespace=namespace)
        assert write.value.status.code == 403
        with pytest.raises(ApiError) as elsewhere:
            list(reader.list(Pod, namespace="default"))
        assert elsewhere.value.status.code == 403

    assert [p.metadata.name for p in kube.list(Pod, namespace=namespace)] == ["p"]


def _token_client(cp: ControlPlane, token: str) -> Client:
    config = KubeConfig.from_one(
        cluster=Cluster(server=cp.server, certificate_auth=str(cp.ca_file)), user=User(token=token)
    )
    return Client(config=config, trust_env=False)


def _service_account_token(kube: Client, *, name: str, namespace: str) -> str:
    request = ServiceAccountToken(
        metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=3600)
    )
    return kube.create(request, name=name, namespace=namespace).status.token


def test_a_service_account_token_authenticates_as_that_account(
    controlplane: ControlPlane, kube: Client, namespace: str
) -> None:
    kube.create(ServiceAccount(metadata=ObjectMeta(name="agent")), namespace=namespace)
    token = _service_account_token(kube, name="agent", namespace=namespace)
    with _token_client(controlplane, token) as agent:
        info = agent.create(SelfSubjectReview()).status.userInfo
    assert info.username == f"system:serviceaccount:{namespace}:agent"


# -- admission webhooks ----------------------------------------------------------------------------


class _DenyLabelledPods(BaseHTTPRequestHandler):
    """A validating webhook: denies pods labelled deny=yes, admits the rest."""

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        labels = request["object"]["metadata"].get("labels") or {}
        allowed = labels.get("deny") != "yes"
        response: dict[str, object] = {"uid": request["uid"], "allowed": allowed}
        if not allowed:
            response["status"] = {"code": 403, "message": "test webhook: pods labelled deny=yes are refused"}
        body = json.dumps(
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def webhook_server(controlplane: ControlPlane) -> Iterator[str]:
    # The API server's own serving certificate names 127.0.0.1 and is signed by the control plane's
    # CA, which makes it a valid certificate for a webhook on loopback without minting another.
    pki = controlplane.ca_file.parent
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DenyLabelledPods)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/validate"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_validating_webhook_is_called_on_pod_creation(
    controlplane: ControlPlane, kube: Client, namespace: str, webhook_server: str
) -> None:
    name = f"deny-labelled-pods-{namespace}"
    kube.create(
        ValidatingWebhookConfiguration(
            metadata=ObjectMeta(name=name),
            webhooks=[
                ValidatingWebhook(
                    name="deny.test.gpufrac.io",
                    clientConfig=WebhookClientConfig(
                        url=webhook_server,
                        caBundle=base64.b64encode(controlplane.ca_file.read_bytes()).decode(),
                    ),
                    rules=[
                        RuleWithOperations(
                            apiGroups=[""], apiVersions=["v1"], operations=["CREATE"], resources=["pods"]
                        )
                    ],
                    # Only this test's namespace, so a slow webhook never touches other tests.
                    namespaceSelector=LabelSelector(matchLabels={"kubernetes.io/metadata.name": namespace}),
                    admissionReviewVersions=["v1"],
                    sideEffects="None",
                    failurePolicy="Fail",
                    timeoutSeconds=5,
                )
            ],
        )
    )
    try:
        probes = iter(range(1000))

        def create_denied() -> Pod:
            # Until the webhook configuration is loaded a probe may be admitted; each uses a new name.
            return kube.create(pod(f"probe-{next(probes)}", labels={"deny": "yes"}), namespace=namespace)

        with pytest.raises(ApiError) as denied:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                create_denied()
                time.sleep(0.05)
        assert denied.value.status.code == 403
        assert "pods labelled deny=yes are refused" in denied.value.status.message

        admitted = kube.create(pod("fine", labels={"deny": "no"}), namespace=namespace)
        assert admitted.metadata.name == "fine"
    finally:
        kube.delete(ValidatingWebhookConfiguration, name)


# -- restart ---------------------------------------------------------------------------------------


def test_a_restart_on_the_same_data_dir_keeps_objects_and_credentials(tmp_path: Path) -> None:
    data_dir = tmp_path / "cp"
    first = ControlPlane(data_dir=data_dir).start()
    try:
        with first.client() as kube:
            kube.create(Namespace(metadata=ObjectMeta(name="kept")))
            uid = kube.create(pod("survivor"), namespace="kept").metadata.uid
            kube.create(ServiceAccount(metadata=ObjectMeta(name="agent")), namespace="kept")
            token = _service_account_token(kube, name="agent", namespace="kept")
        ca = first.ca_file.read_bytes()
        # One control plane per data directory: a second is refused at once, not left waiting.
        with pytest.raises(ControlPlaneError, match="in use by another control plane"):
            ControlPlane(data_dir=data_dir).start()
    finally:
        assert first.stop() == 0
    assert not first.running

    second = ControlPlane(data_dir=data_dir).start()
    try:
        assert second.ca_file.read_bytes() == ca
        with second.client() as kube:
            survivor = kube.get(Pod, "survivor", namespace="kept")
            assert survivor.metadata.uid == uid
            assert survivor.status.phase == "Pending"
        # The service-account signing key was reused: a token issued before the restart still works.
        with _token_client(second, token) as agent:
            info = agent.create(SelfSubjectReview()).status.userInfo
        assert info.username == "system:serviceaccount:kept:agent"
    finally:
        assert second.stop() == 0
