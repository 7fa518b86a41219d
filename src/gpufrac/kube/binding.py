"""The Binding subresource: the one write that assigns a pod to a node.

The API server checks the preconditions carried in the Binding's metadata: ``uid`` (the pod was not
deleted and recreated under the same name) and ``resourceVersion`` (the pod is exactly the version the
binder annotated). A pod already bound answers 409, so a pod can be bound once, whoever tries.
Annotations in the Binding's metadata are merged into the pod's by the same update that sets
``spec.nodeName`` (kube-apiserver's BindingREST), which is how a binder writes them atomically.
"""

from __future__ import annotations

from lightkube import AsyncClient
from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.stream import post_subresource


async def bind_pod(
    client: AsyncClient,
    *,
    name: str,
    namespace: str,
    node: str,
    uid: str | None = None,
    resource_version: str | None = None,
    annotations: dict[str, str] | None = None,
) -> None:
    """Bind; ``annotations`` are merged into the pod's in the same update that sets its node."""
    binding = Pod.Binding(
        metadata=ObjectMeta(
            name=name,
            namespace=namespace,
            uid=uid,
            resourceVersion=resource_version,
            annotations=annotations or None,
        ),
        target=ObjectReference(apiVersion="v1", kind="Node", name=node),
    )
    await post_subresource(client, binding, name=name, namespace=namespace)
