"""The two webhook configurations (admissionregistration.k8s.io/v1) that put the webhook in the path.

failurePolicy is Fail: a GPU pod admitted without validation could forge a device assignment or carry a
request the scheduler and node agent would disagree about. So the webhook must never be in the path of
ordinary pods, or a webhook outage would stop a cluster: matchConditions (GA since Kubernetes 1.30)
send only what can matter to it. A CREATE goes to the webhook when the pod mentions the contract (any
contract annotation, or an ``nvidia.com/gpu`` resource) or names a queue (the mutating webhook also when
an annotation may be a misspelled contract key, to warn about it); an UPDATE only when it changes a
contract annotation (adds, removes or rewrites one, compared between ``object`` and ``oldObject``) or a
queue label: the webhook allows every other update anyway, so sending it one would only let a webhook
outage fail the kubelet's status writes and every other label or finalizer edit of a GPU pod. A CEL
expression that fails to evaluate counts as an error under failurePolicy Fail, so every field access is
guarded with ``has()``.

Every door to a pod's annotations is covered (docs/security.md lists them with their tests):

* ``pods`` CREATE and UPDATE (update and patch), through the validating webhook above;
* ``pods/status`` UPDATE: the status strategy keeps the spec but takes the new metadata, so a status
  patch can rewrite annotations. It is judged exactly as an update of ``pods``;
* Bindings, through two endpoints: the ``pods/binding`` subresource and the namespaced ``bindings``
  resource (``POST /api/v1/namespaces/{ns}/bindings``, what older clients use). The API server merges a
  Binding's annotations into the pod in the update that sets its node (how the scheduler binds
  atomically), an update that never passes through a webhook for ``pods``. So a second webhook takes
  CREATE of both, and its matchCondition sends it only Bindings that carry a contract annotation:
  ordinary bindings (kube-scheduler's, any other scheduler's) carry none and never depend on it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufrac.contract import keys as k
from gpufrac.contract.near_miss import OWN_NAMESPACES

MUTATE_WEBHOOK = "mutate.gpufrac.io"
VALIDATE_WEBHOOK = "validate.gpufrac.io"
VALIDATE_BINDING_WEBHOOK = "validate-binding.gpufrac.io"


@dataclass(frozen=True, slots=True)
class ServiceRef:
    """A webhook reached through a Service (in a cluster)."""

    namespace: str
    name: str
    port: int = 443


def _is_contract_key(key: str) -> str:
    """CEL: the string ``key`` is a contract key (``keys.is_contract_key``, exactly)."""
    prefixes = " || ".join(f"{key}.startsWith('{prefix}')" for prefix in k.CONTAINER_PREFIXES)
    pod_keys = ", ".join(f"'{name}'" for name in k.POD_LEVEL_KEYS)
    return f"{prefixes} || {key} in [{pod_keys}]"


def _carries_contract_annotation(var: str) -> str:
    """CEL: the object in ``var`` has a contract annotation. ``exists`` on a map iterates its keys."""
    annotations = f"{var}.metadata.annotations"
    return f"(has({annotations}) && {annotations}.exists(key, {_is_contract_key('key')}))"


def _mentions_gpu(var: str) -> str:
    """CEL: the object in ``var`` carries a contract annotation or asks for ``nvidia.com/gpu`` or a
    ``nvidia.com/mig-<profile>``."""
    annotations = _carries_contract_annotation(var)
    resource = f"'{k.GPU_RESOURCE}'"

    def asks(section: str) -> str:
        mig = f"c.resources.{section}.exists(r, r.startsWith('{k.MIG_RESOURCE_PREFIX}'))"
        return f"(has(c.resources.{section}) && ({resource} in c.resources.{section} || {mig}))"

    containers = (
        f"(has({var}.spec.containers) && {var}.spec.containers.exists(c, has(c.resources) && ("
        f"{asks('limits')} || {asks('requests')})))"
    )
    return f"{annotations} || {containers}"


def _may_misspell_contract_key(var: str) -> str:
    """CEL: the object in ``var`` has an annotation that may be one slip away from a contract key
    (``contract.near_miss``): without a prefix and starting with ``gpu`` in any case, or under one of the
    contract's namespaces. The mutating webhook then returns ``near_miss_warnings`` (``kubectl`` prints
    them); a pod whose only GPU key is misspelled would otherwise never reach it."""
    annotations = f"{var}.metadata.annotations"
    namespaces = " || ".join(f"key.startsWith('{n}/')" for n in OWN_NAMESPACES)
    keys = f"(!key.contains('/') && key.lowerAscii().startsWith('gpu')) || {namespaces}"
    return f"(has({annotations}) && {annotations}.exists(key, {keys}))"


def _changes_contract_keys() -> str:
    """CEL: ``object`` and ``oldObject`` differ in a contract annotation (``changes.changed_contract_keys``
    is not empty): one of ``object``'s is missing from or different in ``oldObject``, or one of
    ``oldObject``'s is missing from ``object``."""
    new, old = "object.metadata.annotations", "oldObject.metadata.annotations"
    added_or_changed = (
        f"(has({new}) && {new}.exists(key, ({_is_contract_key('key')}) && "
        f"!(has({old}) && key in {old} && {old}[key] == {new}[key])))"
    )
    removed = (
        f"(has({old}) && {old}.exists(key, ({_is_contract_key('key')}) && !(has({new}) && key in {new})))"
    )
    return f"{added_or_changed} || {removed}"


