"""Writes to objects that others write too: preconditioned merge patches and status conditions.

A merge patch that carries ``metadata.resourceVersion`` is applied only if the object is still at that
version, otherwise the server answers 409 (``Conflict``). The scheduler writes binder-owned annotations
this way so that it never annotates a pod it has not seen in its latest form, and rolls them back the
same way so that a rollback never erases a newer write.

Conditions go through the status subresource as a strategic merge patch: the API merges
``status.conditions`` by ``type``, so setting PodScheduled leaves the kubelet's conditions alone. They,
and a preemptor's ``nominatedNodeName``, are written on the lean path (``kube.stream.patch_object``)
and answer the pod's new resourceVersion, not the pod: in a preemption burst the scheduler writes one
per unschedulable pod, victim and preemptor, and through lightkube's httpx client they were an eighth of
its event loop.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, TypeVar

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from gpufrac.kube.errors import api_errors
from gpufrac.kube.stream import patch_object

T = TypeVar("T")


async def merge_patch(
    client: AsyncClient,
    resource: type[T],
    *,
    name: str,
    namespace: str | None = None,
    patch: dict[str, Any],
    resource_version: str | None = None,
) -> T:
    """Apply a JSON merge patch; with ``resource_version`` only to that version (else ``Conflict``).

    A key whose value is None is removed from the object (merge-patch semantics).
    """
    body = _at_version(patch, resource_version)
    with api_errors():
        return await client.patch(  # type: ignore[no-any-return]
            resource, name, body, namespace=namespace, patch_type=PatchType.MERGE
        )


async def merge_patch_version(
    client: AsyncClient,
    resource: type,
    *,
    name: str,
    namespace: str | None = None,
    patch: dict[str, Any],
    resource_version: str | None = None,
) -> str:
    """``merge_patch`` for a write made per pod (a DRA claim's finalizer and allocation): the patched
    object's new resourceVersion instead of the object, sent on the lean path (``kube.stream``)."""
    return await patch_object(
        client, resource, name=name, namespace=namespace, patch=_at_version(patch, resource_version)
    )


def _at_version(patch: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
    """The patch with ``metadata.resourceVersion`` set: the server applies it only at that version."""
    body = dict(patch)
    if resource_version is not None:
        metadata = dict(body.get("metadata") or {})
        metadata["resourceVersion"] = resource_version
        body["metadata"] = metadata
    return body


async def set_annotations(
    client: AsyncClient,
    resource: type[T],
    *,
    name: str,
    namespace: str | None = None,
    annotations: dict[str, str | None],
    resource_version: str | None = None,
) -> T:
    """Set (or, with a None value, remove) annotations, optionally only at ``resource_version``."""
    return await merge_patch(
        client,
        resource,
        name=name,
        namespace=namespace,
        patch={"metadata": {"annotations": annotations}},
        resource_version=resource_version,
    )


async def set_pod_condition(
    client: AsyncClient,
    *,
    name: str,
    namespace: str,
    type: str,
    status: str,
    reason: str,
    message: str,
    resource_version: str | None = None,
) -> str:
    """Set one condition of a pod's status (merged by ``type``), stamping the transition time now; the
    pod's new resourceVersion.

    ``resource_version``: only if the pod is still at that version (else ``Conflict``), so a report
    about the pod as it was never overwrites what happened since (e.g. a bind that landed first)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": type,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
        "lastProbeTime": None,
    }
    patch = {"status": {"conditions": [condition]}}
    return await patch_object(
        client,
        Pod.Status,
        name=name,
        namespace=namespace,
        patch=_at_version(patch, resource_version),
        patch_type=PatchType.STRATEGIC,
    )


async def remove_pod_condition(client: AsyncClient, *, name: str, namespace: str, type: str) -> str:
    """Remove one condition from a pod's status (strategic merge: ``$patch: delete`` on the conditions
    list, whose merge key is ``type``); removing one that is not there changes nothing. The pod's new
    resourceVersion."""
    return await patch_object(
        client,
        Pod.Status,
        name=name,
        namespace=namespace,
        patch={"status": {"conditions": [{"type": type, "$patch": "delete"}]}},
        patch_type=PatchType.STRATEGIC,
    )


async def set_nominated_node(client: AsyncClient, *, name: str, namespace: str, node: str | None) -> str:
    """Set (or, with None, clear) ``status.nominatedNodeName``: where a preempting pod is headed. The
    pod's new resourceVersion."""
    return await patch_object(
        client,
        Pod.Status,
        name=name,
        namespace=namespace,
        patch={"status": {"nominatedNodeName": node}},
        patch_type=PatchType.MERGE,
    )
