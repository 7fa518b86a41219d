"""AdmissionReview in, AdmissionReview out: the webhook's decisions, with no server around them.

Validating (CREATE and UPDATE of pods):
* CREATE: the pod's GPU request must parse; anyone but the scheduler is a user, for whom the binder-owned
  keys (devices, compute portion) are violations.
* UPDATE: an update that leaves the contract keys alone is always allowed, even for a pod whose
  annotations are invalid (it may predate the webhook; blocking it would also block removing its
  finalizers). Otherwise only the scheduler may change contract keys, and the result must parse; the one
  exception is a resize request (``gpufrac.contract.resize``): on a pod already placed
  (``spec.nodeName`` set), anyone who may update the pod may add, change or remove the
  ``gpufrac.io/container.<c>.resize.*`` keys of a fractional container, with values valid as at creation.
* UPDATE of ``pods/status``: the status strategy takes the new metadata, so a status write can change
  annotations. It is judged exactly as an UPDATE of the pod: only the scheduler may change contract keys
  there (it never needs to; the kubelet and every other status writer never may).
* CREATE of a Binding (the ``pods/binding`` subresource, or the namespaced ``bindings`` resource): its
  annotations are merged into the pod by the update that sets the node, an update no ``pods`` webhook
  sees. So a Binding is an update of those keys: only the scheduler's may carry contract keys, and
  anyone else's is refused with the same messages.

Queues (CREATE and UPDATE of pods of our scheduler, when the policy has a ``QueueBook``): a pod that names
a queue its namespace may not use, or whose priority is above the queue's bound, is refused with the
sentence of ``gpufrac.placement.queue_access`` (the rule the scheduler applies too); a pod naming none is
judged in its namespace's default queue. An UPDATE is judged when it changes a queue label (relabelling
a pod across queues is judged as creating it there); other updates leave a pod's queue alone and are
not. Until the book has read the cluster, a pod that would be judged is refused (fail closed; the API
server retries nothing, the user does).

A review that is not an ``admission.k8s.io/v1`` AdmissionReview of the expected shape raises
``MalformedReview`` (the server answers 400 with its message): the API server never sends one, so
anything else is a client to refuse clearly, never a crash.

Mutating (CREATE of pods that ask for a GPU): legacy pod-level forms become per-container keys (unless the
policy turns that off); on pods of
our scheduler, ``nvidia.com/gpu: N`` becomes the exclusive ``gpufrac.io/container.<c>.gpus`` key with the
resource removed, and the managed-node toleration is added. Every container the node agent will enforce
is marked as requiring the agent's NRI plugin, and its validator's where ``nri_plugins`` names it
(NRI's ``required-plugins.noderesource.dev/container.<c>``,
the form NRI reads first, always overwritten): a runtime whose default validator is on (docs/deploy.md)
then refuses to create it while the agent is away, instead of starting it without limits. An
invalid pod is passed through untouched: the validating webhook rejects it with the contract's message,
which names the keys the user wrote.
"""

from __future__ import annotations

import base64
import json
import reprlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpufrac.contract import keys as k
from gpufrac.contract.changes import changed_contract_keys, forbidden_changes
from gpufrac.contract.errors import InvalidPodRequest, RuleViolation
from gpufrac.contract.near_miss import near_miss_warnings
from gpufrac.contract.parse import container_specs, parse_pod
from gpufrac.contract.request import PodGpuRequest
from gpufrac.contract.resize import parse_resizes, resize_refusals
from gpufrac.contract.translate import translate
from gpufrac.placement.model import Queue
from gpufrac.placement.queue_access import QUEUE_LABELS, access_refusal

DEFAULT_SCHEDULER_USER = "system:serviceaccount:gpufrac-system:gpufrac-scheduler"


class QueueBookNotReady(Exception):
    """The book has not read the cluster yet."""


