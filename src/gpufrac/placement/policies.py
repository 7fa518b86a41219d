"""Placement policies: named sets of scorers plus a GPU picker, never forks of the engine.

- ``binpack``: the paper's BestFit node score, best-fit GPU (least free room that fits).
- ``spread``: least allocated node, most free GPU.
- ``kai``: KAI Scheduler's GPU binpack, as a baseline: least unallocated GPU on the node, most used GPU
  first (gpupack).
- ``fgd``: fragmentation gradient descent (Weng et al., ATC'23) against a typical-pod distribution: a
  prior from the workload when the engine is given one, else learned online from the requests it sees.
- ``fgd-align``: ours. FGD's integer score first; among the nodes FGD cannot tell apart, those where the
  pod's (CPU, GPU) shape best matches the node's free (CPU, GPU), in ten coarse steps; remaining ties in
  the fixed node order. FGD measures GPU fragments but treats CPU only as a yes/no threshold, so it lets
  CPU-heavy pods exhaust the CPU of GPU-dense nodes and strand their GPUs; alignment steers them to
  CPU-rich nodes. See docs/placement.md for the measurements.
- ``fgd-plus``: ours. fgd-align, with two additions measured in the ablation (docs/benchmarks.md):
  FGD's joint GPU x CPU measure (``Fgd(joint="auto")``: CPU taken from a node with free GPUs is charged
  as the GPU it strands) for CPU-only pods, and for every pod when the workload asks for about as much
  CPU per GPU as the cluster has; and a batch of pods already received is placed largest first
  (look-ahead, ``largest_first``).
- ``fgd-room``: ours, the default of the scheduler service and ``gpufrac up``. fgd-plus with one key in
  front for pods that share one GPU: the room they leave stranded (``room_waste``), so a share closes a
  room the typical shares would not fill instead of cutting a fresh one down to a dead end, charged for
  the GPU room its CPU strands when it leaves the node too little CPU for any typical GPU pod. Other pods
  score alike on that key and are placed by fgd-plus's keys. Its look-ahead orders a batch by the same
  measure (``RoomWaste.batch_key``): whole GPUs first, then the shares in tiers of the room they strand.
- ``kube-dra``: not ours, and not a recommendation: a model of the stock kube-scheduler placing pods
  whose ResourceClaims ask for shares of our GPUs (``gpufrac.placement.stock``: its default cpu/memory
  scores for the node, the DRA allocator's first device with room for the GPU), to measure our policies
  against (docs/dra.md, "Ours against the stock allocator").

A policy's score is the weighted sum of its scorers. ``lexicographic`` builds "first A, then B" by giving
A a weight larger than B's range. The first scorer that proposes a GPU for a single-device pod decides
it; otherwise the picker orders the node's GPUs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .demand import Demand
from .filters import Fit
from .fragmentation import Fgd
from .room_waste import RoomWaste
from .scoring import (
    SCORE_LIMIT,
    Alignment,
    BestFit,
    BestFitGpu,
    Epoched,
    FirstGpuPicker,
    GpuPicker,
    Learning,
    LeastAllocated,
    MostAllocatedGpu,
    Preparing,
    Scorer,
    WorstFitGpu,
)
from .state import ClusterState
from .stock import FirstFitGpu, KubeBalancedAllocation, KubeLeastAllocated
from .typical import OnlineTypicalPods, PriorTypicalPods, TypicalPod, TypicalSource


@dataclass(frozen=True, slots=True)
class Policy:
    """Scorers with weights and a GPU picker; their optional abilities (``scoring``'s ``Epoched``,
    ``Preparing``, ``Learning``, ``FirstGpuPicker``) are resolved once, here, not looked up per call."""

    name: str
    scorers: tuple[tuple[Scorer, int], ...]
    picker: GpuPicker
    largest_first: bool = False
    """Look-ahead: a batch of pods already received is placed in ``batch_key``'s order (``fair_share``)."""
    batch_key: Callable[[Demand], tuple[int, ...]] | None = field(default=None, compare=False)
    """The look-ahead's order, larger first, when it is not ``Demand.size`` (largest first)."""
    epoched: tuple[Epoched, ...] = field(init=False, repr=False, compare=False)
    preparing: tuple[Preparing, ...] = field(init=False, repr=False, compare=False)
    learning: tuple[Learning, ...] = field(init=False, repr=False, compare=False)
    first_gpu: FirstGpuPicker | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        scorers = [scorer for scorer, _ in self.scorers]
        # object.__setattr__: the dataclass is frozen; these are derived once from its fields.
        object.__setattr__(self, "epoched", tuple(s for s in scorers if isinstance(s, Epoched)))
        object.__setattr__(self, "preparing", tuple(s for s in scorers if isinstance(s, Preparing)))
        object.__setattr__(self, "learning", tuple(s for s in scorers if isinstance(s, Learning)))
        object.__setattr__(
            self, "first_gpu", self.picker if isinstance(self.picker, FirstGpuPicker) else None
        )

    @property
    def epoch(self) -> tuple[int, ...]:
        """Changes when a scorer's global input changes (a learned distribution, the cluster's shape)."""
        return tuple(s.epoch for s in self.epoched)

    def prepare(self, state: ClusterState) -> None:
        """Let scorers with cluster-wide inputs look at the cluster before a placement."""
        for scorer in self.preparing:
            scorer.prepare(state)

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        if len(self.scorers) == 1 and self.scorers[0][1] == 1:
            values, chosen = self.scorers[0][0].score(state, demand, fit)
            return np.minimum(values, SCORE_LIMIT - 1), chosen
        total = np.zeros(fit.nodes.size, dtype=np.int64)
        gpu: np.ndarray | None = None
        for scorer, weight in self.scorers:
            values, chosen = scorer.score(state, demand, fit)
            total += values * weight
            if gpu is None and chosen is not None:
                gpu = chosen
        return np.minimum(np.maximum(total, 0), SCORE_LIMIT - 1), gpu

    def observe(self, demand: Demand) -> None:
        """Tell learning scorers about a request being scheduled."""
        for scorer in self.learning:
            scorer.observe(demand)


