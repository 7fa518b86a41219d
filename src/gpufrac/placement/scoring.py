"""Scorers and GPU pickers: how good a feasible node is for a pod, and which of its GPUs to use.

A ``Scorer`` is vectorised over the feasible nodes and returns integer scores (higher is better) and,
optionally, the GPU it would use on each node when the pod needs exactly one device (FGD picks the GPU
while scoring). Scorers must be node-local: a node's score depends only on that node and the pod. That
is what lets the engine cache scores per (kind of pod, node) and recompute only the nodes that changed;
a scorer with global inputs (a learned distribution) exposes an ``epoch`` that invalidates the cache.

Optional abilities are declared, not discovered: a scorer that has an ``epoch``, wants to ``prepare`` on
the whole cluster, or learns by ``observe``-ing requests implements ``Epoched``, ``Preparing`` or
``Learning``; a picker that can answer for every node at once implements ``FirstGpuPicker``. A policy
resolves them once when it is built (``gpufrac.placement.policies.Policy``), as kube-scheduler's
framework sorts plugins by the extension points they implement.

Scores are integers so ties are exact and are broken by the engine's seeded node order, as the paper's
simulator does (its scores are integers 0..100). GPU amounts are compared in thousandths of a GPU
(``ClusterState.free_milli``: free MiB x 1000 // capacity), the unit of the paper's arithmetic: free
amounts round down and requests round up, which reproduces the integer shares of a portion-only
workload exactly.

A ``GpuPicker`` orders the GPUs of one node that can take a container; the first ``count`` are used.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from .demand import ContainerDemand, Demand
from .filters import Fit
from .state import ClusterState

SCORE_LIMIT = 1 << 22
"""Scores must lie in [0, SCORE_LIMIT): the engine packs score and tie-break rank into one int64."""


class Scorer(Protocol):
    """Scores for ``fit.nodes`` (all feasible); second value: chosen GPU slot per node, or None."""

    def score(
        self, state: ClusterState, demand: Demand, fit: Fit
    ) -> tuple[np.ndarray, np.ndarray | None]: ...


class GpuPicker(Protocol):
    """GPU slots of ``node`` that can take ``container`` (``mask``), best first."""

    def order(
        self, state: ClusterState, container: ContainerDemand, node: int, mask: np.ndarray
    ) -> np.ndarray: ...


@runtime_checkable
class Epoched(Protocol):
    """A scorer with a cluster-wide input: ``epoch`` moves when that input changes, and the engine then
    drops the scores it cached for every kind of pod."""

    @property
    def epoch(self) -> int: ...


@runtime_checkable
class Preparing(Protocol):
    """A scorer that looks at the whole cluster before each placement (called before scoring)."""

    def prepare(self, state: ClusterState) -> None: ...


@runtime_checkable
class Learning(Protocol):
    """A scorer that learns from the requests the engine schedules (each pod once, however often retried)."""

    def observe(self, demand: Demand) -> None: ...


@runtime_checkable
class FirstGpuPicker(Protocol):
    """A picker that gives ``order(...)[0]`` for container ``container`` on every node of ``fit`` at once."""

    def first(self, fit: Fit, container: int) -> np.ndarray: ...


# -- units --------------------------------------------------------------------------------------------


def milli_of(mib: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """A request of ``mib`` on GPUs of ``cap`` in thousandths of a GPU, rounded up."""
    cap = np.maximum(cap, 1)
    return (mib * 1000 + cap - 1) // cap


def reference_cap(state: ClusterState, nodes: np.ndarray) -> np.ndarray:
    """The largest GPU of each node: the GPU size node-level amounts are expressed in."""
    return state.cap[nodes].max(axis=1) if state.cols else np.zeros(nodes.size, dtype=np.int64)


def request_milli_total(demand: Demand, cap_ref: np.ndarray) -> np.ndarray:
    """Thousandths of a GPU the whole pod takes on each node (GPU size ``cap_ref``)."""
    total = np.zeros(cap_ref.shape, dtype=np.int64)
    for c in demand.containers:
        per = (
            np.full(cap_ref.shape, 1000, dtype=np.int64)
            if c.exclusive
            else milli_of(c.request_mib(cap_ref), cap_ref)
        )
        total += per * c.count
    return total


# -- scorers ------------------------------------------------------------------------------------------


class BestFit:
    """The paper's BestFit: least free CPU and GPU left after placement, each against a maximum node
    spec (128 cores, 8 GPUs), weights 1/2 each, scaled to an integer 0..100 (truncated, as in Go)."""

    def __init__(self, *, max_cpu_milli: int = 128_000, max_gpu_milli: int = 8_000) -> None:
        self.max_cpu = float(max_cpu_milli)
        self.max_gpu = float(max_gpu_milli)

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        cap_ref = reference_cap(state, nodes)
        gfree = fit.free_milli().sum(axis=1)
        cfree = state.cpu_free[nodes]
        s = (cfree - demand.cpu_milli) / self.max_cpu * 0.5 + (
            gfree - request_milli_total(demand, cap_ref)
        ) / self.max_gpu * 0.5
        return np.maximum(np.trunc((1.0 - s) * 100.0), 0).astype(np.int64), None


class LeastAllocated:
    """Spread: most free share of CPU and GPU left after placement, 0..100."""

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        cap_ref = reference_cap(state, nodes)
        gcap = state.gpu_count[nodes] * 1000
        gleft = fit.free_milli().sum(axis=1) - request_milli_total(demand, cap_ref)
        cleft = state.cpu_free[nodes] - demand.cpu_milli
        gpu_part = np.where(gcap > 0, gleft / np.maximum(gcap, 1), 0.0)
        cpu_part = cleft / np.maximum(state.cpu_cap[nodes], 1)
        weight_gpu = 0.5 if demand.wants_gpu else 0.0
        s = (1.0 - weight_gpu) * cpu_part + weight_gpu * gpu_part
        return np.maximum(np.trunc(s * 100.0), 0).astype(np.int64), None


class MostAllocatedGpu:
    """KAI's GPU binpack node order: the node with the least unallocated GPU (absolute) after placement
    wins; CPU is not considered."""

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        cap_ref = reference_cap(state, nodes)
        left = fit.free_milli().sum(axis=1) - request_milli_total(demand, cap_ref)
        return np.maximum(SCORE_LIMIT // 2 - left, 0), None


class Alignment:
    """How well the pod's (CPU, GPU) shape matches the node's free (CPU, GPU), in ``levels`` steps.

    Multi-resource alignment (Tetris, Grandl et al., SIGCOMM'14): the cosine between the pod's demand and
    the node's free vector, CPU expressed in GPUs at the cluster's own CPU-per-GPU ratio. A CPU-heavy pod
    goes where CPU is plentiful relative to free GPU, a CPU-light one where CPU is scarce, so neither
    strands the other resource. Coarse steps keep ties, which the engine breaks in its fixed node order
    (first fit): a continuous score would scatter pods over the cluster.

    The ratio is a cluster-wide input: ``prepare`` recomputes it when the node set changes and ``epoch``
    moves when it changes enough (0.5 core per GPU) to matter.
    """

    def __init__(self, *, levels: int = 10) -> None:
        self.levels = levels
        self.cpu_per_gpu_milli = 17.0
        self._spec_epoch = -1
        self.epoch = 0
        self._requests: dict[tuple[int, int], tuple[Demand, float]] = {}

    def prepare(self, state: ClusterState) -> None:
        if state.spec_epoch == self._spec_epoch:
            return
        self._spec_epoch = state.spec_epoch
        live = state.present[: state.rows]
        gpus = int(state.gpu_count[: state.rows][live].sum())
        if gpus:
            ratio = round(2 * float(state.cpu_cap[: state.rows][live].sum()) / (gpus * 1000)) / 2
            if ratio > 0 and ratio != self.cpu_per_gpu_milli:
                self.cpu_per_gpu_milli = ratio
                self.epoch += 1

    def gpu_request(self, state: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray | float:
        """``request_milli_total`` on each node as floats; one number when the nodes' reference GPUs
        are alike (the common case), memoised per demand and size: a kind of pod is rescored on every
        node that changes, and the same value broadcast gives the same cosine."""
        cap_ref = reference_cap(state, nodes)
        first = int(cap_ref[0]) if cap_ref.size else 0
        if not cap_ref.size or not (cap_ref == first).all():
            return request_milli_total(demand, cap_ref).astype(np.float64)
        key = (id(demand), first)
        found = self._requests.get(key)
        if found is None or found[0] is not demand:
            if len(self._requests) > 1024:
                self._requests.clear()
            total = request_milli_total(demand, np.array([first], dtype=np.int64))
            found = self._requests[key] = (demand, float(total[0]))
        return found[1]

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        gpu_free = fit.free_milli().sum(axis=1).astype(np.float64)
        cpu_free = state.cpu_free[nodes] / self.cpu_per_gpu_milli
        gpu_req = self.gpu_request(state, demand, nodes)
        cpu_req = demand.cpu_milli / self.cpu_per_gpu_milli
        dot = gpu_free * gpu_req + cpu_free * cpu_req
        norm = np.hypot(gpu_free, cpu_free) * np.hypot(gpu_req, cpu_req)
        cosine = np.divide(dot, norm, out=np.zeros_like(dot), where=norm > 0)
        return np.floor(cosine * self.levels).astype(np.int64), None


# -- GPU pickers --------------------------------------------------------------------------------------


def _ordered(keys: np.ndarray, mask: np.ndarray) -> np.ndarray:
    candidates = np.flatnonzero(mask)
    return candidates[np.argsort(keys[candidates], kind="stable")]


_BIG = np.iinfo(np.int64).max


class BestFitGpu:
    """Least free first (the most used GPU that still fits: KAI's gpupack), lowest index on ties."""

    def order(
        self, state: ClusterState, container: ContainerDemand, node: int, mask: np.ndarray
    ) -> np.ndarray:
        return _ordered(state.free_milli(np.array([node]))[0], mask)

    def first(self, fit: Fit, container: int) -> np.ndarray:
        """``order(...)[0]`` for container ``container`` on every node of ``fit`` at once."""
        return np.where(fit.masks[container], fit.free_milli(), _BIG).argmin(axis=1)


class WorstFitGpu:
    """Most free first (spread), lowest index on ties."""

    def order(
        self, state: ClusterState, container: ContainerDemand, node: int, mask: np.ndarray
    ) -> np.ndarray:
        return _ordered(-state.free_milli(np.array([node]))[0], mask)

    def first(self, fit: Fit, container: int) -> np.ndarray:
        return np.where(fit.masks[container], -fit.free_milli(), _BIG).argmin(axis=1)
