"""The chart's ValidatingAdmissionPolicies on the real API server: what RBAC lets through, they refuse.

RBAC grants the node agent `patch nodes` and the scheduler `patch pods` on every object of the kind.
The policies (deploy/helm/gpufrac/templates/admission-policies.yaml) narrow them: a node agent's token
writes only the Node it is bound to (its ResourceSlices, its heartbeat Lease), and the scheduler's writes
to pods change only the binder-owned annotations. Every write here is a real request: the node agent's
with a real bound service-account token (TokenRequest bound to a pod on a node, as the kubelet projects
it into the DaemonSet's pods), the scheduler's impersonated as its ServiceAccount, so authentication,
RBAC and admission all decide.
"""

from __future__ import annotations

import re
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from helm_chart import render
from test_chart_kube import collection, create

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.node.resize import REASON_WAITING_FOR_USAGE, RESIZE_CONDITION

pytestmark = pytest.mark.kube

CONTAINER = "app"
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
INSTALLED = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", *POLICY_KINDS)


@pytest.fixture
def installed(controlplane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The chart's ServiceAccounts, Roles, ClusterRoles and policies, created for real; cluster-scoped
    ones (and the Roles in the node Leases' shared namespace) are named after a unique release and removed
    afterwards."""
    release = f"vap-{uuid.uuid4().hex[:6]}"
    objects = [
        o for o in render(tmp_path=tmp_path, namespace=namespace, release=release) if o["kind"] in INSTALLED
    ]
    assert {o["kind"] for o in objects} == set(INSTALLED)
    with controlplane.http() as http:
        lease_namespace = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": keys.NODE_LEASE_NAMESPACE},
        }
        assert create(http, lease_namespace, dry_run=False).status_code in (201, 409)
        for obj in objects:
            answer = create(http, obj, dry_run=False)
            assert answer.status_code == 201, answer.text
    yield {"namespace": namespace, "objects": objects}
    with controlplane.http() as http:
        for obj in objects:
            if obj["kind"] != "ServiceAccount":
                http.delete(f"{collection(obj)}/{obj['metadata']['name']}")


def _until_refused(send, *, timeout_s: float = 30.0) -> httpx2.Response:  # type: ignore[no-untyped-def]
    """Policies take effect once the API server has loaded and type-checked them: wait for the first
    refusal of a write that must be refused (a dry run, so nothing changes), and return it."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = send()
        if answer.status_code in (403, 422) or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def _merge(http: httpx2.Client, url: str, body: dict[str, Any], **params: str) -> httpx2.Response:
    return http.patch(url, json=body, params=params, headers={"Content-Type": "application/merge-patch+json"})


def _bearer(controlplane: ControlPlane, token: str) -> httpx2.Client:
    """A client that authenticates with ``token`` only (no client certificate)."""
    context = ssl.create_default_context(cafile=str(controlplane.ca_file))
    return httpx2.Client(
        base_url=controlplane.server,
        verify=context,
        headers={"Authorization": f"Bearer {token}"},
        trust_env=False,
        timeout=10.0,
    )


def _agent_token(admin: httpx2.Client, ns: str, node: str) -> str:
    """The DaemonSet's pod on ``node``, and the token the kubelet would project into it."""
    pod = admin.post(
        f"/api/v1/namespaces/{ns}/pods",
        json={
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "node-agent"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": "gpufrac-node-agent",
                "containers": [{"name": "agent", "image": "gpufrac"}],
            },
        },
    )
    assert pod.status_code == 201, pod.text
    token = admin.post(
        f"/api/v1/namespaces/{ns}/serviceaccounts/gpufrac-node-agent/token",
        json={
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "node-agent",
                    "uid": pod.json()["metadata"]["uid"],
                },
            },
        },
    )
    assert token.status_code == 201, token.text
    return str(token.json()["status"]["token"])