class QueueBook(Protocol):
    """What the webhook reads to judge a pod's queue (``gpufrac.admission.queue_book`` keeps it from the
    API server). Both raise ``QueueBookNotReady`` until the first read of the cluster is done."""

    def queues(self) -> Mapping[str, Queue]:
        """The ``Queue`` objects by name."""
        ...

    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """The labels of a Namespace (None: not known)."""
        ...


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Who the scheduler is: the pods it schedules, and the users allowed to write binder-owned keys."""

    scheduler_name: str = k.DEFAULT_SCHEDULER_NAME
    #: The NRI plugins every GPU container requires: the node agent's ``plugin_name``, and its validator's
    #: (``k.NRI_VALIDATOR_PLUGIN_NAME``) where the node runs it (the chart and ``gpufrac up`` name both).
    nri_plugins: tuple[str, ...] = (k.NRI_PLUGIN_NAME,)
    binder_users: frozenset[str] = field(default_factory=lambda: frozenset({DEFAULT_SCHEDULER_USER}))
    #: Rewrite legacy ``gpu-memory`` into per-container keys; off where KAI Scheduler schedules, whose other
    #: sharing modes read ``gpu-memory`` as written (docs/deploy.md, "KAI schedules").
    translate_legacy: bool = True
    #: Queues and namespaces, to judge which queue a pod may use (None: not judged here; the scheduler
    #: still refuses to place such a pod).
    queues: QueueBook | None = None
    #: The scheduler's ``default_queue``: the queue of a pod that names none in a namespace without one.
    default_queue: str = "default"
    #: Give a pod that asks for a GPU fraction and names no scheduler (``default-scheduler``, what the API
    #: server fills in) ``scheduler_name``: no other scheduler can place a fraction, and such a pod would
    #: otherwise wait in silence. A pod opts out with ``gpufrac.io/keep-scheduler-name: "true"``; off
    #: where KAI Scheduler schedules.
    set_scheduler_name: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    code: int = 200
    reason: str = ""
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    #: Admission warnings (``kubectl`` prints them): keys one slip away from the contract's.
    warnings: list[str] = field(default_factory=list)


REVIEW_API_VERSION = "admission.k8s.io/v1"
_MAX_MESSAGE_VALUE = 60


class MalformedReview(ValueError):
    """Not an AdmissionReview this webhook can read; the message says which field is wrong and how."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, _MAX_MESSAGE_VALUE, _MAX_MESSAGE_VALUE


def _response(review: Mapping[str, Any], verdict: Verdict) -> dict[str, Any]:
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {"code": verdict.code, "reason": verdict.reason, "message": verdict.message}
    if verdict.warnings:
        response["warnings"] = verdict.warnings
    if verdict.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(verdict.patch).encode()).decode()
    return {
        "apiVersion": REVIEW_API_VERSION,
        "kind": "AdmissionReview",
        "response": response,
    }


def _shown(value: Any) -> str:
    """A short rendering of any JSON value (``reprlib`` bounds depth and length: input may be huge)."""
    return _SHOWN.repr(value)


def _field(parent: Mapping[str, Any], name: str, kind: type, where: str, *, required: bool = False) -> Any:
    """``parent[name]`` when it is a ``kind`` (absent or null: None, unless ``required``)."""
    value = parent.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        wanted = {dict: "an object", list: "an array", str: "a string"}[kind]
        raise MalformedReview(f"{where}{name} must be {wanted}, got {_shown(value)}")
    return value


def read_request(review: Any) -> Mapping[str, Any]:
    """The ``request`` of an AdmissionReview, after checking the fields this webhook reads."""
    if not isinstance(review, Mapping):
        raise MalformedReview("an AdmissionReview is a JSON object")
    if review.get("apiVersion") != REVIEW_API_VERSION or review.get("kind") != "AdmissionReview":
        raise MalformedReview(
            f"expected apiVersion {REVIEW_API_VERSION} and kind AdmissionReview, got "
            f"{_shown(review.get('apiVersion'))} and {_shown(review.get('kind'))}"
        )
    request = _field(review, "request", dict, "", required=True)
    uid = _field(request, "uid", str, "request.", required=True)
    if not uid:
        raise MalformedReview("request.uid must not be empty")
    _field(request, "operation", str, "request.", required=True)
    _field(request, "subResource", str, "request.")
    for name in ("kind", "resource"):
        part = _field(request, name, dict, "request.", required=True)
        for item in ("group", "kind" if name == "kind" else "resource"):
            _field(part, item, str, f"request.{name}.")
    user = _field(request, "userInfo", dict, "request.")
    if user is not None:
        _field(user, "username", str, "request.userInfo.")
    for name in ("object", "oldObject"):
        obj = _field(request, name, dict, "request.")
        if obj is not None:
            check_object(obj, where=f"request.{name}.")
    return request


