"""AdmissionReviews and pods as the API server sends them, and a JSON Patch applier to read answers."""

from __future__ import annotations

import copy
from typing import Any


def pod(
    annotations: dict[str, str] | None = None, *, gpus: int = 0, scheduler: str = "gpufrac-scheduler"
) -> dict:
    container: dict[str, Any] = {"name": "app", "image": "busybox"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "1"}}
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"schedulerName": scheduler, "containers": [container, {"name": "side", "image": "busybox"}]},
    }
    if annotations is not None:
        manifest["metadata"]["annotations"] = annotations
    return manifest


def review(obj: dict, *, operation: str = "CREATE", old: dict | None = None, user: str = "alice") -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "userInfo": {"username": user},
            "object": obj,
            "oldObject": old,
        },
    }


def apply_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 add/remove, enough to see what the API server would store."""
    result = copy.deepcopy(document)
    for op in operations:
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target: Any = result
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        if op["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        elif isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
        else:
            target[last] = op["value"]
    return result


def binding_review(annotations: dict[str, str] | None = None, *, user: str = "alice") -> dict:
    """CREATE of the ``pods/binding`` subresource, as the API server sends it: the object is the Binding."""
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Binding"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "binding",
            "name": "p",
            "namespace": "ns",
            "operation": "CREATE",
            "userInfo": {"username": user},
            "object": {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": metadata,
                "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
            },
            "oldObject": None,
        },
    }
