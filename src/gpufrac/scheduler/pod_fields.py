"""Pod fields kube-scheduler honours beyond CPU, memory, selectors and taints -> the engine's values, or
the sentence that says why gpufrac will not place the pod.

A GPU scheduler replaces kube-scheduler for its pods, so every field kube-scheduler acts on is either
honoured here or refused with a sentence that names it; none is ignored (issue #19, docs/scheduler.md
lists every field). Honoured: inter-pod affinity and anti-affinity (required and preferred,
``namespaces``, ``namespaceSelector``, ``matchLabelKeys``, ``mismatchLabelKeys``), topology spread
constraints, host ports, extended resources, ephemeral storage, ``status.nominatedNodeName``, and
PersistentVolumeClaims bound to PersistentVolumes (their node affinity is ANDed with the pod's).
Refused: claims not bound yet (WaitForFirstConsumer, or an Immediate claim still waiting: gpufrac does
not bind or provision volumes, which kube-scheduler's VolumeBinding plugin does), and DRA
``resourceClaims`` when the scheduler runs without DRA (``dra: false``); with it, claims of gpufrac's
driver are allocated (``gpufrac.scheduler.claims``, which refuses the others by name).
``schedulingGates`` are the service's business: a gated pod is not placed at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightkube.resources.core_v1 import PersistentVolume, PersistentVolumeClaim, Pod
from lightkube.utils.quantity import parse_quantity

from gpufrac.contract import keys
from gpufrac.placement.model import NodeSelectorRequirement, NodeSelectorTerm, SelectorOperator
from gpufrac.placement.pod_constraints import (
    HostPort,
    InclusionPolicy,
    LabelSelector,
    NodeExtras,
    PodAffinityTerm,
    PodConstraints,
    SpreadConstraint,
    WeightedTerm,
    WhenUnsatisfiable,
)

#: Resources the engine models elsewhere (host fit, GPU contract) or that are not node resources.
NATIVE_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage", "pods"})
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_LABEL = keys.HOSTNAME_LABEL  # matchFields on metadata.name are read as this label


class RefusedPod(ValueError):
    """The pod uses a field gpufrac does not honour; the message names it."""


# -- selectors ---------------------------------------------------------------------------------------------


def label_selector(selector: Any, *, where: str) -> LabelSelector | None:
    """A metav1.LabelSelector; None stays None (it selects nothing, as in kube)."""
    if selector is None:
        return None
    expressions = []
    for i, e in enumerate(selector.matchExpressions or []):
        try:
            op = SelectorOperator(e.operator)
        except ValueError:
            raise RefusedPod(
                f"{where}.matchExpressions[{i}].operator={e.operator!r} is not a label selector operator"
            ) from None
        if op in (SelectorOperator.GT, SelectorOperator.LT):
            raise RefusedPod(f"{where}.matchExpressions[{i}].operator={e.operator!r} is not valid for pods")
        expressions.append(NodeSelectorRequirement(e.key, op, tuple(e.values or ())))
    labels = tuple(sorted((selector.matchLabels or {}).items()))
    return LabelSelector(match_labels=labels, match_expressions=tuple(expressions))


def _merge_label_keys(
    selector: LabelSelector | None,
    pod_labels: Mapping[str, str],
    match: Sequence[str],
    mismatch: Sequence[str],
) -> LabelSelector | None:
    extra = [
        NodeSelectorRequirement(k, SelectorOperator.IN, (pod_labels[k],)) for k in match if k in pod_labels
    ] + [
        NodeSelectorRequirement(k, SelectorOperator.NOT_IN, (pod_labels[k],))
        for k in mismatch
        if k in pod_labels
    ]
    if selector is None or not extra:
        return selector
    return selector.with_requirements(tuple(r for r in extra if r not in selector.match_expressions))


def _affinity_term(term: Any, *, namespace: str, labels: Mapping[str, str], where: str) -> PodAffinityTerm:
    selector = label_selector(term.labelSelector, where=f"{where}.labelSelector")
    selector = _merge_label_keys(selector, labels, term.matchLabelKeys or (), term.mismatchLabelKeys or ())
    ns_selector = label_selector(term.namespaceSelector, where=f"{where}.namespaceSelector")
    namespaces = frozenset(term.namespaces or ())
    if not namespaces and ns_selector is None:
        namespaces = frozenset({namespace})
    return PodAffinityTerm(term.topologyKey, selector, namespaces, ns_selector)


# -- the pod ------------------------------------------------------------------------------------------------


def pod_constraints(pod: Pod) -> PodConstraints:
    spec = pod.spec
    ns, labels = pod.metadata.namespace, dict(pod.metadata.labels or {})
    affinity = spec.affinity if spec else None

    def terms(group: Any, kind: str) -> tuple[tuple[PodAffinityTerm, ...], tuple[WeightedTerm, ...]]:
        if group is None:
            return (), ()
        where = f"spec.affinity.{kind}"
        required = tuple(
            _affinity_term(t, namespace=ns, labels=labels, where=f"{where}.required[{i}]")
            for i, t in enumerate(group.requiredDuringSchedulingIgnoredDuringExecution or [])
        )
        preferred = tuple(
            WeightedTerm(
                w.weight,
                _affinity_term(
                    w.podAffinityTerm, namespace=ns, labels=labels, where=f"{where}.preferred[{i}]"
                ),
            )
            for i, w in enumerate(group.preferredDuringSchedulingIgnoredDuringExecution or [])
        )
        return required, preferred

    req_aff, pref_aff = terms(affinity.podAffinity if affinity else None, "podAffinity")
    req_anti, pref_anti = terms(affinity.podAntiAffinity if affinity else None, "podAntiAffinity")
    spread = []
    for i, c in enumerate((spec.topologySpreadConstraints if spec else None) or []):
        where = f"spec.topologySpreadConstraints[{i}]"
        selector = label_selector(c.labelSelector, where=f"{where}.labelSelector")
        selector = _merge_label_keys(selector, labels, c.matchLabelKeys or (), ())
        try:
            spread.append(
                SpreadConstraint(
                    max_skew=int(c.maxSkew),
                    topology_key=c.topologyKey,
                    when_unsatisfiable=WhenUnsatisfiable(c.whenUnsatisfiable),
                    selector=selector,
                    min_domains=int(c.minDomains) if c.minDomains is not None else 1,
                    node_affinity_policy=InclusionPolicy(c.nodeAffinityPolicy or "Honor"),
                    node_taints_policy=InclusionPolicy(c.nodeTaintsPolicy or "Ignore"),
                )
            )
        except ValueError as error:
            raise RefusedPod(f"{where} is invalid: {error}") from None
    node_affinity = affinity.nodeAffinity if affinity else None
    preferred_node = tuple(
        (p.weight, node_selector_term(p.preference))
        for p in (node_affinity.preferredDuringSchedulingIgnoredDuringExecution if node_affinity else None)
        or []
    )
    return PodConstraints(req_aff, req_anti, pref_aff, pref_anti, tuple(spread), preferred_node)


def _amounts(resources: Any) -> dict[str, Any]:
    if resources is None:
        return {}
    # The API server copies limits into missing requests; a pod read before that (a test fixture) gets
    # the same treatment here.
    return {**(resources.limits or {}), **(resources.requests or {})}


def node_extras(pod: Pod) -> NodeExtras:
    """Host ports, extended resources (not GPUs) and ephemeral storage, with kube's arithmetic: the sum
    over containers, at least the largest init container, plus overhead."""
    spec = pod.spec
    if spec is None:
        return NodeExtras()
    ports = tuple(
        HostPort(port=p.hostPort, protocol=p.protocol or "TCP", ip=p.hostIP or "")
        for c in spec.containers  # kube's NodePorts reads spec.containers only
        for p in c.ports or []
        if p.hostPort
    )
    totals: dict[str, int] = {}

    def amounts(container: Any) -> dict[str, int]:
        out = {}
        for name, raw in _amounts(container.resources).items():
            if name in ("cpu", "memory", "pods", GPU_RESOURCE):
                continue
            out[name] = math.ceil(parse_quantity(raw) or 0)
        return out

    for c in spec.containers:
        for name, value in amounts(c).items():
            totals[name] = totals.get(name, 0) + value
    for c in spec.initContainers or []:
        for name, value in amounts(c).items():
            totals[name] = max(totals.get(name, 0), value)
    for name, raw in (spec.overhead or {}).items():
        if name not in ("cpu", "memory", "pods", GPU_RESOURCE):
            totals[name] = totals.get(name, 0) + math.ceil(parse_quantity(raw) or 0)
    ephemeral = totals.pop("ephemeral-storage", 0)
    extended = tuple(sorted((k, v) for k, v in totals.items() if v > 0))
    return NodeExtras(host_ports=ports, extended=extended, ephemeral_bytes=ephemeral)


def node_resources(allocatable: Mapping[str, Any]) -> tuple[dict[str, int], int]:
    """(extended resources other than GPUs, ephemeral-storage bytes) of a node's allocatable."""
    extended = {
        k: math.ceil(parse_quantity(v) or 0)
        for k, v in allocatable.items()
        if k not in NATIVE_RESOURCES and k != GPU_RESOURCE
    }
    ephemeral = math.ceil(parse_quantity(allocatable.get("ephemeral-storage")) or 0)
    return extended, ephemeral


