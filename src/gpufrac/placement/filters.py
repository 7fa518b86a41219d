"""Filters: which nodes can take a pod, and for those that cannot, why (a ``Reason`` code per node).

Two kinds, as two small protocols, because they change at very different rates:

- ``StaticFilter`` looks only at a node's spec (readiness, the node agent's heartbeat, taints, labels,
  compute-mode capability) and the pod's constraints. Its answer changes only when the node spec does,
  so the engine caches it per pod constraint signature and per node spec version. (A heartbeat expires
  with time, not with an API event: the scheduler turns the expiry into a new node spec, see
  ``gpufrac.kube.heartbeat``.)
- ``ResourceFilter`` looks at the ledgers (free CPU, memory, pod slots, per-GPU memory, modes, tenants,
  compute portions, limits). It is vectorised over a set of nodes and returns a reason per node.

A node's reason is the first failing filter's code, as kube-scheduler reports the first failing Filter
plugin per node; the engine counts them into the Unschedulable message.

GPU fit (docs/placement.md, "Filters"): a GPU takes a container when its mode is EMPTY or the container's mode
(never mixing), when sm-sharing and single-tenant (the default) its tenant is the pod's namespace, when its
free MiB covers the resolved request, when sm-sharing the sum of compute portions stays <= 100%, and, if an
overcommit cap is set, when the sum of limits stays <= cap x capacity. Exclusive requests take EMPTY GPUs
only. A container asking for N devices needs N such GPUs on the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpufrac.contract.request import ComputeMode

from .decision import Reason
from .demand import PPM, ContainerDemand, Demand
from .model import NodeSpec, TaintEffect
from .state import EMPTY, FENCED, MIG, MODE_CODE, SM_SHARING, WHOLE_IDLE, ClusterState


class StaticFilter(Protocol):
    """A predicate on the node spec alone; returns ``Reason.FITS`` or the reason it rejects."""

    def check(self, node: NodeSpec, demand: Demand) -> Reason: ...


class ResourceFilter(Protocol):
    """A predicate on the ledgers, vectorised: one reason code per node of ``nodes``."""

    def check(self, state: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray: ...


# -- static -------------------------------------------------------------------------------------------


class NodeReady:
    def check(self, node: NodeSpec, demand: Demand) -> Reason:
        if node.node_stack_conflict:  # first: readiness and heartbeat are then the other stack's
            return Reason.NODE_STACK_CONFLICT
        if not node.ready:
            return Reason.NOT_READY
        if node.agent_heartbeat_expired:
            return Reason.AGENT_HEARTBEAT_EXPIRED
        if not node.schedulable:
            return Reason.UNSCHEDULABLE
        return Reason.FITS


class TaintToleration:
    """NoSchedule and NoExecute taints must be tolerated; PreferNoSchedule never filters."""

    def check(self, node: NodeSpec, demand: Demand) -> Reason:
        _, _, tolerations = demand.static_key  # type: ignore[misc]
        for taint in node.taints:
            if taint.effect is TaintEffect.PREFER_NO_SCHEDULE:
                continue
            if not any(t.tolerates(taint) for t in tolerations):
                return Reason.UNTOLERATED_TAINT
        return Reason.FITS


class NodeSelector:
    def check(self, node: NodeSpec, demand: Demand) -> Reason:
        selector, _, _ = demand.static_key  # type: ignore[misc]
        labels = node.labels
        for key, value in selector:
            if labels.get(key) != value:
                return Reason.NODE_SELECTOR
        return Reason.FITS


class NodeAffinity:
    """Required node affinity: at least one term matches (no terms: no constraint)."""

    def check(self, node: NodeSpec, demand: Demand) -> Reason:
        _, terms, _ = demand.static_key  # type: ignore[misc]
        if terms and not any(term.matches(node.labels) for term in terms):
            return Reason.NODE_AFFINITY
        return Reason.FITS


class ModeCapability:
    """The node must be able to enforce every compute mode the pod's shared containers ask for."""

    def check(self, node: NodeSpec, demand: Demand) -> Reason:
        if demand.wants_gpu and not demand.modes <= node.compute_modes:
            return Reason.MODE_UNSUPPORTED
        return Reason.FITS


