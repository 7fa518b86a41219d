"""What a pod asks of the pods around it and of its node beyond CPU, memory and GPUs: plain values.

A GPU scheduler replaces kube-scheduler for its pods, so it owes them what kube-scheduler would have
given them. These values carry, with kube-scheduler's meaning, the pod fields that relate a pod to other
pods (inter-pod affinity and anti-affinity, topology spread constraints) and the node-local resources
that are not CPU, memory or GPUs (host ports, extended resources, ephemeral storage). The scheduler
service builds them from a Pod (``gpufrac.scheduler.objects``), the simulator from a trace; the engine
evaluates them in ``gpufrac.placement.topology``.

Semantics kept from kube-scheduler (pkg/scheduler/framework/plugins/interpodaffinity/filtering.go,
podtopologyspread/filtering.go, noderesources/fit.go, nodeports/node_ports.go):

- A term's namespaces: the listed ones, plus those whose labels match ``namespaceSelector``; with
  neither, the pod's own namespace. An empty ``namespaceSelector`` ({}) selects every namespace.
- A nil label selector selects no pod; an empty one ({}) selects every pod.
- ``matchLabelKeys`` / ``mismatchLabelKeys`` are merged into the selector as ``key In (value)`` /
  ``key NotIn (value)`` with the pod's own label values; keys the pod does not carry are ignored. (The
  API server of 1.34 merges them at creation too; merging again adds the same requirement.)
- Topology spread: ``minDomains`` defaults to 1, ``nodeAffinityPolicy`` to Honor, ``nodeTaintsPolicy``
  to Ignore; the selector matches pods of the pod's own namespace only.
- Host ports conflict when protocol and port are equal and the host IPs are equal or either is the
  wildcard (empty or 0.0.0.0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from .selectors import NodeSelectorRequirement, NodeSelectorTerm

WILDCARD_IPS = frozenset({"", "0.0.0.0"})


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """``matchLabels`` and ``matchExpressions`` ANDed; the empty selector matches every label set."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[NodeSelectorRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, value in self.match_labels:
            if labels.get(key) != value:
                return False
        return all(r.matches(labels) for r in self.match_expressions)

    def with_requirements(self, extra: tuple[NodeSelectorRequirement, ...]) -> LabelSelector:
        return LabelSelector(self.match_labels, self.match_expressions + extra) if extra else self


def selects(selector: LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """kube's LabelSelectorAsSelector: nil selects nothing."""
    return selector is not None and selector.matches(labels)


@dataclass(frozen=True, slots=True)
class PodAffinityTerm:
    """A pod (anti-)affinity term with its namespaces resolved against the pod that carries it."""

    topology_key: str
    selector: LabelSelector | None
    namespaces: frozenset[str]
    namespace_selector: LabelSelector | None = None

    def matches(
        self, namespace: str, labels: Mapping[str, str], namespace_labels: Mapping[str, Mapping[str, str]]
    ) -> bool:
        """Whether a pod of ``namespace`` with ``labels`` is one this term selects."""
        if namespace not in self.namespaces and not selects(
            self.namespace_selector, namespace_labels.get(namespace, {})
        ):
            return False
        return selects(self.selector, labels)


@dataclass(frozen=True, slots=True)
class WeightedTerm:
    weight: int
    term: PodAffinityTerm


class WhenUnsatisfiable(StrEnum):
    DO_NOT_SCHEDULE = "DoNotSchedule"
    SCHEDULE_ANYWAY = "ScheduleAnyway"


class InclusionPolicy(StrEnum):
    HONOR = "Honor"
    IGNORE = "Ignore"


@dataclass(frozen=True, slots=True)
class SpreadConstraint:
    """One topology spread constraint; the selector matches pods of the carrying pod's namespace."""

    max_skew: int
    topology_key: str
    when_unsatisfiable: WhenUnsatisfiable
    selector: LabelSelector | None
    min_domains: int = 1
    node_affinity_policy: InclusionPolicy = InclusionPolicy.HONOR
    node_taints_policy: InclusionPolicy = InclusionPolicy.IGNORE


@dataclass(frozen=True, slots=True)
class PodConstraints:
    """A pod's rules about other pods. Empty tuples: no rule of that kind."""

    required_affinity: tuple[PodAffinityTerm, ...] = ()
    required_anti_affinity: tuple[PodAffinityTerm, ...] = ()
    preferred_affinity: tuple[WeightedTerm, ...] = ()
    preferred_anti_affinity: tuple[WeightedTerm, ...] = ()
    spread: tuple[SpreadConstraint, ...] = ()
    #: preferred node affinity: (weight, term); a preference, scored with the others
    preferred_node: tuple[tuple[int, NodeSelectorTerm], ...] = ()

    def __bool__(self) -> bool:
        return bool(
            self.required_affinity
            or self.required_anti_affinity
            or self.preferred_affinity
            or self.preferred_anti_affinity
            or self.spread
            or self.preferred_node
        )

    @property
    def hard_spread(self) -> tuple[SpreadConstraint, ...]:
        return tuple(c for c in self.spread if c.when_unsatisfiable is WhenUnsatisfiable.DO_NOT_SCHEDULE)

    @property
    def soft_spread(self) -> tuple[SpreadConstraint, ...]:
        return tuple(c for c in self.spread if c.when_unsatisfiable is WhenUnsatisfiable.SCHEDULE_ANYWAY)


NO_CONSTRAINTS = PodConstraints()


@dataclass(frozen=True, slots=True)
class HostPort:
    """A container port bound on the node (``hostPort``)."""

    port: int
    protocol: str = "TCP"
    ip: str = ""

    def conflicts(self, other: HostPort) -> bool:
        return (
            self.port == other.port
            and self.protocol == other.protocol
            and (self.ip == other.ip or self.ip in WILDCARD_IPS or other.ip in WILDCARD_IPS)
        )


@dataclass(frozen=True, slots=True)
class NodeExtras:
    """What a pod takes on its node besides CPU, memory, a pod slot and GPUs.

    ``extended`` are extended resources (``example.com/foo``, hugepages) with whole-unit amounts as the
    API counts them; ``ephemeral_bytes`` is ephemeral-storage.
    """

    host_ports: tuple[HostPort, ...] = ()
    extended: tuple[tuple[str, int], ...] = ()
    ephemeral_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.host_ports or self.extended or self.ephemeral_bytes)


NO_EXTRAS = NodeExtras()
