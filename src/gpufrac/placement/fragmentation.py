"""GPU fragmentation against a typical-pod distribution, and the FGD scorer built on it.

The measure (Weng et al., ATC'23, the paper's pkg/utils/frag.go, re-derived here): for a node and a
typical pod k, the node's fragment is

- all its free GPU capacity when k cannot run there at all (k is CPU-only, the node's model is not
  allowed for k, too little free CPU, or fewer than k's count of GPUs with enough free room);
- otherwise the free capacity on the GPUs that cannot take one device of k.

The node's fragmentation is the weight-averaged fragment over typical pods. Everything is in thousandths
of a GPU (see scoring). FGD places a pod where the fragmentation grows least: its node score is
``int(sigmoid((frag_before - frag_after) / 1000) x 100)``, the truncation to an integer included because
the published results depend on it (the ties it creates go to the fixed node order). For a pod that
shares one GPU every GPU that fits is tried and the best one (lowest index on ties) is used.

Speed: the score of a node depends only on that node, so the engine recomputes only nodes that changed.
Here the after-placement fragmentation of every candidate GPU of every node is derived from the
before-placement terms in one vectorised pass: placing on GPU g changes only g's free room, the count of
GPUs that fit each typical pod, and the node's free CPU. Fragment differences are integers, so a
placement that changes nothing scores exactly sigmoid(0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .demand import Demand
from .filters import Fit
from .scoring import milli_of, reference_cap
from .state import EMPTY, EXCLUSIVE, MODE_CODE, MODE_CODES, ClusterState
from .typical import TypicalSet, TypicalSource


@dataclass(frozen=True, slots=True)
class Shapes:
    """Typical-pod arrays for a set of nodes: per-node share needs and per-pod constants."""

    need: np.ndarray  # (D, K) thousandths of a GPU per device of k; (1, K) when the nodes' GPUs are alike
    count: np.ndarray  # (K,)
    cpu: np.ndarray  # (K,)
    access: np.ndarray  # (D, K) k wants a GPU and may use this node's model
    mode: np.ndarray  # (K,) mode code of k
    weights: np.ndarray  # (K,)
    mode_ok: np.ndarray  # (mode codes, K) a GPU in that mode can take a device of k


def shapes_for(state: ClusterState, typical: TypicalSet, nodes: np.ndarray) -> Shapes:
    caps = reference_cap(state, nodes)
    first = caps[0] if caps.size else 0
    # Nodes whose GPUs are alike (the common case) share one row, which broadcasts over them.
    need = typical.need(int(first))[None, :] if (caps == first).all() else typical.need_rows(caps)
    return _with(typical, need, typical.access(state.model_names)[state.model[nodes]])


def _with(typical: TypicalSet, need: np.ndarray, access: np.ndarray) -> Shapes:
    """``Shapes`` of nodes with these per-node arrays; the per-pod ones are memoised on ``typical``."""
    modes = typical._memo.get("mode")
    if modes is None:
        modes = typical._memo["mode"] = np.array([MODE_CODE[p.mode] for p in typical.pods], dtype=np.int8)
        # (mode code of a GPU, K): may a device of k go on a GPU in that mode (empty, or k's own mode)
        codes = np.arange(MODE_CODES)[:, None]
        typical._memo["mode_ok"] = (codes == EMPTY) | (codes == modes[None, :])
    return Shapes(
        need=need,
        count=typical.column("count"),
        cpu=typical.column("cpu_milli"),
        access=access,
        mode=modes,
        weights=typical.weights,
        mode_ok=typical._memo["mode_ok"],
    )


def _usable(fm: np.ndarray, mode: np.ndarray, shapes: Shapes) -> np.ndarray:
    """(D, G, K): GPU g can take one device of typical pod k."""
    return (fm[:, :, None] >= shapes.need[:, None, :]) & shapes.mode_ok[mode]


def fragments(
    fm: np.ndarray, mode: np.ndarray, cpu: np.ndarray, shapes: Shapes, *, joint: bool = False
) -> np.ndarray:
    """(D, K) fragment of each node for each typical pod, in thousandths of a GPU."""
    return _fragments(fm, cpu, shapes, _usable(fm, mode, shapes), joint=joint)


def _terms(fm: np.ndarray, usable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total free (D,), room usable by k (D, K), GPUs usable by k (D, K)): the sums a fragment is made of."""
    return fm.sum(axis=1), (fm[:, :, None] * usable).sum(axis=1), usable.sum(axis=1)


