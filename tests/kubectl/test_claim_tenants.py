"""DRA claim pods are tenants to `kubectl gpufrac nodes` and `explain`, read with the node's own reader.

Before, a GPU that a claim of our driver held showed free, `explain` said "no GPU" for its pod."""

from __future__ import annotations

import json
from typing import Any

from lightkube import codecs
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.contract.dra import class_config, device_name
from gpufrac.kubectl.view import explain, gpu_rows

GPUS = [
    {"uuid": "GPU-0f0e0d0c-0000-4000-8000-000000000001", "index": 0, "model": "H100-80GB", "mib": 81559},
    {"uuid": "GPU-0f0e0d0c-0000-4000-8000-000000000002", "index": 1, "model": "H100-80GB", "mib": 81559},
]


def node(name: str = "gpu-a") -> Node:
    return codecs.from_dict(  # type: ignore[return-value]
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "annotations": {keys.NODE_GPUS_ANNOTATION: json.dumps(GPUS)}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def claim(*, pool: str = "gpu-a", memory: str | None = "20Gi", pod: str = "infer") -> dict[str, Any]:
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": keys.DRA_DRIVER_NAME,
        "pool": pool,
        "device": device_name(GPUS[1]["uuid"], 1),
    }
    if memory is not None:
        result["consumedCapacity"] = {"memory": memory}
    return {
        "metadata": {"name": "share", "namespace": "team-a", "uid": "claim-uid"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [result, {**result, "driver": "other.example.com"}],
                    "config": [class_config("time-slicing")],
                }
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": "pod-uid"}],
        },
    }


def test_a_claims_share_is_a_tenant_of_the_gpu_it_names() -> None:
    rows, warnings = gpu_rows([node()], [], [claim()])
    assert warnings == []
    first, second = rows
    assert first.tenants == []
    (tenant,) = second.tenants
    assert (tenant.namespace, tenant.pod, tenant.container, tenant.mode) == (
        "team-a",
        "infer",
        "share/gpu",
        "time-slicing",
    )
    assert (tenant.request_mib, second.free_mib) == (20480, 81559 - 20480)
    assert tenant.enforced == "Unknown"  # the agent reads back annotation fractions' limits only


def test_a_whole_gpu_claim_takes_the_gpu_and_a_claim_of_another_node_is_not_here() -> None:
    rows, _ = gpu_rows([node()], [], [claim(memory=None), claim(pool="gpu-b")])
    (tenant,) = rows[1].tenants
    assert tenant.mode == "exclusive" and rows[1].free_mib == 0


def test_explain_shows_the_pods_claim_shares() -> None:
    pod = codecs.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "infer", "namespace": "team-a", "uid": "pod-uid"},
            "spec": {
                "nodeName": "gpu-a",
                "containers": [{"name": "app", "image": "x"}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "share"}],
            },
            "status": {"phase": "Running"},
        }
    )
    result = explain(pod, node=node(), events=[], claims=[claim()])  # type: ignore[arg-type]
    assert result.request == "DRA claim(s) share"
    assert result.gpus == [
        {
            "container": "share/gpu",
            "gpu": 1,
            "uuid": GPUS[1]["uuid"],
            "mode": "time-slicing",
            "requestMiB": 20480,
            "limitMiB": 20480,
        }
    ]
    assert result.fit == []