STATIC_FILTERS: tuple[StaticFilter, ...] = (
    NodeReady(),
    TaintToleration(),
    NodeSelector(),
    NodeAffinity(),
    ModeCapability(),
)


def static_reason(
    node: NodeSpec, demand: Demand, filters: tuple[StaticFilter, ...] = STATIC_FILTERS
) -> Reason:
    for f in filters:
        code = f.check(node, demand)
        if code is not Reason.FITS:
            return code
    return Reason.FITS


# -- resources ----------------------------------------------------------------------------------------


class HostFit:
    """Pod slots, CPU and memory (kube-scheduler's NodeResourcesFit for the resources we model)."""

    def check(self, state: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray:
        out = np.zeros(nodes.size, dtype=np.int8)
        out[state.mem_free[nodes] < demand.memory_bytes] = Reason.INSUFFICIENT_MEMORY
        out[state.cpu_free[nodes] < demand.cpu_milli] = Reason.INSUFFICIENT_CPU
        out[state.pods_free[nodes] < 1] = Reason.TOO_MANY_PODS
        return out


@dataclass(frozen=True, slots=True)
class GpuRules:
    """The knobs of GPU fit: sm-sharing tenancy and the optional limit-overcommit cap."""

    sm_sharing_single_tenant: bool = True
    limit_overcommit: float | None = None


def container_fit(
    state: ClusterState,
    container: ContainerDemand,
    nodes: np.ndarray,
    tenant: int,
    rules: GpuRules,
) -> tuple[np.ndarray, np.ndarray]:
    """(reason per node, mask of GPUs that can take one device of ``container``) for ``nodes``."""
    mode = state.mode[nodes]
    need = container.count
    reasons = np.zeros(nodes.size, dtype=np.int8)
    if state.partitioned:
        # Some GPUs serve MIG slices or whole GPUs only (or are being re-partitioned): say so first.
        base = state.base[nodes]
        if container.exclusive:
            served, code = (base == EMPTY) | (base == WHOLE_IDLE), Reason.NO_WHOLE_OR_FRACTIONS_GPU
        else:
            served, code = base == EMPTY, Reason.NO_FRACTIONS_GPU
        reasons[served.sum(axis=1) < need] = code
    if container.exclusive:
        ok = (mode == EMPTY) | (mode == WHOLE_IDLE)
        reasons[(ok.sum(axis=1) < need) & (reasons == 0)] = Reason.NO_WHOLE_GPU
    else:
        want = MODE_CODE[container.mode]
        ok = (mode == EMPTY) | (mode == want)
        stages: list[tuple[np.ndarray, Reason]] = [(ok, Reason.MODE_CONFLICT)]
        if container.mode is ComputeMode.SM_SHARING and rules.sm_sharing_single_tenant:
            ok = ok & ((mode == EMPTY) | (state.tenant[nodes] == tenant))
            stages.append((ok, Reason.TENANT_CONFLICT))
        cap = state.cap[nodes]
        ok = ok & (state.free[nodes] >= container.request_mib(cap))
        stages.append((ok, Reason.INSUFFICIENT_GPU_MEMORY))
        if want == SM_SHARING:
            ok = ok & (state.ppm[nodes] + container.ppm(cap) <= PPM)
            stages.append((ok, Reason.INSUFFICIENT_COMPUTE))
        if rules.limit_overcommit is not None:
            bound = np.floor(cap * rules.limit_overcommit).astype(np.int64)
            ok = ok & (state.limit_sum[nodes] + container.limit_mib(cap) <= bound)
            stages.append((ok, Reason.LIMIT_OVERCOMMIT))
        # The reason is the first stage after which too few GPUs remain; later stages overwrite only
        # nodes still marked as fitting, so walk them in order.
        for mask, code in stages:
            short = (mask.sum(axis=1) < need) & (reasons == 0)
            reasons[short] = code
    count = state.gpu_count[nodes]
    reasons[count < need] = Reason.TOO_FEW_GPUS
    reasons[count == 0] = Reason.NO_GPUS
    return reasons, ok


class GpuFit:
    """GPU fit of every container of the pod, each on its own: a necessary condition checked for many
    nodes at once. Whether all containers fit together is settled when the engine assigns devices on
    the chosen node (a node that fails there is skipped with ``DEVICE_ASSIGNMENT``)."""

    def __init__(self, rules: GpuRules) -> None:
        self.rules = rules

    def fit(
        self, state: ClusterState, demand: Demand, nodes: np.ndarray
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        tenant = state.namespace_id(demand.namespace)
        reasons = np.zeros(nodes.size, dtype=np.int8)
        masks = []
        for container in demand.containers:
            codes, mask = container_fit(state, container, nodes, tenant, self.rules)
            reasons = np.where(reasons == 0, codes, reasons)
            masks.append(mask)
        return reasons, masks

    def check(self, state: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray:
        return self.fit(state, demand, nodes)[0]


@dataclass(slots=True)
class Fit:
    """The result of the resource filters for a set of nodes: reasons, and per container a GPU mask.

    Scorers share the per-GPU free room in thousandths of a GPU through ``free_milli`` (computed once).
    """

    state: ClusterState
    nodes: np.ndarray
    reasons: np.ndarray
    masks: list[np.ndarray]
    _free_milli: np.ndarray | None = None

    def feasible(self) -> Fit:
        keep = self.reasons == 0
        if keep.all():
            return self
        return Fit(self.state, self.nodes[keep], self.reasons[keep], [m[keep] for m in self.masks])

    def free_milli(self) -> np.ndarray:
        """(len(nodes), GPU slots) free thousandths of a GPU; 0 on absent slots."""
        if self._free_milli is None:
            self._free_milli = self.state.free_milli(self.nodes)
        return self._free_milli


def mig_fit(state: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray:
    """Reason per node for the pod's MIG containers (``gpufrac.placement.mig_book``): a node with no GPU
    in mode mig cannot serve them; one that has must hold free slices for all of them together. Only
    nodes with MIG GPUs are looked at one by one (MIG demand is small)."""
    reasons = np.zeros(nodes.size, dtype=np.int8)
    count = state.gpu_count[nodes]
    base = state.base[nodes]
    # A GPU being re-partitioned (FENCED) counts: its node says "no free slice", not "no MIG GPU".
    has_mig = ((base == MIG) | (base == FENCED)).any(axis=1)
    reasons[~has_mig] = Reason.NO_MIG_GPU
    reasons[count == 0] = Reason.NO_GPUS
    real = nodes if state.mig_rows is None else state.mig_rows[nodes]
    for i in np.flatnonzero(has_mig).tolist():
        if state.mig.choose(int(real[i]), demand.mig) is None:
            reasons[i] = Reason.NO_FREE_MIG_SLICE
    return reasons


_HOST = HostFit()


def resource_fit(state: ClusterState, demand: Demand, nodes: np.ndarray, rules: GpuRules) -> Fit:
    """Host fit, then GPU fit, then MIG fit; the first failing filter's reason per node."""
    reasons = _HOST.check(state, demand, nodes)
    masks: list[np.ndarray] = []
    if demand.containers:
        codes, masks = GpuFit(rules).fit(state, demand, nodes)
        reasons = np.where(reasons == 0, codes, reasons)
    if demand.mig:
        open_ = reasons == 0
        if open_.any():
            reasons[open_] = mig_fit(state, demand, nodes[open_])
    return Fit(state, nodes, reasons, masks)