def _fragments(
    fm: np.ndarray,
    cpu: np.ndarray,
    shapes: Shapes,
    usable: np.ndarray,
    *,
    joint: bool = False,
    terms: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    total, room, count = _terms(fm, usable) if terms is None else terms
    runs = shapes.access & (count >= shapes.count) & (cpu[:, None] >= shapes.cpu)
    if joint:
        room = _host_limited(room, _gpu_copies(fm, usable, shapes).sum(axis=1), _host_copies(cpu, shapes))
    return np.where(runs, total[:, None] - room, total[:, None])


_UNLIMITED = np.int64(1 << 40)


def _gpu_copies(fm: np.ndarray, usable: np.ndarray, shapes: Shapes) -> np.ndarray:
    """(D, G, K) devices of typical pod k each GPU could still hold (0 where it cannot take one)."""
    return usable * (fm[:, :, None] // np.maximum(shapes.need, 1)[:, None, :])


def _host_copies(cpu: np.ndarray, shapes: Shapes) -> np.ndarray:
    """(D, K) devices of typical pod k the node's free CPU leaves room for (k's CPU per device)."""
    per_device = -(-shapes.cpu // np.maximum(shapes.count, 1))
    return np.where(per_device > 0, cpu[:, None] // np.maximum(per_device, 1), _UNLIMITED)


def _host_limited(room: np.ndarray, copies: np.ndarray, host: np.ndarray) -> np.ndarray:
    """The part of ``room`` typical pod k can really use when CPU caps its copies at ``host``.

    Integer arithmetic on purpose: a placement that changes nothing must score exactly sigmoid(0).
    """
    return np.where(copies > host, room * np.minimum(host, copies) // np.maximum(copies, 1), room)


def node_fragmentation(
    state: ClusterState, typical: TypicalSet, nodes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(fragmentation, free) per node in thousandths of a GPU; their sums give the cluster's rate."""
    fm = state.free_milli(nodes)
    free = fm.sum(axis=1)
    if not typical.pods:
        return np.zeros(nodes.size), free
    shapes = shapes_for(state, typical, nodes)
    frag = fragments(fm, state.mode[nodes], state.cpu_free[nodes], shapes) @ shapes.weights
    return frag, free


def cpu_stranded(
    state: ClusterState, typical: TypicalSet, demand: Demand, fit: Fit, *, every_crossing: bool = False
) -> np.ndarray:
    """(D, G) thousandths of a GPU that the one-GPU share ``demand`` strands by its CPU, on each GPU:
    non-zero only where the share leaves its node too little free CPU for any typical GPU pod.

    Then FGD's fragment grows by the room the typical pods could still use before the share came and
    cannot use after, for want of CPU: that room, weighted, is the charge. Only that case is charged,
    not every typical pod whose CPU need the share crosses: charging each crossing kept shares off the
    small CPU-poor nodes, which CPU-heavy whole-GPU pods then took, stranding the other GPU (cpu050:
    -0.4 point; docs/benchmarks.md); ``every_crossing`` does that, for the ablation. The GPU side is
    left to the stranded room (``room_waste``).
    """
    found = stranded_by_cpu(state, typical, demand, fit, every_crossing=every_crossing)
    return np.zeros(fit.free_milli().shape) if found is None else found


def stranded_by_cpu(
    state: ClusterState, typical: TypicalSet, demand: Demand, fit: Fit, *, every_crossing: bool = False
) -> np.ndarray | None:
    """``cpu_stranded``, or None where it would be 0 on every GPU (the common case, told cheaply: no
    node is left short of CPU), so a scorer skips adding nothing."""
    nodes = fit.nodes
    single = demand.single
    if not typical.pods or demand.cpu_milli <= 0 or single is None:
        return None
    fm = fit.free_milli()
    cpu = state.cpu_free[nodes]
    cpu_after = cpu - demand.cpu_milli
    key = ("least_cpu", len(state.model_names))
    least_by_model = typical._memo.get(key)
    if least_by_model is None:  # per model: the least CPU a typical GPU pod allowed there asks for
        access = typical.access(state.model_names)
        least_by_model = typical._memo[key] = np.where(access, typical.column("cpu_milli"), _NEVER).min(
            axis=1
        )
    least = least_by_model[state.model[nodes]]  # (D,)
    if every_crossing:
        cpus = typical.column("cpu_milli")
        crossed = (cpu[:, None] >= cpus) & (cpu_after[:, None] < cpus)  # (D, K)
    else:  # only nodes the share leaves short of every typical GPU pod; checked first, cheaply
        short = (cpu_after < least) & (cpu >= least)
        if not short.any():
            return None
        crossed = (cpu[:, None] >= typical.column("cpu_milli")) & short[:, None]
    rows = np.flatnonzero(crossed.any(axis=1))
    if rows.size == 0:
        return None
    out = np.zeros(fm.shape)
    shapes = shapes_for(state, typical, nodes[rows])
    fm = fm[rows]
    usable = _usable(fm, state.mode[nodes[rows]], shapes)
    _, room, count = _terms(fm, usable)
    cap = state.cap[nodes[rows]]
    fa = np.maximum(state.free[nodes[rows]] - single.request_mib(cap), 0) * 1000 // np.maximum(cap, 1)
    mode_ok = shapes.mode[None, None, :] == MODE_CODE[single.mode]
    usable_after = (fa[:, :, None] >= shapes.need[:, None, :]) & mode_ok
    room_after = room[:, None, :] - fm[:, :, None] * usable + fa[:, :, None] * usable_after
    count_after = count[:, None, :] - usable + usable_after
    lost = shapes.access[:, None, :] & (count_after >= shapes.count) & crossed[rows][:, None, :]
    out[rows] = (lost * room_after) @ shapes.weights
    return out


class _BeforeTerms:
    """Per node, the terms every score starts from - the typical pods' needs on its GPUs and access to its
    model, the usable GPUs of each typical pod, their sums and the fragments before the pod - kept while
    the node's version holds.

    A placement changes one node, but every pod kind placed after it rescores that node (151 kinds on
    the default trace); without this each kind derived the same terms again. One instance per typical
    set and joint flag serves the engine's state; a hypothetical state (preemption's what-if) keeps the
    nodes' versions but not their free amounts, so it gets a fresh, uncached one (``scratch``).
    """

    def __init__(self, state: ClusterState, typical: TypicalSet, joint: bool, rows: int) -> None:
        self.state, self.typical, self.joint = state, typical, joint
        k = len(typical.pods)
        self.version = np.full(rows, -1, dtype=np.int64)
        self.need = np.zeros((rows, k), dtype=np.int64)
        self.access = np.zeros((rows, k), dtype=bool)
        self.usable = np.zeros((rows, state.cols, k), dtype=bool)
        self.total = np.zeros(rows, dtype=np.int64)
        self.room = np.zeros((rows, k), dtype=np.int64)
        self.count = np.zeros((rows, k), dtype=np.int64)
        self.before = np.zeros((rows, k), dtype=np.int64)

    @classmethod
    def scratch(
        cls, state: ClusterState, typical: TypicalSet, joint: bool, fit: Fit
    ) -> tuple[_BeforeTerms, np.ndarray, Shapes]:
        """Terms of ``fit``'s nodes, held in rows 0..D-1 (returned, with the nodes' shapes), kept nowhere."""
        rows = np.arange(fit.nodes.size)
        held = cls(state, typical, joint, rows.size)
        shapes = shapes_for(state, typical, fit.nodes)
        held._derive(rows, fit.free_milli(), state.mode[fit.nodes], state.cpu_free[fit.nodes], shapes)
        return held, rows, shapes

    def serves(self, state: ClusterState, typical: TypicalSet, joint: bool) -> bool:
        return (
            self.state is state
            and self.typical is typical
            and self.joint == joint
            and self.usable.shape[1] == state.cols
        )

    def refreshed(self, fit: Fit) -> tuple[np.ndarray, Shapes]:
        """Bring ``fit``'s nodes up to date; returns the rows they are held in (the node indices) and
        their shapes."""
        state, nodes = self.state, fit.nodes
        extra = state.rows - self.version.size
        if extra > 0:
            self.version = np.concatenate([self.version, np.full(extra, -1, dtype=np.int64)])
            for name in ("need", "access", "usable", "total", "room", "count", "before"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros((extra, *old.shape[1:]), old.dtype)]))
        stale = np.flatnonzero(self.version[nodes] != state.version[nodes])
        if stale.size:
            rows = nodes[stale]
            fm = fit.free_milli()[stale]
            self._derive(
                rows, fm, state.mode[rows], state.cpu_free[rows], shapes_for(state, self.typical, rows)
            )
            self.version[rows] = state.version[rows]
        return nodes, _with(self.typical, self.need[nodes], self.access[nodes])

    def _derive(
        self, rows: np.ndarray, fm: np.ndarray, mode: np.ndarray, cpu: np.ndarray, shapes: Shapes
    ) -> None:
        """Derive the terms of nodes with ``shapes`` (in their order) into ``rows``."""
        usable = _usable(fm, mode, shapes)
        terms = _terms(fm, usable)
        self.need[rows] = shapes.need
        self.access[rows] = shapes.access
        self.usable[rows] = usable
        self.total[rows], self.room[rows], self.count[rows] = terms
        self.before[rows] = _fragments(fm, cpu, shapes, usable, joint=self.joint, terms=terms)

    def terms(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.total[rows], self.room[rows], self.count[rows]


def _sigmoid_score(delta: np.ndarray, scale: float = 100.0) -> np.ndarray:
    return np.trunc(scale / (1.0 + np.exp(-delta / 1000.0))).astype(np.int64)


JointFor = Literal["none", "cpu-only", "all", "auto"]
CPU_BOUND_AT = 0.95
"""``joint="auto"`` scores every pod jointly once the workload's CPU per GPU reaches this share of the
cluster's (docs/placement.md, "Which policy by default": the published traces lie at 0.70-0.90, the
CPU-heavier variants, where joint scoring of every pod wins, at 1.03 and 1.13)."""


class Fgd:
    """Fragmentation gradient descent as a node scorer (and GPU chooser for single-device sharing pods).

    ``source`` supplies the typical-pod distribution (a prior or learned online); ``epoch`` tells the
    engine when it changed, so cached scores are dropped.

    ``joint`` chooses the pods whose score uses the joint GPU x CPU measure instead of the paper's
    GPU-only one: a typical pod's usable GPU room is cut to the devices the node's free CPU can still
    host, so CPU taken from a node with free GPUs is charged as the GPU it strands, gradually instead
    of only once the CPU falls below one typical pod's need. ``"cpu-only"``: only CPU-only pods (the
    ones that strand GPUs by taking a GPU node's CPU; GPU pods keep FGD's own score, whose ties the
    alignment tie-break relies on). ``"all"``: every pod. ``"auto"``: every pod while CPU is about as
    scarce as GPU - the typical pods ask for at least ``CPU_BOUND_AT`` of the cluster's CPU per GPU -
    else CPU-only pods. That input is cluster-wide, so ``prepare`` reads it and ``epoch`` moves when
    the choice flips. docs/benchmarks.md has the ablation.
    """

    def __init__(self, source: TypicalSource, *, scale: float = 100.0, joint: JointFor = "none") -> None:
        if joint not in ("none", "cpu-only", "all", "auto"):
            raise ValueError(f"joint must be 'none', 'cpu-only', 'all' or 'auto', got {joint!r}")
        self.source = source
        self.scale = scale
        self.joint = joint
        self._every_pod = joint == "all"
        self._spec_epoch = -1
        self._typical_epoch = -1
        self._cluster_cpu_per_gpu = 0.0
        self._cached: dict[bool, _BeforeTerms] = {}

    @property
    def epoch(self) -> int:
        return 2 * self.source.current().epoch + self._every_pod

    def forget(self) -> None:
        """Drop the kept node terms (``_BeforeTerms``): the next score derives every node anew."""
        self._cached.clear()

    def observe(self, demand: Demand) -> None:
        self.source.observe(demand)

    def prepare(self, state: ClusterState) -> None:
        """For ``joint="auto"``: is CPU about as scarce as GPU (class docstring)?"""
        if self.joint != "auto":
            return
        typical = self.source.current()
        if state.spec_epoch == self._spec_epoch and typical.epoch == self._typical_epoch:
            return
        if state.spec_epoch != self._spec_epoch:
            self._spec_epoch = state.spec_epoch
            live = state.present[: state.rows]
            gpus = int(state.gpu_count[: state.rows][live].sum())
            cpu = float(state.cpu_cap[: state.rows][live].sum())
            self._cluster_cpu_per_gpu = cpu / gpus if gpus else 0.0
        self._typical_epoch = typical.epoch
        gpu = float(sum(w * p.gpu_units for p, w in zip(typical.pods, typical.weights, strict=True)))
        cpu = float(sum(w * p.cpu_milli for p, w in zip(typical.pods, typical.weights, strict=True)))
        wanted = cpu / gpu if gpu > 0 else 0.0
        limit = CPU_BOUND_AT * self._cluster_cpu_per_gpu
        self._every_pod = limit > 0 and wanted >= limit

    def deltas(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        """Fragmentation decrease per node, or per node and GPU slot for a single shared device: then only
        where the returned mask holds (the GPUs it fits on), 0 elsewhere."""
        typical = self.source.current()
        nodes = fit.nodes
        fm = fit.free_milli()
        cpu = state.cpu_free[nodes]
        if not typical.pods:
            return np.zeros(nodes.size), None
        joint = self._every_pod or (self.joint in ("cpu-only", "auto") and not demand.wants_gpu)
        if state.hypothetical:
            held, rows, shapes = _BeforeTerms.scratch(state, typical, joint, fit)
        else:
            held = self._cached.get(joint)
            if held is None or not held.serves(state, typical, joint):
                held = self._cached[joint] = _BeforeTerms(state, typical, joint, state.rows)
            rows, shapes = held.refreshed(fit)
        before = held.before[rows]
        single = demand.single
        if single is not None and single.count == 1 and not single.exclusive:
            return self._single_gpu_deltas(state, demand, fit, held, rows, cpu, shapes, before, joint=joint)
        if not demand.containers:  # CPU only: the GPUs stay as they are, only the node's CPU moves
            usable = held.usable[rows] if joint else None  # only the joint measure reads it
            terms = held.terms(rows)
            after = _fragments(fm, cpu - demand.cpu_milli, shapes, usable, joint=joint, terms=terms)
            return (before - after) @ shapes.weights, None
        first = demand.containers[0]
        if len(demand.containers) == 1 and first.exclusive and not joint:
            # Whole GPUs: each GPU taken leaves every sum it was in; the rest of the node stays as it is.
            taken, ok = _first_taken(fm, fit.masks[0], first.count)  # (D, c) GPU indices, and which count
            was = np.where(ok, fm[np.arange(nodes.size)[:, None], taken], 0)
            gone = held.usable[rows[:, None], taken] & ok[:, :, None]  # (D, c, K)
            total, room, count = held.terms(rows)
            terms = (
                total - was.sum(axis=1),
                room - (was[:, :, None] * gone).sum(axis=1),
                count - gone.sum(axis=1),
            )
            after = _fragments(fm, cpu - demand.cpu_milli, shapes, None, terms=terms)
            return (before - after) @ shapes.weights, None
        fm_after, mode_after = fm.copy(), state.mode[nodes]  # a gather: a copy already
        for i, c in enumerate(demand.containers):
            chosen = _first_fitting(fm_after, fit.masks[i], c.count, exclusive=c.exclusive)
            cap = state.cap[nodes]
            if c.exclusive:
                fm_after[chosen] = 0
                mode_after[chosen] = EXCLUSIVE
            else:
                took = milli_of(c.request_mib(cap), cap)
                fm_after = np.where(chosen, np.maximum(fm_after - took, 0), fm_after)
                mode_after = np.where(chosen, MODE_CODE[c.mode], mode_after).astype(np.int8)
        after = fragments(fm_after, mode_after, cpu - demand.cpu_milli, shapes, joint=joint)
        return (before - after) @ shapes.weights, None

    def _single_gpu_deltas(
        self,
        state: ClusterState,
        demand: Demand,
        fit: Fit,
        held: _BeforeTerms,
        rows: np.ndarray,
        cpu: np.ndarray,
        shapes: Shapes,
        before: np.ndarray,
        *,
        joint: bool,
    ) -> tuple[np.ndarray, np.ndarray]:
        nodes = fit.nodes
        c = demand.containers[0]
        mask = fit.masks[0]
        d, g = np.nonzero(mask)  # only the GPUs the share fits on are scored: (P,) node and GPU of each
        cap = state.cap[nodes[d], g]
        free_after = np.maximum(state.free[nodes[d], g] - c.request_mib(cap), 0)
        fa = free_after * 1000 // np.maximum(cap, 1)  # (P,) free room of the GPU after the pod lands on it
        was = fit.free_milli()[d, g]
        on = rows[d]
        usable_was = held.usable[on, g]  # (P, K)
        need = shapes.need if shapes.need.shape[0] == 1 else shapes.need[d]
        usable_after = (fa[:, None] >= need) & (shapes.mode == MODE_CODE[c.mode])
        total_after = held.total[on] - (was - fa)  # (P,)
        room_after = held.room[on] - was[:, None] * usable_was + fa[:, None] * usable_after
        count_after = held.count[on] - usable_was + usable_after
        cpu_after = cpu - demand.cpu_milli
        runs = shapes.access[d] & (count_after >= shapes.count) & (cpu_after[d, None] >= shapes.cpu)
        if joint:
            per = _gpu_copies(fit.free_milli(), held.usable[rows], shapes)  # (D, G, K)
            lands = usable_after * (fa[:, None] // np.maximum(need, 1))  # copies the GPU holds after
            copies_after = per.sum(axis=1)[d] - per[d, g] + lands
            room_after = _host_limited(room_after, copies_after, _host_copies(cpu_after, shapes)[d])
        after = np.where(runs, total_after[:, None] - room_after, total_after[:, None])
        delta = np.zeros(mask.shape)  # (D, G); 0 where the share does not fit, which the mask hides
        delta[d, g] = (before[d] - after) @ shapes.weights
        return delta, mask

    def score(self, state: ClusterState, demand: Demand, fit: Fit) -> tuple[np.ndarray, np.ndarray | None]:
        delta, mask = self.deltas(state, demand, fit)
        if mask is None:
            return _sigmoid_score(delta, self.scale), None
        scores = np.where(mask, _sigmoid_score(delta, self.scale), -1)
        best = scores.argmax(axis=1)  # first maximum: lowest GPU index on ties
        return scores.max(axis=1), best  # the score at ``best``


_NEVER = np.iinfo(np.int64).max


def _first_taken(fm: np.ndarray, mask: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(D, count) the GPUs the paper's Sub() would take - least free room first, lowest index - and
    whether each is in ``mask`` (a node short of GPUs gets fewer)."""
    order = np.argsort(np.where(mask, fm, _NEVER), axis=1, kind="stable")[:, :count]
    return order, np.take_along_axis(mask, order, axis=1)


def _first_fitting(fm: np.ndarray, mask: np.ndarray, count: int, *, exclusive: bool) -> np.ndarray:
    """(D, G) the GPUs of ``_first_taken`` as a mask."""
    order, ok = _first_taken(fm, mask, count)
    chosen = np.zeros(mask.shape, dtype=bool)
    np.put_along_axis(chosen, order, ok, axis=1)
    return chosen