def scheduling_gates(pod: Pod) -> tuple[str, ...]:
    return tuple(g.name for g in (pod.spec.schedulingGates if pod.spec else None) or [])


def refused_fields(pod: Pod, *, dra: bool) -> str | None:
    """The sentence for a field gpufrac does not honour, or None. ``dra``: the scheduler allocates
    claims of gpufrac's driver (its configuration's ``dra``)."""
    spec = pod.spec
    if spec is not None and spec.resourceClaims and not dra:
        names = ", ".join(c.name for c in spec.resourceClaims)
        return (
            f"spec.resourceClaims ({names}): this gpufrac scheduler runs with dra: false and allocates no "
            "dynamic resource claims; use the gpufrac annotations for GPUs, or kube-scheduler for this pod"
        )
    return None


# -- volumes ------------------------------------------------------------------------------------------------


def claim_names(pod: Pod) -> list[tuple[int, str]]:
    """(volume index, claim name) of every PersistentVolumeClaim the pod mounts, generic ephemeral
    volumes included (their claim is named ``<pod>-<volume>``)."""
    out = []
    for i, v in enumerate((pod.spec.volumes if pod.spec else None) or []):
        if v.persistentVolumeClaim is not None:
            out.append((i, v.persistentVolumeClaim.claimName))
        elif v.ephemeral is not None:
            out.append((i, f"{pod.metadata.name}-{v.name}"))
    return out


