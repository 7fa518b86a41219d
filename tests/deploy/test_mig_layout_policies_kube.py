"""Who may write a Node's MIG layout annotations, on the real API server (docs/mig.md, "Layout changes"):
the scheduler changes only ``gpufrac.io/gpu-layout`` (its ask) and nothing else of a Node; a node agent
answers in ``gpufrac.io/gpu-layout-status`` and ``gpufrac.io/gpus`` on its own Node and never changes the
ask; a tenant with rights in its namespace only writes no Node at all (RBAC)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from test_admission_policies_kube import _agent_token, _bearer, _merge, _until_refused, installed  # noqa: F401

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube

LAYOUT = json.dumps({"generation": 1, "gpus": {"GPU-1": {"mode": "mig", "slices": ["3g.40gb@0"]}}})


def _annotations(changes: dict[str, str | None]) -> dict[str, Any]:
    return {"metadata": {"annotations": changes}}


def test_the_scheduler_changes_only_the_layout_ask_and_the_agent_only_answers(
    controlplane: ControlPlane,
    installed: dict[str, Any],  # noqa: F811 - the fixture
) -> None:
    ns = installed["namespace"]
    node = f"gpu-mig-{uuid.uuid4().hex[:6]}"
    url = f"/api/v1/nodes/{node}"
    user = f"system:serviceaccount:{ns}:gpufrac-scheduler"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
    with controlplane.http() as admin:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"a": "b"}}}
        assert admin.post("/api/v1/nodes", json=body).status_code == 201
        try:
            with controlplane.http(impersonate=user, groups=groups) as scheduler:
                inventory = _annotations({keys.NODE_GPUS_ANNOTATION: "[]"})
                refused = _until_refused(lambda: _merge(scheduler, url, inventory, dryRun="All"))
                assert refused.status_code == 403, refused.text
                assert f"may change only the {keys.NODE_GPU_LAYOUT_ANNOTATION} annotation" in refused.text
                assert keys.NODE_GPUS_ANNOTATION in refused.text
                # Its ask: allowed, for real.
                ask = _annotations({keys.NODE_GPU_LAYOUT_ANNOTATION: LAYOUT})
                assert _merge(scheduler, url, ask).status_code == 200
                for forged, says in (
                    (_annotations({keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION: "{}"}), "gpu-layout-status"),
                    ({"metadata": {"labels": {"a": "c"}}}, "spec (taints) or labels"),
                    ({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}, "spec (taints) or labels"),
                ):
                    answer = _merge(scheduler, url, forged)
                    assert answer.status_code == 403 and says in answer.text, (forged, answer.text)
            with _bearer(controlplane, _agent_token(admin, ns, node)) as agent:
                status = _annotations(
                    {
                        keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION: json.dumps({"generation": 1, "gpus": {}}),
                        keys.NODE_GPUS_ANNOTATION: "[]",
                    }
                )
                assert _merge(agent, url, status).status_code == 200
                rewrite = _annotations(
                    {keys.NODE_GPU_LAYOUT_ANNOTATION: LAYOUT.replace("3g.40gb", "7g.80gb")}
                )
                answer = _merge(agent, url, rewrite)
                assert answer.status_code == 403, answer.text
                assert f"may not change {keys.NODE_GPU_LAYOUT_ANNOTATION}" in answer.text
                cleared = _merge(agent, url, _annotations({keys.NODE_GPU_LAYOUT_ANNOTATION: None}))
                assert cleared.status_code == 403, cleared.text
            after = admin.get(url).json()["metadata"]
            assert after["annotations"][keys.NODE_GPU_LAYOUT_ANNOTATION] == LAYOUT
            assert after["labels"]["a"] == "b"
        finally:
            admin.delete(url)


def test_a_tenant_with_namespaced_rights_writes_no_node_layout(
    controlplane: ControlPlane,
    installed: dict[str, Any],  # noqa: F811 - the fixture
) -> None:
    ns = installed["namespace"]
    node = f"gpu-mig-{uuid.uuid4().hex[:6]}"
    with controlplane.http() as admin:
        assert (
            admin.post(
                "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
            ).status_code
            == 201
        )
        role = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "tenant", "namespace": ns},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["create", "get", "list", "patch", "update"],
                }
            ],
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "tenant", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
        }
        assert (
            admin.post(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", json=role).status_code
            == 201
        )
        assert (
            admin.post(
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", json=binding
            ).status_code
            == 201
        )
        try:
            user = f"system:serviceaccount:{ns}:tenant"
            groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
            with controlplane.http(impersonate=user, groups=groups) as tenant:
                ask = _annotations({keys.NODE_GPU_LAYOUT_ANNOTATION: LAYOUT})
                answer = _merge(tenant, f"/api/v1/nodes/{node}", ask)
                assert answer.status_code == 403, answer.text
                assert 'cannot patch resource "nodes"' in answer.json()["message"]
            after = admin.get(f"/api/v1/nodes/{node}").json()["metadata"]
            assert keys.NODE_GPU_LAYOUT_ANNOTATION not in (after.get("annotations") or {})
        finally:
            admin.delete(f"/api/v1/nodes/{node}")
