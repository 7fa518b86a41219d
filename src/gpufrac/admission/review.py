"""AdmissionReview in, AdmissionReview out: the webhook's decisions, with no server around them.

Validating (CREATE and UPDATE of pods):
* CREATE: the pod's GPU request must parse; anyone but the scheduler is a user, for whom the binder-owned
  keys (devices, compute portion) are violations.
* UPDATE: an update that leaves the contract keys alone is always allowed, even for a pod whose
  annotations are invalid (it may predate the webhook; blocking it would also block removing its
  finalizers). Otherwise only the scheduler may change contract keys, and the result must parse.
* CREATE of a Binding (the ``pods/binding`` subresource): its annotations are merged into the pod by the
  update that sets the node, an update no ``pods`` webhook sees. So a Binding is an update of those keys:
  only the scheduler's may carry contract keys, and anyone else's is refused with the same messages.

Mutating (CREATE of pods that ask for a GPU): legacy pod-level forms become per-container keys; on pods of
our scheduler, ``nvidia.com/gpu: N`` becomes the exclusive ``gpufrac.io/container.<c>.gpus`` key with the
resource removed, and the managed-node toleration is added. An invalid pod is passed through untouched:
the validating webhook rejects it with the contract's message, which names the keys the user wrote.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufrac.contract import keys as k
from gpufrac.contract.changes import changed_contract_keys, forbidden_changes
from gpufrac.contract.errors import InvalidPodRequest, RuleViolation
from gpufrac.contract.parse import ContainerSpec, container_specs, parse_pod
from gpufrac.contract.translate import translate

DEFAULT_SCHEDULER_USER = "system:serviceaccount:gpufrac-system:gpufrac-scheduler"


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Who the scheduler is: the pods it schedules, and the users allowed to write binder-owned keys."""

    scheduler_name: str = k.DEFAULT_SCHEDULER_NAME
    binder_users: frozenset[str] = field(default_factory=lambda: frozenset({DEFAULT_SCHEDULER_USER}))


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    code: int = 200
    reason: str = ""
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)


def _response(review: Mapping[str, Any], verdict: Verdict) -> dict[str, Any]:
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {"code": verdict.code, "reason": verdict.reason, "message": verdict.message}
    if verdict.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(verdict.patch).encode()).decode()
    return {
        "apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": "AdmissionReview",
        "response": response,
    }


def _is_pod(request: Mapping[str, Any]) -> bool:
    kind = request.get("kind") or {}
    return kind.get("group", "") == "" and kind.get("kind") == "Pod" and not request.get("subResource")


def _is_binding(request: Mapping[str, Any]) -> bool:
    kind = request.get("kind") or {}
    resource = request.get("resource") or {}
    return (
        kind.get("group", "") == ""
        and kind.get("kind") == "Binding"
        and resource.get("resource") == "pods"
        and request.get("subResource") == "binding"
    )


def _annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    metadata = (obj or {}).get("metadata") or {}
    return {str(key): str(value) for key, value in (metadata.get("annotations") or {}).items()}


def _invalid(error: InvalidPodRequest) -> Verdict:
    return Verdict(allowed=False, code=422, reason="Invalid", message=str(error))


def validate_review(review: Mapping[str, Any], policy: AdmissionPolicy) -> dict[str, Any]:
    """The validating webhook's answer to ``review``."""
    return _response(review, decide_validate(review.get("request") or {}, policy))


def _forbidden(violations: list[RuleViolation]) -> Verdict:
    return Verdict(allowed=False, code=403, reason="Forbidden", message=str(InvalidPodRequest(violations)))


def decide_validate(request: Mapping[str, Any], policy: AdmissionPolicy) -> Verdict:
    user = str((request.get("userInfo") or {}).get("username", ""))
    is_binder = user in policy.binder_users
    if _is_binding(request) and request.get("operation") == "CREATE":
        return _decide_binding(request, is_binder=is_binder)
    if not _is_pod(request) or request.get("operation") not in ("CREATE", "UPDATE"):
        return Verdict(allowed=True)
    pod = request.get("object") or {}
    new = _annotations(pod)
    if request["operation"] == "UPDATE":
        old = _annotations(request.get("oldObject"))
        if not changed_contract_keys(old, new):
            return Verdict(allowed=True)
        if not is_binder:
            return _forbidden(forbidden_changes(old, new, creating=False))
    try:
        parse_pod(new, container_specs(pod.get("spec") or {}), user_written=not is_binder)
    except InvalidPodRequest as error:
        return _invalid(error)
    return Verdict(allowed=True)