def lexicographic(first: Scorer, then: Scorer, *, then_range: int = 101) -> tuple[tuple[Scorer, int], ...]:
    return ((first, then_range), (then, 1))


Prior = Counter[TypicalPod]
"""Shape counts of the expected workload (FGD's prior); None means learn online."""
PolicyFactory = Callable[[Prior | None], Policy]


def _typical(prior: Prior | None, *, by_gpu: bool = False) -> TypicalSource:
    if prior is None:
        return OnlineTypicalPods(by_gpu=by_gpu)
    return PriorTypicalPods(prior, by_gpu=by_gpu)


def _fgd_room(typical: TypicalSource) -> Policy:
    """Stranded room first, then FGD (joint where CPU is scarce), then alignment; one typical source,
    fed by the FGD scorer only (``RoomWaste`` reads it)."""
    room, fgd, align = RoomWaste(typical), Fgd(typical, joint="auto"), Alignment(levels=10)
    return Policy(
        "fgd-room",
        ((room, 101 * 11), (fgd, 11), (align, 1)),
        BestFitGpu(),
        largest_first=True,
        batch_key=room.batch_key,
    )


POLICIES: dict[str, PolicyFactory] = {
    "binpack": lambda _: Policy("binpack", ((BestFit(), 1),), BestFitGpu()),
    "spread": lambda _: Policy("spread", ((LeastAllocated(), 1),), WorstFitGpu()),
    "kai": lambda _: Policy("kai", ((MostAllocatedGpu(), 1),), BestFitGpu()),
    "fgd": lambda prior: Policy("fgd", ((Fgd(_typical(prior)), 1),), BestFitGpu()),
    "fgd-align": lambda prior: Policy(
        "fgd-align", lexicographic(Fgd(_typical(prior)), Alignment(levels=10), then_range=11), BestFitGpu()
    ),
    "fgd-plus": lambda prior: Policy(
        "fgd-plus",
        lexicographic(Fgd(_typical(prior), joint="auto"), Alignment(levels=10), then_range=11),
        BestFitGpu(),
        largest_first=True,
    ),
    "fgd-room": lambda prior: _fgd_room(_typical(prior)),
    "kube-dra": lambda _: Policy(
        "kube-dra", ((KubeLeastAllocated(), 1), (KubeBalancedAllocation(), 1)), FirstFitGpu()
    ),
}
DEFAULT_POLICY = "fgd-room"
"""The policy of the scheduler service and ``gpufrac up`` unless configured (docs/placement.md: why)."""


def make_policy(name: str, prior: Prior | None = None) -> Policy:
    """The policy called ``name``; FGD-based ones use ``prior`` if given, else learn online."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(prior)