def check_object(obj: Mapping[str, Any], *, where: str = "") -> None:
    """Check the parts of a Pod or Binding that the contract reads (the rest is the API server's);
    raises ``MalformedReview`` naming the field (prefixed by ``where``). ``gpufrac validate`` uses it too,
    on manifests that never met an API server."""
    metadata = _field(obj, "metadata", dict, where)
    annotations = _field(metadata, "annotations", dict, f"{where}metadata.") if metadata else None
    for key, value in (annotations or {}).items():
        if not isinstance(key, str):
            raise MalformedReview(f"{where}metadata.annotations keys must be strings, got {_shown(key)}")
        if not isinstance(value, str):
            raise MalformedReview(
                f"{where}metadata.annotations values must be strings (quote numbers in YAML),"
                f" got {_shown(value)}"
            )
    spec = _field(obj, "spec", dict, where)
    if spec is None:
        return
    _field(spec, "schedulerName", str, f"{where}spec.")
    containers = _field(spec, "containers", list, f"{where}spec.")
    for index, container in enumerate(containers or []):
        at = f"{where}spec.containers[{index}]"
        if not isinstance(container, dict):
            raise MalformedReview(f"{at} must be an object, got {_shown(container)}")
        _field(container, "name", str, f"{at}.")
        resources = _field(container, "resources", dict, f"{at}.")
        for section in ("limits", "requests"):
            if resources is not None:
                _field(resources, section, dict, f"{at}.resources.")
    for toleration in _field(spec, "tolerations", list, f"{where}spec.") or []:
        if not isinstance(toleration, dict):
            raise MalformedReview(f"{where}spec.tolerations items must be objects, got {_shown(toleration)}")


def _is_pod(request: Mapping[str, Any]) -> bool:
    """A pod itself, or its status subresource (which can rewrite the pod's annotations too)."""
    kind = request.get("kind") or {}
    return (
        kind.get("group", "") == ""
        and kind.get("kind") == "Pod"
        and request.get("subResource", "") in ("", "status", None)
    )


def _is_binding(request: Mapping[str, Any]) -> bool:
    """A Binding, posted to ``pods/binding`` or to the namespaced ``bindings`` resource."""
    kind = request.get("kind") or {}
    resource = request.get("resource") or {}
    if kind.get("group", "") != "" or kind.get("kind") != "Binding":
        return False
    subresource = request.get("subResource") or ""
    return (resource.get("resource"), subresource) in (("pods", "binding"), ("bindings", ""))


def _annotations(obj: Mapping[str, Any] | None) -> dict[str, str]:
    metadata = (obj or {}).get("metadata") or {}
    return dict(metadata.get("annotations") or {})


def _invalid(error: InvalidPodRequest) -> Verdict:
    return Verdict(allowed=False, code=422, reason="Invalid", message=str(error))


def validate_review(review: Mapping[str, Any], policy: AdmissionPolicy) -> dict[str, Any]:
    """The validating webhook's answer to ``review``; raises ``MalformedReview``."""
    return _response(review, decide_validate(read_request(review), policy))


def _forbidden(violations: list[RuleViolation]) -> Verdict:
    return Verdict(allowed=False, code=403, reason="Forbidden", message=str(InvalidPodRequest(violations)))