def _names_queue(var: str) -> str:
    """CEL: the object in ``var`` carries a queue label (``gpufrac.io/queue`` or ``kai.scheduler/queue``)."""
    labels = f"{var}.metadata.labels"
    named = " || ".join(f"'{key}' in {labels}" for key in (k.QUEUE_LABEL, k.KAI_QUEUE_LABEL))
    return f"(has({labels}) && ({named}))"


def _changes_queue_labels() -> str:
    """CEL: ``object`` and ``oldObject`` differ in a queue label (added, removed or rewritten)."""

    def value(var: str, key: str) -> str:
        labels = f"{var}.metadata.labels"
        return f"((has({labels}) && '{key}' in {labels}) ? {labels}['{key}'] : '')"

    return " || ".join(
        f"{value('object', key)} != {value('oldObject', key)}" for key in (k.QUEUE_LABEL, k.KAI_QUEUE_LABEL)
    )


def match_expression(*, include_old: bool) -> str:
    """The matchConditions CEL: true for pods the webhook must see.

    Without ``include_old`` (the mutating webhook: CREATE only), the pods that mention a GPU. With it (the
    validating webhook), a CREATE of such a pod or of one that names a queue, or an UPDATE that changes a
    contract annotation or a queue label (relabelling a pod across queues is judged: docs/queues.md).
    """
    if not include_old:
        return f"{_mentions_gpu('object')} || {_may_misspell_contract_key('object')}"
    creating = f"oldObject == null && ({_mentions_gpu('object')} || {_names_queue('object')})"
    updating = f"oldObject != null && ({_changes_contract_keys()} || {_changes_queue_labels()})"
    return f"({creating}) || ({updating})"


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
                "rules": [
                    _pod_rule(["CREATE", "UPDATE"]),
                    _pod_rule(["UPDATE"], resource="pods/status"),
                ],
                "matchConditions": [{"name": "gpu-pods", "expression": match_expression(include_old=True)}],
                **common,
            },
            {
                "name": VALIDATE_BINDING_WEBHOOK,
                "clientConfig": _client_config(ca_bundle, url, service, "/validate"),
                "rules": [
                    _pod_rule(["CREATE"], resource="pods/binding"),
                    _pod_rule(["CREATE"], resource="bindings"),
                ],
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
