"""What the engine is told: nodes with their physical GPUs, and pods waiting for a place.

These are plain frozen values. The scheduler service builds them from its informers (a Node and its
``gpufrac.io/gpus`` inventory, a Pod and its parsed contract) and the simulator builds them from a trace;
the engine never sees a Kubernetes object, so it stays pure and the two callers run the same code.

Kubernetes semantics are kept where users rely on them: taints with NoSchedule/NoExecute effects block
untolerated pods, ``nodeSelector`` is exact label equality, required node affinity is an OR of terms
whose expressions are ANDed (In/NotIn/Exists/DoesNotExist/Gt/Lt).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gpufrac.contract.request import ComputeMode, PodGpuRequest

from .pod_constraints import NO_CONSTRAINTS, NO_EXTRAS, NodeExtras, PodConstraints

# The selector primitives live below both this module and ``pod_constraints`` (which uses them too);
# they are part of what the engine is told, so the model's users import them from here.
from .selectors import NodeSelectorRequirement as NodeSelectorRequirement
from .selectors import NodeSelectorTerm as NodeSelectorTerm
from .selectors import SelectorOperator as SelectorOperator

BOTH_MODES: frozenset[ComputeMode] = frozenset(ComputeMode)


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: TaintEffect = TaintEffect.NO_SCHEDULE


class TolerationOperator(StrEnum):
    EQUAL = "Equal"
    EXISTS = "Exists"


@dataclass(frozen=True, slots=True)
class Toleration:
    """A pod's toleration; an empty key with ``Exists`` tolerates every taint, as in Kubernetes."""

    key: str = ""
    operator: TolerationOperator = TolerationOperator.EQUAL
    value: str = ""
    effect: TaintEffect | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect is not None and self.effect is not taint.effect:
            return False
        if not self.key:
            return self.operator is TolerationOperator.EXISTS
        if self.key != taint.key:
            return False
        return self.operator is TolerationOperator.EXISTS or self.value == taint.value


class GpuMode(StrEnum):
    """What a GPU serves (docs/mig.md): fractions (and whole-GPU pods while empty), MIG slices only, or
    whole-GPU pods only. The node agent publishes it per GPU; the scheduler asks for changes."""

    FRACTIONS = "fractions"
    MIG = "mig"
    WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class MigSlice:
    """One MIG GPU instance of a GPU in mode ``mig``: its profile (``3g.40gb``), its placement start
    (memory-slice offset), its MIG device UUID (``MIG-...``: what a container is given) and its memory."""

    profile: str
    start: int
    uuid: str
    mib: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One physical GPU as the node agent publishes it; ``mig`` lists its slices when ``mode`` is MIG."""

    uuid: str
    index: int
    memory_mib: int
    model: str = ""
    mode: GpuMode = GpuMode.FRACTIONS
    mig: tuple[MigSlice, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node as the engine sees it: allocatable resources, scheduling constraints, physical GPUs.

    ``compute_modes`` is what the node can enforce (the node agent's capability labels); a pod asking
    for a mode the node cannot enforce is filtered out there. ``agent_heartbeat_expired`` says that the
    node agent has stopped proving it is alive: its Ready condition may still say True, but nothing would
    inject the limits of a new fraction. Whoever builds the spec decides it against its clock (the
    scheduler: ``gpufrac.kube.heartbeat``); the engine reads no clock. ``node_stack_conflict``
    says that the node agent found another GPU-fractioning node stack (NVIDIA's) writing its condition:
    the node's readiness and heartbeat are then not gpufrac's to go by, and it takes no pod.
    ``extended`` (allocatable extended resources other than GPUs, whole units) and
    ``ephemeral_bytes`` (allocatable ephemeral-storage) are checked only against pods that ask for them.
    """

    name: str
    cpu_milli: int
    memory_bytes: int
    max_pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    ready: bool = True
    schedulable: bool = True
    gpu_model: str = ""
    gpus: tuple[GpuDevice, ...] = ()
    compute_modes: frozenset[ComputeMode] = BOTH_MODES
    agent_heartbeat_expired: bool = False
    node_stack_conflict: bool = False
    extended: Mapping[str, int] = field(default_factory=dict)
    ephemeral_bytes: int = 0


class ModePolicy(StrEnum):
    """Required: only GPUs in the requested mode (or empty). Preferred: may fall back to the other mode."""

    REQUIRED = "Required"
    PREFERRED = "Preferred"


