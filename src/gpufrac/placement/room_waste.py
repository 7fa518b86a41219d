"""Stranded room: how much of a partly used GPU the typical shares will never fill, and a scorer on it.

FGD (``fragmentation``) asks whether each typical pod fits the free room *now*. That makes it blind to
what the room becomes: a 0.32-GPU pod next to a 0.47 leaves 0.21, which only the rare 0.05-0.16 pods
fill, while the same pod in a 0.35 room leaves 0.03, and in a fresh GPU leaves 0.68, which a 0.65 pod
closes. At the end of the published replays almost a third of the free GPU sat in such small rooms between
shares (docs/benchmarks.md, "Where the missing points are").

``stranded_table`` estimates, for every free room r (thousandths of a GPU), the part of r still empty when
arrivals stop: while some typical one-GPU share fits, the next one that arrives is a weighted draw among
them and the room shrinks by it; arrivals stop at rate ``stop`` against the weight of the fitting shares,
so a room that only rare pods fit is mostly stranded:

    W[r] = (sum over fitting shares s of q_s W[r - s] + stop x r) / (sum of those q_s + stop)

with q_s a share's weight among the typical pods that want a GPU, W[r] = r when no share fits, and
W[1000] = 0: a whole GPU is never stranded, whole-GPU pods take it. A share pod placed on a GPU with room
r scores W[r] - W[r - share]: the stranded room it removes (negative: it strands room).

``RoomWaste`` is that score as a node scorer that also picks the GPU, for pods that share one GPU; every
other pod gets one constant value, so the next key (FGD) decides for them. ``fgd-room``, the default
policy, ranks by it first (``policies``). ``stop`` = 0.005 was the best of 0.001-0.05 on the default
trace; the ablation is in docs/benchmarks.md. Compute modes are not told apart here (FGD's key does).
With ``host`` (the default) the score also subtracts the GPU room the share's CPU strands when it leaves
its node too little CPU for any typical GPU pod (``fragmentation.cpu_stranded``): ranked first, the room
alone would close a room with CPU the node's empty GPUs need.

``RoomWaste.batch_key`` is fgd-room's look-ahead order for a batch of received pods: pods asking for a
whole GPU or more first, largest first; then shares, in tiers of the stranded room each would leave on a
fresh GPU (``ORDER_TIER`` thousandths per tier), least first; CPU-only pods last; arrival order within a
tier and among equals. The table for that order stops arrivals ten times sooner
(``ORDER_STOP_WEIGHT``, ``order_stop``): a batch decides who gets the GPUs that are free now, so what
fills a room soon matters, not what fills it eventually. On the default trace it places the 0.55 shares
(whose 0.45 room no typical share fills well) after the small ones, and keeps the common 0.81, 0.65 and
0.47 shares in arrival order: with 512-pod batches it reaches 96.41 % (10 seeds) and beats one pod at a
time on every published trace (docs/benchmarks.md, "GPU stranded next to exhausted CPU").
"""

from __future__ import annotations

import numpy as np

from .demand import SIZE_GPU_MIB, ContainerDemand, Demand
from .filters import Fit
from .fragmentation import stranded_by_cpu
from .scoring import milli_of
from .state import ClusterState
from .typical import TypicalSet, TypicalSource

STOP_WEIGHT = 0.005
"""Rate at which arrivals stop, against the weights of the typical GPU pods (which sum to 1)."""
ORDER_STOP_WEIGHT = 0.05
"""The same rate for the batch order (``RoomWaste.batch_key``): 0.02-0.05 measured best on the default
trace, 0.005 worst (docs/benchmarks.md)."""
ORDER_TIER = 50
"""Thousandths of stranded room per tier of the batch order: shares in one tier keep arrival order."""


def one_gpu_shares(typical: TypicalSet, cap_mib: int) -> list[tuple[int, float]]:
    """(thousandths of a ``cap_mib`` GPU, weight among the typical GPU pods) of each typical share."""
    wants = np.array([p.wants_gpu for p in typical.pods], dtype=bool)
    weights = typical.weights * wants
    total = float(weights.sum())
    if total <= 0:
        return []
    need = typical.need(cap_mib)
    return [
        (int(n), float(w) / total)
        for p, n, w in zip(typical.pods, need, weights, strict=True)
        if p.memory is not None and not p.exclusive and p.count == 1 and 0 < n < 1000 and w > 0
    ]


