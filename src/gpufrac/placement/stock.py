"""A model of the stock kube-scheduler placing pods whose ResourceClaims ask for GPU memory (DRA).

Why it exists: issue #18 asks how gpufrac's placement compares with what the default kube-scheduler
does with the same shares expressed as ResourceClaims on our ResourceSlice (consumable capacity,
KEP-5075). Running the real kube-scheduler on a 1,213-node replay is not practical here, so this module
models it with the engine's own pieces (two scorers and a GPU picker, ``policies`` registers them as
``kube-dra``); it is a model of the stock scheduler for comparisons, not a policy we recommend.

What the stock scheduler does (Kubernetes v1.37.2, the kube-scheduler testenv builds; files read in the
module cache of ``testenv/controlplane/go.mod``):

- **Node scores.** ``pkg/scheduler/apis/config/v1/default_plugins.go``: the default profile scores with
  NodeResourcesFit (weight 1), NodeResourcesBalancedAllocation (1), TaintToleration (3), NodeAffinity
  (2), PodTopologySpread (2), InterPodAffinity (2), ImageLocality (1) and, with DRA on,
  DynamicResources (2). For a replayed pod only the first two differ between nodes: no node has a
  PreferNoSchedule taint, no pod has preferred affinities or an owner that default spreading would
  select, and no image is known. DynamicResources scores only claims with a prioritized list
  (``firstAvailable``): ``Score`` in ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``
  returns 0 unless the feature is on and a claim's allocation used a sub-request, so an ``exactly``
  claim scores 0 on every node. The GPU itself therefore never enters the stock node score.
- **NodeResourcesFit** (``noderesources/fit.go``, ``least_allocated.go``): the default strategy is
  LeastAllocated over cpu and memory, weight 1 each: per resource ``(allocatable - requested) * 100 /
  allocatable`` in integers (0 when over), then the weighted integer mean. ``requested`` includes the pod.
  ``KubeLeastAllocated``.
- **NodeResourcesBalancedAllocation** (``noderesources/balanced_allocation.go``,
  ``resource_allocation.go``): with the two fractions requested/allocatable (capped at 1),
  ``int((1 - |f_cpu - f_mem| / 2) * 100)``; v1.37.2 scores the change the pod makes, ``50 + (50 + with -
  without) / 2``; a pod that requests neither resource is skipped (``isBestEffortPod``). v1.34.4 scored
  ``with`` alone. ``KubeBalancedAllocation`` models v1.37.2.
- **Device choice.** ``k8s.io/dynamic-resource-allocation`` v0.37.2, ``structured/allocator.go`` picks the
  ``incubating`` allocator (the one with consumable capacity, beta in 1.36/1.37);
  ``structured/internal/incubating/allocator_incubating.go`` (``allocateOne``) walks pools, slices and the
  slice's devices in order and takes the first device whose selectors match and whose capacity has
  room (``CmpRequestOverCapacity``); the next device of the same request is searched from the one after
  it, and it backtracks only when a later request of the pod's claims cannot be met. Our slice lists a
  node's GPUs in inventory order (``gpufrac.node.dra.slices``), which is the engine's GPU order, so
  ``FirstFitGpu`` takes the first GPU with room, and a request for N devices the first N.
- **Ties.** v1.34.4's ``selectHost`` (``pkg/scheduler/schedule_one.go``) picks uniformly at random among
  the top score (reservoir sampling); v1.37.2 pops a heap (``framework/sorted_nodes.go``) whose
  ``Randomizer`` is set only when extenders run, so which top-scored node wins is set by the order of a
  node scan that starts at a rotating index. Neither prefers a node for long; the model uses the
  engine's fixed random node order of each seed (``engine.tie_rank``), which keeps replays reproducible.

Why the amounts are faithful: a claim for a share of a GPU consumes its capacity request rounded up to
the slice's ``requestPolicy`` step (``structured/internal/incubating/consumable_capacity.go``,
``roundUpRange``); our slice's step is 1 MiB, so a claim for ``p`` of a GPU of ``c`` MiB consumes
``ceil(p x c)`` MiB. The simulator expresses such pods as ``GpuMemory(portion=p, round_up=True)``
(``gpufrac.sim.scenarios``, scenario ``claims``), which the engine resolves exactly so; annotation pods
round down (``floor``).

What it leaves out, and what that does:

- ``percentageOfNodesToScore``: with the default (0, adaptive) the scheduler stops filtering after
  ``numFeasibleNodesToFind`` feasible nodes (``max(5, 50 - nodes/125)`` percent, at least 100: 497 of the
  openb trace's 1,213 nodes) from the rotating start index, and scores only those. The model scores every
  feasible node, so it spreads at least as evenly as the real scheduler; its node is the best of all, the
  real one's the best of a sample.
- NonZeroRequested: LeastAllocated counts a container that requests no CPU or memory as 100m / 200 MB;
  the model uses the requests as they are (one pod of the openb lists asks for no memory; none for no CPU).
- Compute modes: the stock allocator matches our DeviceClass selectors only, so it may put a
  time-slicing claim on a GPU that holds sm-sharing claims (the node then refuses it at prepare,
  docs/dra.md). The model keeps the engine's filters, one mode per GPU; the published traces are
  time-slicing only, so this changes nothing there.
- Prioritized lists (``firstAvailable``), admin access, device taints, constraints across requests and
  the scheduler's queueing and preemption: no replayed claim uses them.
"""