def decide_validate(request: Mapping[str, Any], policy: AdmissionPolicy) -> Verdict:
    user = str((request.get("userInfo") or {}).get("username", ""))
    is_binder = user in policy.binder_users
    if _is_binding(request) and request.get("operation") == "CREATE":
        return _decide_binding(request, is_binder=is_binder)
    if not _is_pod(request) or request.get("operation") not in ("CREATE", "UPDATE"):
        return Verdict(allowed=True)
    if request["operation"] == "CREATE" and request.get("subResource"):
        return Verdict(allowed=True)  # no pod is created through a subresource
    pod = request.get("object") or {}
    refused = _queue_verdict(request, pod, policy)
    if refused is not None:
        return refused
    new = _annotations(pod)
    if request["operation"] == "UPDATE":
        old = _annotations(request.get("oldObject"))
        if not changed_contract_keys(old, new):
            return Verdict(allowed=True)
        if not is_binder:
            bound = bool(((request.get("oldObject") or {}).get("spec") or {}).get("nodeName"))
            violations = forbidden_changes(old, new, creating=False, bound=bound)
            return _forbidden(violations) if violations else _resize_verdict(pod, new)
    try:
        parse_pod(new, container_specs(pod.get("spec") or {}), user_written=not is_binder)
    except InvalidPodRequest as error:
        return _invalid(error)
    return Verdict(allowed=True)


def _resize_verdict(pod: Mapping[str, Any], annotations: Mapping[str, str]) -> Verdict:
    """A user changed only the resize keys of a placed pod: they must name fractional containers and
    hold values valid as at creation (the scheduler decides whether they fit)."""
    try:
        specs = container_specs(pod.get("spec") or {})
        wanted = parse_pod(annotations, specs)
        refusals = resize_refusals(annotations, wanted, [s.name for s in specs], bound=True)
        if refusals:
            raise InvalidPodRequest(refusals)
        parse_resizes(annotations)
    except InvalidPodRequest as error:
        return _invalid(error)
    return Verdict(allowed=True)


def _labels(obj: Mapping[str, Any] | None) -> dict[str, str]:
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def _queue_verdict(
    request: Mapping[str, Any], pod: Mapping[str, Any], policy: AdmissionPolicy
) -> Verdict | None:
    """The refusal of a pod whose queue its namespace may not use (module docstring); None: not refused."""
    book = policy.queues
    spec = pod.get("spec") or {}
    if book is None or spec.get("schedulerName") != policy.scheduler_name:
        return None
    labels = _labels(pod)
    if request["operation"] == "UPDATE":
        old = _labels(request.get("oldObject"))
        if all(old.get(key) == labels.get(key) for key in QUEUE_LABELS):
            return None
    namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
    priority = spec.get("priority")
    try:
        message = access_refusal(
            pod_labels=labels,
            namespace=namespace,
            namespace_labels=book.namespace_labels(namespace) or {},
            priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
            queues=book.queues(),
            fallback=policy.default_queue,
        )
    except QueueBookNotReady:
        return Verdict(
            allowed=False,
            code=503,
            reason="ServiceUnavailable",
            message="the webhook has not read the cluster's queues and namespaces yet; try again shortly",
        )
    return None if message is None else Verdict(allowed=False, code=403, reason="Forbidden", message=message)


def _decide_binding(request: Mapping[str, Any], *, is_binder: bool) -> Verdict:
    """A Binding writes its annotations onto an existing pod: for anyone but the scheduler, every contract
    key in it is a forbidden change (the pod's current annotations are not in the review, so a key is
    judged as if it were new; rewriting a value the pod already has through a Binding is refused too)."""
    if is_binder:
        return Verdict(allowed=True)
    violations = forbidden_changes({}, _annotations(request.get("object")), creating=False)
    return _forbidden(violations) if violations else Verdict(allowed=True)


def mutate_review(review: Mapping[str, Any], policy: AdmissionPolicy) -> dict[str, Any]:
    """The mutating webhook's answer to ``review``: always allowed, with a JSONPatch when needed; raises
    ``MalformedReview``."""
    return _response(review, decide_mutate(read_request(review), policy))