def _decide_binding(request: Mapping[str, Any], *, is_binder: bool) -> Verdict:
    """A Binding writes its annotations onto an existing pod: for anyone but the scheduler, every contract
    key in it is a forbidden change (the pod's current annotations are not in the review, so a key is
    judged as if it were new; rewriting a value the pod already has through a Binding is refused too)."""
    if is_binder:
        return Verdict(allowed=True)
    violations = forbidden_changes({}, _annotations(request.get("object")), creating=False)
    return _forbidden(violations) if violations else Verdict(allowed=True)


def mutate_review(review: Mapping[str, Any], policy: AdmissionPolicy) -> dict[str, Any]:
    """The mutating webhook's answer to ``review``: always allowed, with a JSONPatch when needed."""
    return _response(review, decide_mutate(review.get("request") or {}, policy))


def decide_mutate(request: Mapping[str, Any], policy: AdmissionPolicy) -> Verdict:
    if not _is_pod(request) or request.get("operation") != "CREATE":
        return Verdict(allowed=True)
    pod = request.get("object") or {}
    spec = pod.get("spec") or {}
    annotations = _annotations(pod)
    try:
        containers = container_specs(spec)
        wants_gpu = parse_pod(annotations, containers).wants_gpu
        ours = spec.get("schedulerName") == policy.scheduler_name
        translation = translate(annotations, containers, whole_gpus=ours) if wants_gpu else None
    except InvalidPodRequest:
        return Verdict(allowed=True)  # the validating webhook rejects it, naming the user's own keys
    if translation is None:
        return Verdict(allowed=True)

    changes: dict[str, str | None] = dict(translation.annotations)
    changes.update(_required_plugins(annotations, changes, containers))

    patch: list[dict[str, Any]] = []
    if changes:
        if "annotations" not in (pod.get("metadata") or {}) or pod["metadata"]["annotations"] is None:
            stored = {key: value for key, value in changes.items() if value is not None}
            patch.append({"op": "add", "path": "/metadata/annotations", "value": stored})
        else:
            for key, value in sorted(changes.items()):
                path = "/metadata/annotations/" + _escape(key)
                if value is None:
                    patch.append({"op": "remove", "path": path})
                else:
                    patch.append({"op": "add", "path": path, "value": value})
    for index, container in enumerate(spec.get("containers") or []):
        if container.get("name") not in translation.strip_gpu_resource:
            continue
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            if k.GPU_RESOURCE in (resources.get(section) or {}):
                path = f"/spec/containers/{index}/resources/{section}/{_escape(k.GPU_RESOURCE)}"
                patch.append({"op": "remove", "path": path})
    if ours and not _tolerates_managed(spec.get("tolerations") or []):
        if spec.get("tolerations") is None:
            patch.append({"op": "add", "path": "/spec/tolerations", "value": [k.managed_toleration()]})
        else:
            patch.append({"op": "add", "path": "/spec/tolerations/-", "value": k.managed_toleration()})
    return Verdict(allowed=True, patch=patch)


def _required_plugins(
    annotations: Mapping[str, str], changes: Mapping[str, str | None], containers: list[ContainerSpec]
) -> dict[str, str]:
    """NRI's required-plugins annotation for every container the node agent will enforce limits on.

    A runtime with NRI's validator on then refuses to create such a container while the node agent is
    not connected (``k.NRI_REQUIRED_PLUGINS_PREFIX``), instead of starting it without its limits. The
    containers are those the node's own parse finds in the stored annotations (the node sees no
    resources), so a whole-GPU pod left to the device plugin requires nothing. Always written: a user's
    own value cannot drop the requirement.
    """
    stored = {key: value for key, value in {**annotations, **changes}.items() if value is not None}
    try:
        enforced = parse_pod(stored, [ContainerSpec(name=c.name) for c in containers]).containers
    except InvalidPodRequest:
        return {}
    return {k.nri_required_plugins_key(c.container): k.nri_required_plugins_value() for c in enforced}


def _escape(key: str) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _tolerates_managed(tolerations: list[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        effect_ok = toleration.get("effect") in (None, "", k.MANAGED_TAINT_EFFECT)
        operator = toleration.get("operator") or "Equal"
        if not effect_ok:
            continue
        if not toleration.get("key") and operator == "Exists":
            return True
        if toleration.get("key") == k.MANAGED_TAINT_KEY and (
            operator == "Exists" or toleration.get("value") == k.MANAGED_TAINT_VALUE
        ):
            return True
    return False