def _pv_terms(pv: PersistentVolume) -> tuple[NodeSelectorTerm, ...]:
    affinity = pv.spec.nodeAffinity if pv.spec else None
    required = affinity.required if affinity else None
    if required is None:
        return ()
    return tuple(node_selector_term(t) for t in required.nodeSelectorTerms)


def node_selector_term(term: Any) -> NodeSelectorTerm:
    """A v1.NodeSelectorTerm; ``matchFields`` can only select ``metadata.name``, matched as the hostname
    label (the engine matches labels)."""
    expressions = [
        NodeSelectorRequirement(
            key=e.key, operator=SelectorOperator(e.operator), values=tuple(e.values or ())
        )
        for e in term.matchExpressions or []
    ]
    expressions += [
        NodeSelectorRequirement(
            key=HOSTNAME_LABEL, operator=SelectorOperator(e.operator), values=tuple(e.values or ())
        )
        for e in term.matchFields or []
        if e.key == "metadata.name"
    ]
    return NodeSelectorTerm(match_expressions=tuple(expressions))


def volume_terms(
    pod: Pod,
    *,
    claim: Callable[[str, str], PersistentVolumeClaim | None],
    volume: Callable[[str], PersistentVolume | None],
) -> list[tuple[NodeSelectorTerm, ...]]:
    """Per bound claim with a node-affine volume, the volume's terms (ORed); raises ``RefusedPod`` for
    a claim gpufrac cannot honour. ``claim(namespace, name)`` and ``volume(name)`` look objects up."""
    ns = pod.metadata.namespace
    out = []
    for i, name in claim_names(pod):
        where = f"spec.volumes[{i}] (PersistentVolumeClaim {name})"
        found = claim(ns, name)
        if found is None:
            raise RefusedPod(f"{where}: the claim does not exist")
        volume_name = found.spec.volumeName if found.spec else None
        if not volume_name:
            raise RefusedPod(
                f"{where}: the claim is not bound to a PersistentVolume; the gpufrac scheduler does not "
                "bind or provision volumes (a WaitForFirstConsumer claim waits for a scheduler that does): "
                "bind it first, or use an Immediate storage class"
            )
        pv = volume(volume_name)
        if pv is None:
            raise RefusedPod(f"{where}: its PersistentVolume {volume_name} does not exist")
        terms = _pv_terms(pv)
        if terms:
            out.append(terms)
    return out


def and_terms(
    pod_terms: tuple[NodeSelectorTerm, ...], more: list[tuple[NodeSelectorTerm, ...]]
) -> tuple[NodeSelectorTerm, ...]:
    """Required node affinity ANDed with each volume's: every OR-set is multiplied out into terms."""
    result = pod_terms
    for terms in more:
        if not result:
            result = terms
            continue
        # An empty term matches nothing, so a product with one matches nothing either: dropped.
        result = tuple(
            NodeSelectorTerm(match_expressions=a.match_expressions + b.match_expressions)
            for a in result
            for b in terms
            if a.match_expressions and b.match_expressions
        ) or (NodeSelectorTerm(),)
    return result