def test_a_node_agent_token_writes_only_its_own_node(
    controlplane: ControlPlane, installed: dict[str, Any]
) -> None:
    ns = installed["namespace"]
    suffix = uuid.uuid4().hex[:6]
    own, other = f"gpu-a-{suffix}", f"gpu-b-{suffix}"
    with controlplane.http() as admin:
        for name in (own, other):
            answer = admin.post(
                "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
            )
            assert answer.status_code == 201, answer.text
        try:
            with _bearer(controlplane, _agent_token(admin, ns, own)) as agent:
                label = {"metadata": {"labels": {"gpufrac.io/test": "1"}}}
                refused = _until_refused(lambda: _merge(agent, f"/api/v1/nodes/{other}", label, dryRun="All"))
                assert refused.status_code == 403, refused.text
                assert (
                    f"may write only its own Node: this token is bound to node {own}, not {other}"
                    in refused.text
                )
                # Its own Node and its status: allowed, for real.
                assert _merge(agent, f"/api/v1/nodes/{own}", label).status_code == 200
                condition = {
                    "status": {"conditions": [{"type": keys.NODE_READY_CONDITION, "status": "True"}]}
                }
                assert _merge(agent, f"/api/v1/nodes/{own}/status", condition).status_code == 200
                # Another node's status, labels or taints: refused, nothing written.
                assert _merge(agent, f"/api/v1/nodes/{other}/status", condition).status_code == 403
                taints = {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}
                assert _merge(agent, f"/api/v1/nodes/{other}", taints).status_code == 403
                after = admin.get(f"/api/v1/nodes/{other}").json()
                assert "gpufrac.io/test" not in (after["metadata"].get("labels") or {})
                assert "x" not in {t["key"] for t in after["spec"].get("taints") or []}
                conditions = (after.get("status") or {}).get("conditions") or []
                assert keys.NODE_READY_CONDITION not in {c["type"] for c in conditions}
                # RBAC: it reads the pods (its watch of its node's pods: live resizes), never Secrets; RBAC
                # cannot narrow the read to its own node's pods (docs/security.md).
                mine = agent.get("/api/v1/pods", params={"fieldSelector": f"spec.nodeName={own}"})
                assert mine.status_code == 200
                assert agent.get(f"/api/v1/namespaces/{ns}/secrets").status_code == 403
        finally:
            for name in (own, other):
                admin.delete(f"/api/v1/nodes/{name}")
    # Without a node-name claim (a token not bound to a pod on a node), no Node at all.
    user = f"system:serviceaccount:{ns}:gpufrac-node-agent"
    with controlplane.http(
        impersonate=user, groups=["system:serviceaccounts", "system:authenticated"]
    ) as agent:
        refused = agent.patch(
            "/api/v1/nodes/anything",
            json={"metadata": {"labels": {"x": "y"}}},
            headers={"Content-Type": "application/merge-patch+json"},
            params={"dryRun": "All"},
        )
        assert refused.status_code in (403, 404)


def _slice(node: str, *, driver: str = keys.DRA_DRIVER_NAME) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def test_a_node_agent_token_writes_only_its_own_nodes_resourceslices_of_our_driver(
    controlplane: ControlPlane, installed: dict[str, Any]
) -> None:
    ns = installed["namespace"]
    suffix = uuid.uuid4().hex[:6]
    own, other = f"gpu-a-{suffix}", f"gpu-b-{suffix}"
    slices = "/apis/resource.k8s.io/v1/resourceslices"
    with controlplane.http() as admin:
        assert admin.post(slices, json=_slice(other)).status_code == 201  # another node's agent wrote it
        try:
            with _bearer(controlplane, _agent_token(admin, ns, own)) as agent:
                refused = _until_refused(
                    lambda: agent.post(slices, json=_slice(other), params={"dryRun": "All"})
                )
                assert refused.status_code == 403, refused.text
                assert (
                    f"may write only ResourceSlices of driver {keys.DRA_DRIVER_NAME} for its own node"
                    in refused.text
                )
                assert f"this token is bound to node {own}" in refused.text
                # Its own node's slice: allowed, for real; another driver's slice on its node, or changing
                # or deleting another node's slice: refused.
                assert agent.post(slices, json=_slice(own)).status_code == 201
                assert agent.post(slices, json=_slice(own, driver="gpu.example.com")).status_code == 403
                bumped = {"spec": {"pool": {"name": other, "generation": 2, "resourceSliceCount": 1}}}
                assert _merge(agent, f"{slices}/{other}-{keys.DRA_DRIVER_NAME}", bumped).status_code == 403
                assert agent.delete(f"{slices}/{other}-{keys.DRA_DRIVER_NAME}").status_code == 403
                assert admin.get(f"{slices}/{other}-{keys.DRA_DRIVER_NAME}").status_code == 200
        finally:
            for node in (own, other):
                admin.delete(f"{slices}/{node}-{keys.DRA_DRIVER_NAME}")