@dataclass(frozen=True, slots=True)
class PendingPod:
    """A pod waiting for a place: identity, host resources, constraints, queueing, and its GPU request.

    ``arrival`` orders pods of equal priority and queue standing (lower first). ``policy`` overrides the
    engine's policy for this pod (the per-pod policy annotation). ``labels`` and ``constraints`` relate
    the pod to other pods (``gpufrac.placement.pod_constraints``); ``extras`` are the node-local
    resources besides CPU, memory and GPUs; ``nominated_node`` is where a preemptor made room for it.
    ``movable``: once placed, consolidation may move it (it opted in and a controller recreates it;
    ``gpufrac.placement.consolidation``).
    """

    namespace: str
    name: str
    uid: str
    gpu: PodGpuRequest = field(default_factory=PodGpuRequest)
    cpu_milli: int = 0
    memory_bytes: int = 0
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: tuple[NodeSelectorTerm, ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    priority: int = 0
    queue: str = "default"
    arrival: int = 0
    policy: str | None = None
    mode_policy: ModePolicy = ModePolicy.REQUIRED
    labels: Mapping[str, str] = field(default_factory=dict)
    constraints: PodConstraints = NO_CONSTRAINTS
    extras: NodeExtras = NO_EXTRAS
    nominated_node: str | None = None
    movable: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class QueueResource(StrEnum):
    """What a queue's quota counts: guaranteed GPU memory (MiB) and whole GPUs held exclusively.

    The values are the field names of the ``Queue`` resource's ``spec.resources`` and ``status``.
    """

    GPU_MEMORY = "gpuMemory"
    GPUS = "gpus"


@dataclass(frozen=True, slots=True)
class Quota:
    """One resource's terms for one queue (the unit is the resource's: MiB or whole GPUs).

    ``deserved`` is guaranteed when the queue asks for it; what is left is divided among queues that
    still want more in proportion to ``over_quota_weight`` (0: only what no weighted queue wants);
    ``limit`` (None: none) caps the queue whatever is free.
    """

    deserved: int = 0
    over_quota_weight: float = 1.0
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A Kubernetes label selector (``matchLabels`` ANDed with ``matchExpressions``); an empty one matches
    every set of labels, as in Kubernetes. Expressions use In, NotIn, Exists and DoesNotExist."""

    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: tuple[NodeSelectorRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for r in self.match_expressions:
            values = f" ({', '.join(r.values)})" if r.values else ""
            parts.append(f"{r.key} {r.operator.value}{values}")
        return ", ".join(parts) or "every namespace"


@dataclass(frozen=True, slots=True)
class Queue:
    """A queue: its parent (None: a top-level queue) and its quota per resource.

    ``deserved_share`` is the configuration file's older form of a GPU-memory deserved quota: a fraction
    of the cluster's GPU memory, used when ``gpu_memory.deserved`` is 0. Pending pods of the queue
    furthest below its deserved GPU memory go first among pods of equal priority.

    Who may use it (``gpufrac.placement.queue_access``): ``namespaces`` (names) and ``namespace_selector``
    (labels of the Namespace); a namespace either admits is admitted. With neither (both None) the queue
    is open to every namespace: not a tenant boundary. ``max_priority`` bounds the priority of its pods
    (None: no bound).

    ``preempt_min_runtime_s`` and ``reclaim_min_runtime_s`` (KAI Scheduler's ``preemptMinRuntime`` and
    ``reclaimMinRuntime``): how long a pod of the queue runs before preemption, or reclaim, may evict it;
    None: not set here, the nearest ancestor's value applies (none at all: 0, no minimum).
    """

    name: str
    parent: str | None = None
    gpu_memory: Quota = Quota()
    gpus: Quota = Quota()
    deserved_share: float = 0.0
    namespaces: frozenset[str] | None = None
    namespace_selector: LabelSelector | None = None
    max_priority: int | None = None
    preempt_min_runtime_s: float | None = None
    reclaim_min_runtime_s: float | None = None

    @property
    def bound(self) -> bool:
        """Whether the queue says which namespaces may use it (False: open to all)."""
        return self.namespaces is not None or self.namespace_selector is not None

    def admits(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether pods of ``namespace`` (whose Namespace carries ``labels``) may join this queue."""
        if not self.bound:
            return True
        if self.namespaces is not None and namespace in self.namespaces:
            return True
        return self.namespace_selector is not None and self.namespace_selector.matches(labels)

    def quota(self, resource: QueueResource) -> Quota:
        return self.gpu_memory if resource is QueueResource.GPU_MEMORY else self.gpus

    def deserved(self, resource: QueueResource, capacity: int) -> int:
        """The deserved amount of ``resource`` in a cluster of ``capacity`` (resolves ``deserved_share``)."""
        quota = self.quota(resource)
        if resource is QueueResource.GPU_MEMORY and not quota.deserved and self.deserved_share:
            return int(self.deserved_share * capacity)
        return quota.deserved