def stranded_table(shares: list[tuple[int, float]], stop: float = STOP_WEIGHT) -> np.ndarray:
    """(1001,) W[r]: thousandths of a GPU a room of r is expected to keep empty (module docstring)."""
    if stop <= 0:
        raise ValueError(f"stop must be positive, got {stop}")
    table = np.zeros(1001)
    if not shares:
        table[:1000] = np.arange(1000)
        return table
    size = np.array([s for s, _ in shares], dtype=np.int64)
    weight = np.array([w for _, w in shares])
    # The shares that fit change only where r reaches a share's size; in between they are kept (the
    # same arrays, so the same sums: the table is what the plain loop gives, to the last bit).
    changes = set(size.tolist())
    q, fitting, total = weight[:0], size[:0], 0.0
    for r in range(1, 1000):
        if r == 1 or r in changes:
            fits = size <= r
            q, fitting = weight[fits], size[fits]
            total = float(q.sum()) + stop
        table[r] = (float(q @ table[r - fitting]) + stop * r) / total
    return table


class RoomWaste:
    """Score a one-GPU share by the stranded room it removes (module docstring); choose that GPU.

    Reads ``source`` but does not feed it: in ``fgd-room`` the FGD scorer shares the source and observes
    the requests, so each request is counted once.
    """

    CLIP = 1000
    RANGE = 2 * CLIP + 1
    """Scores lie in 0..RANGE-1; every pod that is not a one-GPU share scores CLIP."""

    def __init__(
        self,
        source: TypicalSource,
        *,
        stop: float = STOP_WEIGHT,
        order_stop: float = ORDER_STOP_WEIGHT,
        order_tier: int = ORDER_TIER,
        host: bool = True,
        every_crossing: bool = False,
    ) -> None:
        if order_tier < 1:
            raise ValueError(f"order_tier must be at least 1 thousandth, got {order_tier}")
        self.source = source
        self.stop = stop
        self.order_stop = order_stop
        self.order_tier = order_tier
        self.host = host
        """Charge the GPU room the share's CPU strands (``fragmentation.cpu_stranded``) on the same scale."""
        self.every_crossing = every_crossing
        """Charge every typical pod whose CPU need the share crosses, not only a node left with too little
        CPU for any (an ablation; ``cpu_stranded``)."""
        self._tables: dict[tuple[int, int], np.ndarray] = {}
        self._order: tuple[int, np.ndarray] | None = None
        self._sizes_epoch = -1
        self._one_size = 0
        self._sizes = np.zeros(0, dtype=np.int64)
        self._stacked: tuple[tuple[int, int], np.ndarray] | None = None
        self._last: tuple[tuple[int, int], np.ndarray] | None = None
        self._took: dict[tuple[int, int], tuple[ContainerDemand, int]] = {}

    @property
    def epoch(self) -> int:
        return self.source.current().epoch

    def table(self, cap_mib: int) -> np.ndarray:
        """W for GPUs of ``cap_mib`` under the current typical pods, rounded to integers (memoised per
        snapshot)."""
        typical = self.source.current()
        key = (typical.epoch, cap_mib)
        last = self._last
        if last is not None and last[0] == key:  # the common case: one size, one snapshot for a while
            return last[1]
        found = self._tables.get(key)
        if found is None:
            if len(self._tables) > 64:
                self._tables.clear()  # old snapshots of an online source
            exact = stranded_table(one_gpu_shares(typical, cap_mib), self.stop)
            found = self._tables[key] = np.rint(exact).astype(np.int64)
        self._last = (key, found)
        return found

    def batch_key(self, demand: Demand) -> tuple[int, int, int]:
        """Where ``demand`` goes in a batch placed by look-ahead, larger first (module docstring).
        Shares are measured as ``Demand.size`` measures them (a MiB request against a ``SIZE_GPU_MIB``
        GPU) and ranked in tiers of ``ORDER_TIER`` stranded thousandths; within a tier they keep their
        arrival order. CPU and memory are left out on purpose, and so is the exact stranded room: both
        line up pods of one shape, and CPU-heavy pods of one shape placed one after another land on the
        same nodes and use up their CPU next to free GPUs (docs/benchmarks.md, "GPU stranded next to
        exhausted CPU")."""
        milli = demand.size[0]
        if milli >= 1000:
            return (2, 0, milli)
        if milli == 0:
            return (0, 0, 0)
        typical = self.source.current()
        if self._order is None or self._order[0] != typical.epoch:
            shares = one_gpu_shares(typical, SIZE_GPU_MIB)
            self._order = (typical.epoch, stranded_table(shares, self.order_stop))
        stranded = float(self._order[1][1000 - milli])
        return (1, -int(stranded // self.order_tier), 0)

    def one_size(self, state: ClusterState) -> int:
        """The GPU size in MiB when every GPU of the cluster has it, else 0 (re-read when nodes change)."""
        if state.spec_epoch != self._sizes_epoch:
            self._sizes_epoch = state.spec_epoch
            caps = state.cap[: state.rows][state.present[: state.rows]]
            self._sizes = np.unique(caps[caps > 0])
            self._one_size = int(self._sizes[0]) if self._sizes.size == 1 else 0
        return self._one_size

    def _removed_by_size(self, cap: np.ndarray, room: np.ndarray, left: np.ndarray) -> np.ndarray:
        """``table[room] - table[left]`` with each slot's own GPU size's table (0 on absent slots)."""
        sizes = self._sizes
        key = (self.source.current().epoch, self._sizes_epoch)
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = (key, np.stack([self.table(size) for size in sizes.tolist()]))
        at = np.minimum(np.searchsorted(sizes, cap), sizes.size - 1)
        if not (sizes[at] == cap)[cap > 0].all():  # a size the cluster did not have when last read
            removed = np.zeros(room.shape, dtype=np.int64)
            for size in np.unique(cap[cap > 0]).tolist():
                table = self.table(size)
                on = cap == size
                removed[on] = table[room[on]] - table[left[on]]
            return removed
        tables = self._stacked[1]
        return np.where(cap > 0, tables[at, room] - tables[at, left], 0)

    def took(self, single: ContainerDemand, cap_mib: int) -> int:
        """Thousandths of a ``cap_mib`` GPU the share ``single`` takes (``milli_of`` its request),
        memoised per container demand and size: a kind of pod is rescored on every node that changes."""
        key = (id(single), cap_mib)
        found = self._took.get(key)
        if found is None or found[0] is not single:  # an id reused by another demand: computed anew
            if len(self._took) > 1024:
                self._took.clear()
            cap = np.array([cap_mib], dtype=np.int64)
            found = self._took[key] = (single, int(milli_of(single.request_mib(cap), cap)[0]))
        return found[1]

    def per_gpu(self, state: ClusterState, demand: Demand, fit: Fit) -> np.ndarray:
        """(nodes, GPU slots) score of putting the one-GPU share ``demand`` on each slot."""
        single = demand.single
        assert single is not None
        room = fit.free_milli()  # 0..1000; 0 on absent slots, whose cap is 0
        size = self.one_size(state)
        if size:  # the common case: every GPU of the cluster has one size
            # One size: the share takes the same thousandths on every GPU. An absent slot (cap 0) has
            # no room, so it keeps none whatever the share takes, as with the per-slot arithmetic below.
            left = np.maximum(room - self.took(single, size), 0)
            table = self.table(size)
            removed = table[room] - table[left]  # |W[r] - W[r']| <= 1000: W lies in 0..r
        else:
            cap = state.cap[fit.nodes]
            left = np.maximum(room - milli_of(single.request_mib(cap), cap), 0)
            if self._sizes.size:
                removed = self._removed_by_size(cap, room, left)
            else:
                removed = np.zeros(room.shape, dtype=np.int64)
        if self.host:
            stranded = stranded_by_cpu(
                state, self.source.current(), demand, fit, every_crossing=self.every_crossing
            )
            if stranded is not None:  # None: nothing stranded, and removed >= -CLIP already
                removed = np.maximum(removed - np.rint(stranded).astype(np.int64), -self.CLIP)
        return self.CLIP + removed

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        single = demand.single
        if single is None or single.count != 1 or single.exclusive:
            return np.full(fit.nodes.size, self.CLIP, dtype=np.int64), None
        values = np.where(fit.masks[0], self.per_gpu(state, demand, fit), -1)
        best = values.argmax(axis=1)  # first maximum: lowest GPU index on ties
        return values.max(axis=1), best  # the value at ``best``