def _lease(node: str, *, namespace: str = keys.NODE_LEASE_NAMESPACE) -> dict[str, Any]:
    """A heartbeat Lease as gpufrac.node.heartbeat.NodeLease writes it: named after its node."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": node, "namespace": namespace},
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": 40,
            "renewTime": "2026-12-01T00:00:00.000000Z",
        },
    }


def test_a_node_agent_token_renews_only_its_own_nodes_heartbeat_lease(
    controlplane: ControlPlane, installed: dict[str, Any]
) -> None:
    """A token stolen from one node cannot keep another (dead) node placeable by renewing its Lease."""
    ns = installed["namespace"]
    suffix = uuid.uuid4().hex[:6]
    own, other = f"gpu-a-{suffix}", f"gpu-b-{suffix}"
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    with controlplane.http() as admin:
        assert admin.post(leases, json=_lease(other)).status_code == 201  # the other node's agent wrote it
        try:
            with _bearer(controlplane, _agent_token(admin, ns, own)) as agent:
                refused = _until_refused(
                    lambda: agent.post(leases, json=_lease(f"{other}-x"), params={"dryRun": "All"})
                )
                assert refused.status_code == 403, refused.text
                assert (
                    "may write only the heartbeat Lease of its own node "
                    f"({keys.NODE_LEASE_NAMESPACE}/<node>): this token is bound to node {own}, "
                    f"not {keys.NODE_LEASE_NAMESPACE}/{other}-x"
                ) in refused.json()["message"]
                # Its own Lease: created and renewed, for real, as the heartbeat does (GET, then PUT).
                assert agent.post(leases, json=_lease(own)).status_code == 201
                mine = agent.get(f"{leases}/{own}").json()
                mine["spec"]["renewTime"] = "2026-12-01T00:01:00.000000Z"
                assert agent.put(f"{leases}/{own}", json=mine).status_code == 200
                # The other node's Lease: neither renewed nor deleted, and its renewTime does not move.
                theirs = admin.get(f"{leases}/{other}").json()
                renewed = {**theirs, "spec": {**theirs["spec"], "renewTime": "2026-12-01T00:02:00.000000Z"}}
                answer = agent.put(f"{leases}/{other}", json=renewed)
                assert answer.status_code == 403, answer.text
                assert f"not {keys.NODE_LEASE_NAMESPACE}/{other}" in answer.text
                assert agent.delete(f"{leases}/{other}").status_code == 403
                after = admin.get(f"{leases}/{other}").json()
                assert after["spec"]["renewTime"] == theirs["spec"]["renewTime"]
        finally:
            for node in (own, other):
                admin.delete(f"{leases}/{node}")


@pytest.fixture
def gpu_pod(controlplane: ControlPlane, installed: dict[str, Any]) -> str:
    """A GPU pod with a label, an unrelated annotation and a user's memory request; returns its URL."""
    ns = installed["namespace"]
    with controlplane.http() as admin:
        answer = admin.post(
            f"/api/v1/namespaces/{ns}/pods",
            json={
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "gpu",
                    "labels": {"team": "a"},
                    "annotations": {keys.memory_request_key(CONTAINER): "10Gi", "example.com/owner": "alice"},
                },
                "spec": {
                    "schedulerName": keys.DEFAULT_SCHEDULER_NAME,
                    "containers": [{"name": CONTAINER, "image": "cuda:1"}],
                },
            },
        )
        assert answer.status_code == 201, answer.text
    return f"/api/v1/namespaces/{ns}/pods/gpu"


def _annotations(changes: dict[str, str | None]) -> dict[str, Any]:
    return {"metadata": {"annotations": changes}}


