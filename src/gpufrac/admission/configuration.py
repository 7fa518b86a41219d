"""The two webhook configurations (admissionregistration.k8s.io/v1) that put the webhook in the path.

failurePolicy is Fail: a GPU pod admitted without validation could forge a device assignment or carry a
request the scheduler and node agent would disagree about. So the webhook must never be in the path of
ordinary pods, or a webhook outage would stop a cluster: matchConditions (GA since Kubernetes 1.30)
send only pods that mention the contract (any contract annotation, or an ``nvidia.com/gpu`` resource) to
it, and for updates also pods whose OLD object did (so removing the binder-owned keys is guarded too).
A CEL expression that fails to evaluate counts as an error under failurePolicy Fail, so every field
access is guarded with ``has()``.

The Binding subresource is a second door to a pod's annotations: the API server merges a Binding's
annotations into the pod in the update that sets its node (how the scheduler binds atomically), and
that update never passes through an admission webhook for ``pods``. So the validating configuration
holds a second webhook for CREATE of ``pods/binding``, whose matchCondition sends it only Bindings that
carry a contract annotation: ordinary bindings (kube-scheduler's, any other scheduler's) carry none and
never depend on the webhook.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufrac.contract import keys as k

MUTATE_WEBHOOK = "mutate.gpufrac.io"
VALIDATE_WEBHOOK = "validate.gpufrac.io"
VALIDATE_BINDING_WEBHOOK = "validate-binding.gpufrac.io"


@dataclass(frozen=True, slots=True)
class ServiceRef:
    """A webhook reached through a Service (in a cluster)."""

    namespace: str
    name: str
    port: int = 443


def _carries_contract_annotation(var: str) -> str:
    """CEL: the object in ``var`` has an annotation whose key may be a contract key (a superset of
    ``keys.is_contract_key``: the webhook itself decides). ``exists`` on a map iterates its keys."""
    prefixes = " || ".join(f"key.startsWith('{prefix}')" for prefix in k.CONTAINER_PREFIXES)
    pod_keys = ", ".join(f"'{key}'" for key in k.POD_LEVEL_KEYS)
    return (
        f"(has({var}.metadata.annotations) && "
        f"{var}.metadata.annotations.exists(key, {prefixes} || key in [{pod_keys}]))"
    )


def _mentions_gpu(var: str) -> str:
    """CEL: the object in ``var`` carries a contract annotation or asks for ``nvidia.com/gpu``."""
    annotations = _carries_contract_annotation(var)
    resource = f"'{k.GPU_RESOURCE}'"
    containers = (
        f"(has({var}.spec.containers) && {var}.spec.containers.exists(c, has(c.resources) && ("
        f"(has(c.resources.limits) && {resource} in c.resources.limits) || "
        f"(has(c.resources.requests) && {resource} in c.resources.requests))))"
    )
    return f"{annotations} || {containers}"


def match_expression(*, include_old: bool) -> str:
    """The matchConditions CEL: true for pods the webhook must see."""
    expression = _mentions_gpu("object")
    if include_old:
        expression = f"({expression}) || (oldObject != null && ({_mentions_gpu('oldObject')}))"
    return expression


def binding_match_expression() -> str:
    """The matchConditions CEL of the Binding webhook: true for Bindings that would write a contract key
    onto the pod."""
    return _carries_contract_annotation("object")


def _client_config(
    ca_bundle: bytes, url: str | None, service: ServiceRef | None, path: str
) -> dict[str, Any]:
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    config: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle).decode()}
    if url is not None:
        config["url"] = url.rstrip("/") + path
    else:
        assert service is not None
        config["service"] = {
            "namespace": service.namespace,
            "name": service.name,
            "port": service.port,
            "path": path,
        }
    return config


def webhook_configurations(
    *,
    name: str,
    ca_bundle: bytes,
    url: str | None = None,
    service: ServiceRef | None = None,
    namespace_selector: Mapping[str, Any] | None = None,
    timeout_seconds: int = 5,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MutatingWebhookConfiguration and ValidatingWebhookConfiguration named ``name``.

    ``url`` (``https://host:port``, paths are appended) or ``service`` says where the webhook listens;
    ``ca_bundle`` is the PEM of the CA that signed its certificate. ``namespace_selector`` narrows the
    namespaces further (tests use it to stay out of each other's way).
    """
    selector = dict(namespace_selector) if namespace_selector is not None else {}
    common: dict[str, Any] = {
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Fail",
        "timeoutSeconds": timeout_seconds,
        "namespaceSelector": selector,
        "objectSelector": {},
    }
    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpufrac"}},
        "webhooks": [
            {
                "name": MUTATE_WEBHOOK,
                "clientConfig": _client_config(ca_bundle, url, service, "/mutate"),
                "rules": [_pod_rule(["CREATE"])],
                "matchConditions": [{"name": "gpu-pods", "expression": match_expression(include_old=False)}],
                "reinvocationPolicy": "IfNeeded",
                **common,
            }
        ],
    }
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpufrac"}},
        "webhooks": [
            {
                "name": VALIDATE_WEBHOOK,
                "clientConfig": _client_config(ca_bundle, url, service, "/validate"),
                "rules": [_pod_rule(["CREATE", "UPDATE"])],
                "matchConditions": [{"name": "gpu-pods", "expression": match_expression(include_old=True)}],
                **common,
            },
            {
                "name": VALIDATE_BINDING_WEBHOOK,
                "clientConfig": _client_config(ca_bundle, url, service, "/validate"),
                "rules": [_pod_rule(["CREATE"], resource="pods/binding")],
                "matchConditions": [{"name": "gpu-bindings", "expression": binding_match_expression()}],
                **common,
            },
        ],
    }
    return mutating, validating


def _pod_rule(operations: list[str], *, resource: str = "pods") -> dict[str, Any]:
    return {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": operations,
        "resources": [resource],
        "scope": "Namespaced",
    }