from __future__ import annotations

import numpy as np

from .demand import ContainerDemand, Demand
from .filters import Fit
from .state import ClusterState

MAX_NODE_SCORE = 100
"""``fwk.MaxNodeScore``: the range every default score plugin returns."""


def _least_requested(requested: np.ndarray, allocatable: np.ndarray) -> np.ndarray:
    """``leastRequestedScore``: unused share 0..100 in integer arithmetic, 0 when over capacity."""
    safe = np.maximum(allocatable, 1)
    score = (allocatable - requested) * MAX_NODE_SCORE // safe
    return np.where((allocatable == 0) | (requested > allocatable), 0, score)


class KubeLeastAllocated:
    """NodeResourcesFit's default score: LeastAllocated over cpu and memory, weight 1 each (module
    docstring). A resource a node has none of is left out of the mean, as kube-scheduler does."""

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        total = np.zeros(nodes.size, dtype=np.int64)
        weights = np.zeros(nodes.size, dtype=np.int64)
        for cap, free, ask in (
            (state.cpu_cap[nodes], state.cpu_free[nodes], demand.cpu_milli),
            (state.mem_cap[nodes], state.mem_free[nodes], demand.memory_bytes),
        ):
            total += _least_requested(cap - free + ask, cap)
            weights += cap > 0
        return np.where(weights > 0, total // np.maximum(weights, 1), 0), None


def _balance(
    cpu_used: np.ndarray, cpu_cap: np.ndarray, mem_used: np.ndarray, mem_cap: np.ndarray
) -> np.ndarray:
    """``balancedResourceScore`` for cpu and memory: ``int((1 - std) * 100)``, std of the two capped
    fractions (0 when a node has only one of the resources)."""
    f_cpu = np.minimum(cpu_used / np.maximum(cpu_cap, 1), 1.0)
    f_mem = np.minimum(mem_used / np.maximum(mem_cap, 1), 1.0)
    std = np.where((cpu_cap > 0) & (mem_cap > 0), np.abs(f_cpu - f_mem) / 2, 0.0)
    return np.trunc((1.0 - std) * MAX_NODE_SCORE).astype(np.int64)


class KubeBalancedAllocation:
    """NodeResourcesBalancedAllocation of v1.37.2: how much the pod improves the node's cpu/memory
    balance (module docstring); 0 everywhere for a pod that requests neither."""

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        nodes = fit.nodes
        if demand.cpu_milli == 0 and demand.memory_bytes == 0:
            return np.zeros(nodes.size, dtype=np.int64), None
        cpu_cap, mem_cap = state.cpu_cap[nodes], state.mem_cap[nodes]
        cpu_used, mem_used = cpu_cap - state.cpu_free[nodes], mem_cap - state.mem_free[nodes]
        without = _balance(cpu_used, cpu_cap, mem_used, mem_cap)
        with_pod = _balance(cpu_used + demand.cpu_milli, cpu_cap, mem_used + demand.memory_bytes, mem_cap)
        half = MAX_NODE_SCORE // 2
        return half + (half + with_pod - without) // 2, None


class FirstFitGpu:
    """The structured allocator's device order: the node's GPUs in slice order (the engine's GPU order),
    the first that can take the container first."""

    def order(
        self, state: ClusterState, container: ContainerDemand, node: int, mask: np.ndarray
    ) -> np.ndarray:
        return np.flatnonzero(mask)

    def first(self, fit: Fit, container: int) -> np.ndarray:
        """``order(...)[0]`` on every node of ``fit`` at once (the first True of each mask row)."""
        return fit.masks[container].argmax(axis=1)