def decide_mutate(request: Mapping[str, Any], policy: AdmissionPolicy) -> Verdict:
    if not _is_pod(request) or request.get("operation") != "CREATE" or request.get("subResource"):
        return Verdict(allowed=True)
    pod = request.get("object") or {}
    spec = pod.get("spec") or {}
    annotations = _annotations(pod)
    warnings = near_miss_warnings(annotations)
    try:
        containers = container_specs(spec)
        wanted = parse_pod(annotations, containers)
        named = _names_our_scheduler(spec, annotations, wanted, policy)
        ours = named or spec.get("schedulerName") == policy.scheduler_name
        translation = (
            translate(annotations, containers, whole_gpus=ours, legacy=policy.translate_legacy, parsed=wanted)
            if wanted.wants_gpu
            else None
        )
    except InvalidPodRequest:
        # the validating webhook rejects it, naming the user's own keys
        return Verdict(allowed=True, warnings=warnings)
    if translation is None:
        return Verdict(allowed=True, warnings=warnings)

    changes: dict[str, str | None] = dict(translation.annotations)
    changes.update(_required_plugins(annotations, changes, wanted, plugins=policy.nri_plugins))

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
        name = container.get("name")
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            for resource in sorted(str(r) for r in resources.get(section) or {}):
                whole = resource == k.GPU_RESOURCE and name in translation.strip_gpu_resource
                mig = resource.startswith(k.MIG_RESOURCE_PREFIX) and name in translation.strip_mig_resource
                if whole or mig:
                    path = f"/spec/containers/{index}/resources/{section}/{_escape(resource)}"
                    patch.append({"op": "remove", "path": path})
    if named:
        patch.append({"op": "add", "path": "/spec/schedulerName", "value": policy.scheduler_name})
    if ours and not _tolerates_managed(spec.get("tolerations") or []):
        if spec.get("tolerations") is None:
            patch.append({"op": "add", "path": "/spec/tolerations", "value": [k.managed_toleration()]})
        else:
            patch.append({"op": "add", "path": "/spec/tolerations/-", "value": k.managed_toleration()})
    return Verdict(allowed=True, patch=patch, warnings=warnings)


#: The scheduler name the API server gives a pod that names none.
_DEFAULT_SCHEDULER = "default-scheduler"


def _names_our_scheduler(
    spec: Mapping[str, Any], annotations: Mapping[str, str], wanted: PodGpuRequest, policy: AdmissionPolicy
) -> bool:
    """Whether the pod gets ``policy.scheduler_name``: it asks for a GPU fraction or for MIG slices through
    gpufrac's MIG keys (only gpufrac's scheduler places those; ``nvidia.com/mig-<profile>`` alone stays
    with the device plugin, as ``nvidia.com/gpu`` does), names no scheduler of its own, and did not opt
    out."""
    return (
        policy.set_scheduler_name
        and spec.get("schedulerName") in (None, "", _DEFAULT_SCHEDULER)
        and annotations.get(k.KEEP_SCHEDULER_NAME_ANNOTATION) != "true"
        and any(
            _mig_keyed(annotations, c.container) if c.mig is not None else not c.exclusive
            for c in wanted.containers
        )
    )


def _mig_keyed(annotations: Collection[str], container: str) -> bool:
    """Whether ``container``'s MIG request is in gpufrac's keys (not only in a device plugin resource)."""
    return any(k.mig_key(container, suffix) in annotations for suffix in (k.MIG_PROFILE, k.MIG_MEMORY))


def _required_plugins(
    annotations: Mapping[str, str],
    changes: Mapping[str, str | None],
    wanted: PodGpuRequest,
    *,
    plugins: tuple[str, ...],
) -> dict[str, str]:
    """NRI's required-plugins annotation for every container the node agent will enforce limits on.

    A runtime with NRI's validator on then refuses to create such a container while one of ``plugins``
    (the node agent; its validator too where named) is not connected (``k.NRI_REQUIRED_PLUGINS_PREFIX``),
    instead of starting it without its limits or unchecked. The containers are those the node finds in
    the stored annotations (it sees no resources): every fractional container of ``wanted`` (the pod's
    one parse; translation moves a legacy request between keys, never between containers), and a
    whole-GPU or MIG one only where the stored annotations mark it, so a pod left to the device plugin
    requires nothing. Always written: a user's own value cannot drop the requirement (NRI reads the
    container's key before ``<key>/pod`` and ``<key>``, so those cannot either).
    """
    stored = {key for key, value in {**annotations, **changes}.items() if value is not None}
    value = k.nri_required_plugins_value(plugins)
    return {
        k.nri_required_plugins_key(c.container): value
        for c in wanted.containers
        if (
            _mig_keyed(stored, c.container)
            if c.mig is not None
            else not c.exclusive or k.whole_gpus_key(c.container) in stored
        )
    }


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