def test_the_scheduler_writes_only_binder_owned_annotations_of_pods(
    controlplane: ControlPlane, installed: dict[str, Any], gpu_pod: str
) -> None:
    ns = installed["namespace"]
    user = f"system:serviceaccount:{ns}:gpufrac-scheduler"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
    with controlplane.http(impersonate=user, groups=groups) as scheduler:
        stolen = _annotations({keys.memory_request_key(CONTAINER): "80Gi"})
        refused = _until_refused(lambda: _merge(scheduler, gpu_pod, stolen, dryRun="All"))
        assert refused.status_code == 403, refused.text
        assert "may change only the annotations the binder owns" in refused.text
        assert keys.memory_request_key(CONTAINER) in refused.text

        # What the binder writes (patch-then-bind) and how it rolls back: allowed.
        owned = {keys.devices_key(CONTAINER): "GPU-1", keys.compute_portion_key(CONTAINER): "0.5"}
        assert _merge(scheduler, gpu_pod, _annotations(owned)).status_code == 200
        cleared = _annotations({k: None for k in owned})
        assert _merge(scheduler, gpu_pod, cleared).status_code == 200

        # Deciding a resize request: the new memory keys and the request's removal, in one patch; the
        # memory keys of a pod without a request stay refused (above), and so does writing a request.
        resize = keys.resize_key(CONTAINER, keys.RESIZE_MEMORY_REQUEST)
        with controlplane.http() as admin:
            assert _merge(admin, gpu_pod, _annotations({resize: "20Gi"})).status_code == 200
        forged = _merge(scheduler, gpu_pod, _annotations({resize: "40Gi"}))
        assert forged.status_code == 403 and resize in forged.text, forged.text
        decided = {keys.memory_request_key(CONTAINER): "20480Mi", keys.memory_limit_key(CONTAINER): "20480Mi"}
        answer = _merge(scheduler, gpu_pod, _annotations({**decided, resize: None}))
        assert answer.status_code == 200, answer.text
        assert _merge(scheduler, gpu_pod, stolen).status_code == 403  # the request is gone again
        with controlplane.http() as admin:  # back to the pod as created, for the Binding below
            restored = {keys.memory_request_key(CONTAINER): "10Gi", keys.memory_limit_key(CONTAINER): None}
            assert _merge(admin, gpu_pod, _annotations(restored)).status_code == 200

        # Everything else: refused, each with what it tried.
        for body, says in (
            (_annotations({"example.com/owner": "mallory"}), "example.com/owner"),
            (_annotations({"example.com/owner": None}), "example.com/owner"),
            (_annotations({keys.GPU_FRACTION: "1"}), keys.GPU_FRACTION),
            (_annotations({"nvidia.com/container.app.gpus.devices.extra": "x"}), "gpus.devices.extra"),
            ({"metadata": {"labels": {"team": "b"}}}, "labels, finalizers or owners"),
            ({"metadata": {"finalizers": ["example.com/hold"]}}, "labels, finalizers or owners"),
            (
                {"spec": {"containers": [{"name": CONTAINER, "image": "evil:1"}]}},
                "may not change a pod's spec",
            ),
        ):
            answer = _merge(scheduler, gpu_pod, body)
            assert answer.status_code == 403, (body, answer.text)
            assert says in answer.text, (body, answer.text)
        # The status subresource: a condition is fine, an annotation smuggled through it is not.
        condition = {
            "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
        }
        assert _merge(scheduler, f"{gpu_pod}/status", condition).status_code == 200
        smuggled = _merge(scheduler, f"{gpu_pod}/status", _annotations({"example.com/owner": "mallory"}))
        assert smuggled.status_code == 403, smuggled.text

        # A Binding carries annotations onto the pod: only binder-owned ones.
        def binding(annotations: dict[str, str]) -> dict[str, Any]:
            return {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": "gpu", "annotations": annotations},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-0"},
            }

        bad = scheduler.post(f"{gpu_pod}/binding", json=binding({"example.com/owner": "mallory"}))
        assert bad.status_code == 403 and "example.com/owner" in bad.text, bad.text
        # With the memory limit it resolves from gpu-fraction, as binding_annotations writes it (the real
        # install's first fractional pod was refused here).
        resolved = {keys.devices_key(CONTAINER): "GPU-1", keys.memory_limit_key(CONTAINER): "40779Mi"}
        good = scheduler.post(f"{gpu_pod}/binding", json=binding(resolved))
        assert good.status_code == 201, good.text

    with controlplane.http() as admin:
        pod = admin.get(gpu_pod).json()
        assert pod["spec"]["nodeName"] == "gpu-node-0"
        assert pod["spec"]["containers"][0]["image"] == "cuda:1"
        assert pod["metadata"]["labels"] == {"team": "a"}
        annotations = pod["metadata"]["annotations"]
        assert annotations["example.com/owner"] == "alice"
        assert annotations[keys.memory_request_key(CONTAINER)] == "10Gi"
        assert annotations[keys.devices_key(CONTAINER)] == "GPU-1"
        assert annotations[keys.memory_limit_key(CONTAINER)] == "40779Mi"
        # The policies bind the scheduler only: an administrator still changes what it must.
        assert _merge(admin, gpu_pod, _annotations({"example.com/owner": "bob"})).status_code == 200


