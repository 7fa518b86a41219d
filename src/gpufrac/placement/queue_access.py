"""Which queue a pod is in, and whether its namespace may use that queue: one rule for the webhook and
the scheduler.

A queue is a tenant boundary only when the cluster admin binds it to namespaces (``Queue.namespaces``,
``Queue.namespace_selector``; Kueue binds a ClusterQueue the same way, with a ``namespaceSelector``).
Without a binding a queue is open to every namespace, as every KAI Scheduler queue is. The webhook
refuses a pod that names a queue its namespace may not use, and the scheduler refuses to place one
(so a webhook outage, or a pod that predates the binding, is no way around it): both call
``access_refusal`` here.

The queue a pod is in: the first non-empty label of ``gpufrac.io/queue`` and ``kai.scheduler/queue``;
without one, the queue its Namespace names in ``gpufrac.io/default-queue`` (a label only someone allowed
to edit Namespaces can set, normally the cluster admin); without that, the scheduler's default queue.
Every queue label a pod carries is judged, not only the one in force, so a pod cannot carry a foreign
queue in KAI's label for some other reader. Its namespace must be admitted by the queue and by each of
the queue's ancestors (binding a parent binds its subtree), and its priority may not exceed the
smallest ``max_priority`` on that path.

A queue the caller does not know is not judged here: whether it exists is the scheduler's question (a
pod may name a queue that is created later), and an unknown queue is never an unlimited one there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufrac.contract import keys

from .model import LabelSelector, NodeSelectorRequirement, Queue, QueueResource, Quota, SelectorOperator

#: The pod labels that name a queue, the one in force first.
QUEUE_LABELS = (keys.QUEUE_LABEL, keys.KAI_QUEUE_LABEL)


@dataclass(frozen=True, slots=True)
class QueueChoice:
    """A queue a pod is in (or names), and how it got there: ``source`` as a refusal's subject (the
    label and its value), ``via`` in a short parenthesis (the label's key)."""

    queue: str
    source: str
    via: str


def named_queues(pod_labels: Mapping[str, str]) -> list[QueueChoice]:
    """Every queue the pod's labels name, the one in force first."""
    return [
        QueueChoice(pod_labels[key], f'label {key}="{pod_labels[key]}"', f"label {key}")
        for key in QUEUE_LABELS
        if pod_labels.get(key)
    ]


def chosen_queue(
    *, pod_labels: Mapping[str, str], namespace: str, namespace_labels: Mapping[str, str], fallback: str
) -> QueueChoice:
    """The queue the pod is in (see the module docstring); ``fallback`` is the scheduler's default queue."""
    named = named_queues(pod_labels)
    if named:
        return named[0]
    label = keys.NAMESPACE_DEFAULT_QUEUE_LABEL
    default = namespace_labels.get(label)
    if default:
        return QueueChoice(
            default,
            f'the default queue of namespace {namespace} (label {label}="{default}")',
            f"namespace {namespace}'s label {label}",
        )
    return QueueChoice(
        fallback,
        f"the default queue {fallback} (the pod has no {keys.QUEUE_LABEL} label)",
        "the scheduler's default_queue",
    )


def _int(value: Any, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{where}: {value!r} is not a non-negative integer")
    return int(value)


#: Seconds per unit of a Go duration (``time.ParseDuration``, what KAI's ``metav1.Duration`` fields hold).
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")


def parse_duration(value: Any, *, where: str, negative: bool = False) -> float:
    """Seconds of a Go duration string ("5m", "1h30m", "90s", "0"), as Kubernetes writes a
    ``metav1.Duration``. A negative one ("-1s") is refused, or read as 0 when ``negative`` (KAI's own
    queues: a negative minimum protects nobody there)."""
    text = value if isinstance(value, str) else None
    sign = 1.0
    if text and text[0] in "+-":
        sign, text = (-1.0 if text[0] == "-" else 1.0), text[1:]
    if text == "0":
        return 0.0
    parts = _DURATION_PART.findall(text or "")
    if not text or not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f'{where}: {value!r} is not a duration such as "5m", "1h30m" or "90s"')
    seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if seconds < 0 and not negative:
        raise ValueError(f"{where}: {value!r} is negative")
    return max(seconds, 0.0)


def _min_runtime(spec: Mapping[str, Any], key: str, *, name: str) -> float | None:
    value = spec.get(key)
    return None if value is None else parse_duration(value, where=f"queue {name}: spec.{key}")


_SELECTOR_OPERATORS = {
    op.value: op
    for op in (
        SelectorOperator.IN,
        SelectorOperator.NOT_IN,
        SelectorOperator.EXISTS,
        SelectorOperator.DOES_NOT_EXIST,
    )
}


def _selector(value: Any, *, where: str) -> LabelSelector:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {value!r} is not a label selector")
    labels = value.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError(f"{where}.matchLabels: {labels!r} is not a map of strings")
    expressions = []
    for i, e in enumerate(value.get("matchExpressions") or []):
        op = _SELECTOR_OPERATORS.get(e.get("operator")) if isinstance(e, Mapping) else None
        if op is None or not isinstance(e.get("key"), str):
            raise ValueError(f"{where}.matchExpressions[{i}]: {e!r} is not a label selector requirement")
        expressions.append(
            NodeSelectorRequirement(e["key"], op, tuple(str(v) for v in e.get("values") or ()))
        )
    return LabelSelector(dict(labels), tuple(expressions))


def queue_from_spec(name: str, spec: Mapping[str, Any] | None) -> Queue:
    """A ``Queue`` object (gpufrac.io/v1alpha1; deploy/crds/gpufrac.io_queues.yaml) by its name and spec, as
    plain JSON. The CRD validates the spec; one stored without that validation raises ``ValueError`` naming
    the field. The scheduler and the webhook both read Queues through this."""
    spec = spec or {}
    resources = spec.get("resources") or {}
    quotas: dict[QueueResource, Quota] = {}
    for resource in QueueResource:
        terms = resources.get(resource.value) or {}
        where = f"queue {name}: spec.resources.{resource.value}"
        limit = terms.get("limit")
        weight = terms.get("overQuotaWeight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"{where}.overQuotaWeight: {weight!r} is not a non-negative number")
        quotas[resource] = Quota(
            deserved=_int(terms.get("deserved", 0), where=f"{where}.deserved"),
            over_quota_weight=float(weight),
            limit=None if limit is None else _int(limit, where=f"{where}.limit"),
        )
    namespaces = spec.get("namespaces")
    if namespaces is not None and (
        not isinstance(namespaces, list) or not all(isinstance(n, str) for n in namespaces)
    ):
        raise ValueError(f"queue {name}: spec.namespaces: {namespaces!r} is not a list of names")
    selector = spec.get("namespaceSelector")
    max_priority = spec.get("maxPriority")
    if max_priority is not None and (isinstance(max_priority, bool) or not isinstance(max_priority, int)):
        raise ValueError(f"queue {name}: spec.maxPriority: {max_priority!r} is not an integer")
    return Queue(
        name=name,
        parent=spec.get("parentQueue") or None,
        gpu_memory=quotas[QueueResource.GPU_MEMORY],
        gpus=quotas[QueueResource.GPUS],
        namespaces=None if namespaces is None else frozenset(namespaces),
        namespace_selector=None
        if selector is None
        else _selector(selector, where=f"queue {name}: spec.namespaceSelector"),
        max_priority=max_priority,
        preempt_min_runtime_s=_min_runtime(spec, "preemptMinRuntime", name=name),
        reclaim_min_runtime_s=_min_runtime(spec, "reclaimMinRuntime", name=name),
    )


def _path(name: str, queues: Mapping[str, Queue]) -> list[Queue]:
    """The queue and its known ancestors, nearest first (a cycle ends the walk)."""
    path: list[Queue] = []
    queue = queues.get(name)
    while queue is not None and queue not in path:
        path.append(queue)
        queue = queues.get(queue.parent) if queue.parent is not None else None
    return path


def _admitted(queue: Queue) -> str:
    names = sorted(queue.namespaces or ())
    parts = []
    if names:
        parts.append(f"namespace{'s' if len(names) > 1 else ''} {', '.join(names)}")
    if queue.namespace_selector is not None:
        parts.append(f"namespaces labelled {queue.namespace_selector}")
    return " and ".join(parts) if parts else "no namespace"


def queue_refusal(
    queue: str,
    *,
    namespace: str,
    namespace_labels: Mapping[str, str],
    priority: int,
    queues: Mapping[str, Queue],
) -> str | None:
    """Why a pod of ``namespace`` with ``priority`` may not be in ``queue`` (the rule, as the end of a
    sentence); None when it may, or when the queue is unknown."""
    path = _path(queue, queues)
    for q in path:
        if not q.admits(namespace, namespace_labels):
            whose = f"queue {q.name}" if q.name == queue else f"queue {q.name} (an ancestor of {queue})"
            return f"{whose} admits only {_admitted(q)}, not namespace {namespace}"
    caps = [(q.max_priority, q.name) for q in path if q.max_priority is not None]
    if caps:
        cap, name = min(caps)
        if priority > cap:
            whose = f"queue {name}" if name == queue else f"queue {name} (an ancestor of {queue})"
            return (
                f"{whose} allows pod priorities up to {cap} (spec.maxPriority), "
                f"and this pod's priority is {priority}"
            )
    return None


def access_refusal(
    *,
    pod_labels: Mapping[str, str],
    namespace: str,
    namespace_labels: Mapping[str, str],
    priority: int,
    queues: Mapping[str, Queue],
    fallback: str,
) -> str | None:
    """The one sentence that refuses the pod, naming the label, its value and the rule; None when every
    queue the pod names (or, naming none, its default queue) is one its namespace may use at its
    priority."""
    choices = named_queues(pod_labels) or [
        chosen_queue(
            pod_labels=pod_labels, namespace=namespace, namespace_labels=namespace_labels, fallback=fallback
        )
    ]
    for choice in choices:
        why = queue_refusal(
            choice.queue,
            namespace=namespace,
            namespace_labels=namespace_labels,
            priority=priority,
            queues=queues,
        )
        if why is not None:
            return f"{choice.source} is refused: {why}"
    return None


__all__ = [
    "QUEUE_LABELS",
    "QueueChoice",
    "access_refusal",
    "chosen_queue",
    "named_queues",
    "parse_duration",
    "queue_from_spec",
    "queue_refusal",
]