def test_the_chart_pattern_is_exactly_the_contracts_binder_owned_keys(tmp_path: Path) -> None:
    """The CEL regex in the chart and gpufrac.contract.keys.is_binder_owned agree (RE2 and Python's re
    read this pattern alike: no escapes, no look-arounds)."""
    (policy,) = [
        o
        for o in render(tmp_path=tmp_path)
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("scheduler-pod-writes")
    ]
    (variable,) = [v for v in policy["spec"]["variables"] if v["name"] == "notBinderOwned"]
    pattern = re.search(r"k\.matches\('([^']+)'\)", variable["expression"]).group(1)  # type: ignore[union-attr]
    candidates = [
        keys.devices_key("app"),
        keys.compute_portion_key("app"),
        keys.devices_key("a-1"),
        keys.memory_request_key("app"),
        keys.memory_limit_key("app"),
        keys.compute_mode_key("app"),
        keys.portion_limit_key("app"),
        keys.whole_gpus_key("app"),
        "kai.scheduler/container.app.gpus.devices",
        "nvidia.com/container.app.gpus.devices.x",
        "nvidia.com/container..gpus.devices",
        "xnvidia.com/container.app.gpus.devices",
        *keys.POD_LEVEL_KEYS,
    ]
    for key in candidates:
        assert bool(re.match(pattern, key)) == keys.is_binder_owned(key), key


def test_a_node_agent_token_writes_only_the_memory_condition_of_pods_on_its_own_node(
    controlplane: ControlPlane, installed: dict[str, Any]
) -> None:
    """The agent says GpuMemoryEnforced (and GpuResizeInProgress) on the pods of its node; it cannot touch
    another node's pods, nor any other part of a pod's status (a stolen agent token must not mark a pod
    Ready or Running)."""
    ns = installed["namespace"]
    suffix = uuid.uuid4().hex[:6]
    own, other = f"gpu-a-{suffix}", f"gpu-b-{suffix}"
    condition = keys.POD_MEMORY_ENFORCED_CONDITION

    def status(conditions: list[dict[str, str]]) -> dict[str, Any]:
        return {"status": {"conditions": conditions}}

    with controlplane.http() as admin:
        try:
            for node, pod in ((own, "mine"), (other, "theirs")):
                answer = admin.post(
                    f"/api/v1/namespaces/{ns}/pods",
                    json={
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": pod},
                        "spec": {"nodeName": node, "containers": [{"name": CONTAINER, "image": "x"}]},
                    },
                )
                assert answer.status_code == 201, answer.text
            with _bearer(controlplane, _agent_token(admin, ns, own)) as agent:

                def patch(pod: str, body: dict[str, Any], **params: str) -> httpx2.Response:
                    return agent.patch(
                        f"/api/v1/namespaces/{ns}/pods/{pod}/status",
                        json=body,
                        params=params,
                        headers={"Content-Type": "application/strategic-merge-patch+json"},
                    )

                ours = [{"type": condition, "status": "True", "reason": keys.POD_REASON_LIMITS_READ_BACK}]
                refused = _until_refused(lambda: patch("theirs", status(ours), dryRun="All"))
                assert refused.status_code == 403, refused.text
                assert f"only of pods on its own node: this token is bound to node {own}" in refused.text
                assert patch("mine", status(ours)).status_code == 200
                ready = [{"type": "Ready", "status": "True"}]
                forged = patch("mine", status(ready))
                assert forged.status_code == 403, forged.text
                assert (
                    "may change only the GpuMemoryEnforced and gpufrac.io/GpuResizeInProgress" in forged.text
                )
                resizing = [{"type": RESIZE_CONDITION, "status": "True", "reason": REASON_WAITING_FOR_USAGE}]
                assert patch("mine", status(resizing)).status_code == 200  # a live resize, said
                done = [{"type": RESIZE_CONDITION, "$patch": "delete"}]
                assert patch("mine", status(done)).status_code == 200  # and removed once in force
                assert patch("mine", {"status": {"phase": "Succeeded"}}).status_code == 403
                mine = admin.get(f"/api/v1/namespaces/{ns}/pods/mine").json()
                types = {c["type"]: c["status"] for c in mine["status"].get("conditions") or []}
                assert types.get(condition) == "True" and types.get("Ready") != "True"
        finally:
            for pod in ("mine", "theirs", "node-agent"):
                admin.delete(f"/api/v1/namespaces/{ns}/pods/{pod}")
