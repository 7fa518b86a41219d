"""The distribution of typical requests that fragmentation is measured against.

FGD (Weng et al., ATC'23) calls GPU capacity a fragment when the requests that usually arrive could not
use it. "Usually arrive" is a distribution of typical pods: the most frequent request shapes, taken in
decreasing frequency until they cover 95% of pods, then renormalised. The paper builds it once from the
workload (a prior); a scheduler in production does not know its workload in advance, so
``OnlineTypicalPods`` learns it from the requests the engine has seen and publishes a new snapshot at
growing intervals (each snapshot invalidates cached scores, so snapshots must be rare).

A typical pod's GPU memory is kept as the contract's ``GpuMemory`` (a portion or whole MiB), resolved per
node like any request; ``share_milli`` turns it into thousandths of that node's GPU, the unit the
fragmentation arithmetic runs in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from gpufrac.contract.keys import GPU_MODEL_LABEL
from gpufrac.contract.request import ComputeMode, GpuMemory

from .demand import Demand
from .model import SelectorOperator

COVERAGE = 0.95
REFERENCE_GPU_MIB = 32768


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """One request shape. ``memory`` None means CPU only; ``exclusive`` whole GPUs; ``models`` None = any."""

    cpu_milli: int
    memory: GpuMemory | None
    count: int = 1
    exclusive: bool = False
    models: frozenset[str] | None = None
    mode: ComputeMode = ComputeMode.TIME_SLICING

    @property
    def wants_gpu(self) -> bool:
        return self.exclusive or self.memory is not None

    @property
    def gpu_units(self) -> float:
        """GPUs this pod asks for in all (a MiB request counted against a 32 GiB GPU)."""
        if self.exclusive:
            return float(self.count)
        if self.memory is None:
            return 0.0
        if self.memory.portion is not None:
            return self.count * self.memory.portion
        assert self.memory.mib is not None
        return self.count * min(1.0, self.memory.mib / REFERENCE_GPU_MIB)

    def share_milli(self, cap_mib: np.ndarray) -> np.ndarray:
        """Thousandths of a GPU of ``cap_mib`` this pod needs per device (1000 when exclusive)."""
        cap = np.maximum(cap_mib, 1)
        if self.exclusive:
            return np.full(cap.shape, 1000, dtype=np.int64)
        if self.memory is None:
            return np.zeros(cap.shape, dtype=np.int64)
        if self.memory.mib is not None:
            mib = np.minimum(np.full(cap.shape, self.memory.mib, dtype=np.int64), cap)
        else:
            assert self.memory.portion is not None
            mib = np.maximum(1, np.floor(self.memory.portion * cap)).astype(np.int64)
        return (mib * 1000 + cap - 1) // cap


@dataclass(frozen=True, slots=True)
class TypicalSet:
    """Typical pods with normalised weights; ``epoch`` changes whenever the set does.

    The per-GPU-size and per-model arrays the fragmentation arithmetic needs are memoised here, since a
    set is immutable and is consulted for every node scored.
    """

    pods: tuple[TypicalPod, ...]
    weights: np.ndarray
    epoch: int = 0
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def access(self, model_names: list[str]) -> np.ndarray:
        """(models x K) bool: may typical pod k run on a node of model m (and does it want a GPU)."""
        key = ("access", len(model_names))
        found = self._memo.get(key)
        if found is None:
            found = np.array(
                [
                    [p.wants_gpu and bool(m) and (p.models is None or m in p.models) for p in self.pods]
                    for m in model_names
                ],
                dtype=bool,
            ).reshape(len(model_names), len(self.pods))
            self._memo[key] = found
        return found

    def need(self, cap_mib: int) -> np.ndarray:
        """(K,) thousandths of a GPU of ``cap_mib`` each typical pod needs per device."""
        found = self._memo.get(cap_mib)
        if found is None:
            cap = np.array([cap_mib], dtype=np.int64)
            found = np.array([int(p.share_milli(cap)[0]) for p in self.pods], dtype=np.int64)
            self._memo[cap_mib] = found
        return found

    def need_rows(self, caps: np.ndarray) -> np.ndarray:
        """(D, K) ``need`` for each GPU size in ``caps``, from one table of the sizes seen so far."""
        known, table = self._memo.get("need_table", (np.zeros(0, dtype=np.int64), None))
        at = np.searchsorted(known, caps)
        if table is None or (at >= known.size).any() or (known[np.minimum(at, known.size - 1)] != caps).any():
            known = np.union1d(known, caps).astype(np.int64)
            table = np.stack([self.need(c) for c in known.tolist()])
            self._memo["need_table"] = (known, table)
            at = np.searchsorted(known, caps)
        return table[at]

    def column(self, name: str) -> np.ndarray:
        """(K,) per-pod constant: ``count``, ``cpu_milli``."""
        found = self._memo.get(name)
        if found is None:
            found = self._memo[name] = np.array([getattr(p, name) for p in self.pods], dtype=np.int64)
        return found


def select_typical(
    counts: Counter[TypicalPod], *, epoch: int = 0, coverage: float = COVERAGE, by_gpu: bool = False
) -> TypicalSet:
    """The most frequent shapes until they cover ``coverage`` of the total, renormalised.

    ``by_gpu`` weighs each shape by the GPU it asks for (pods x GPUs per pod) instead of by pods alone:
    the paper counts pods, so a rare 8-GPU pod weighs as little as a CPU-only one although it carries
    64 times the GPU demand of a 1/8-GPU pod. Ties are ordered by shape (cpu, per-device memory, count,
    models) descending, a fixed order so the set is deterministic.
    """

    def mass(pod: TypicalPod, n: int) -> float:
        return n * pod.gpu_units if by_gpu else float(n)

    total = sum(mass(p, n) for p, n in counts.items())
    if total <= 0:
        return TypicalSet((), np.zeros(0), epoch)

    def order(item: tuple[TypicalPod, int]) -> tuple:
        pod, n = item
        return (mass(pod, n), pod.cpu_milli, pod.gpu_units, pod.count, ",".join(sorted(pod.models or ())))

    ranked = sorted(counts.items(), key=order, reverse=True)
    chosen: list[tuple[TypicalPod, float]] = []
    covered = 0.0
    for pod, n in ranked:
        if covered >= coverage * total or mass(pod, n) <= 0:
            break
        chosen.append((pod, mass(pod, n)))
        covered += mass(pod, n)
    weights = np.array([m for _, m in chosen], dtype=np.float64) / covered
    return TypicalSet(tuple(p for p, _ in chosen), weights, epoch)


def model_constraint(demand: Demand) -> frozenset[str] | None:
    """The GPU models a pod may use, read from required node affinity / nodeSelector on the model label."""
    selector, terms, _ = demand.static_key  # type: ignore[misc]
    for key, value in selector:
        if key == GPU_MODEL_LABEL:
            return frozenset((value,))
    allowed: set[str] = set()
    for term in terms:
        for req in term.match_expressions:
            if req.key == GPU_MODEL_LABEL and req.operator is SelectorOperator.IN:
                allowed.update(req.values)
                break
        else:
            return None
    return frozenset(allowed) if allowed else None


def typical_of(demand: Demand) -> TypicalPod:
    """The shape of a pod as the fragmentation measure sees it (first GPU container)."""
    first = demand.containers[0] if demand.containers else None
    if first is None:
        return TypicalPod(cpu_milli=demand.cpu_milli, memory=None)
    return TypicalPod(
        cpu_milli=demand.cpu_milli,
        memory=first.request,
        count=first.count,
        exclusive=first.exclusive,
        models=model_constraint(demand),
        mode=first.mode,
    )


class TypicalSource:
    """Where a fragmentation scorer gets its distribution: a fixed prior or one learned online."""

    def current(self) -> TypicalSet:
        raise NotImplementedError

    def observe(self, demand: Demand) -> None:
        """Tell the source about a request the engine is scheduling."""


class PriorTypicalPods(TypicalSource):
    """A fixed distribution from shape counts known in advance, e.g. a workload trace before replaying it
    (the paper's setup)."""

    def __init__(
        self, counts: Counter[TypicalPod], *, by_gpu: bool = False, coverage: float = COVERAGE
    ) -> None:
        self._typical = select_typical(counts, coverage=coverage, by_gpu=by_gpu)

    def current(self) -> TypicalSet:
        return self._typical


class OnlineTypicalPods(TypicalSource):
    """Learns the distribution from observed requests; republishes after 1, 2, 4, 8, ... observations,
    then every ``max_interval`` observations, so cached scores are invalidated O(log n) times.

    ``half_life`` (observations) forgets: a request seen ``half_life`` requests ago weighs half as much
    as the latest one, so the distribution follows a workload that changes (a new team, a new model
    size) instead of averaging over all history. Implemented by giving each new request a weight that
    grows by ``2 ** (1 / half_life)`` (renormalised before it overflows), which is the same as decaying
    every count at each request. ``None`` never forgets (the paper's frequencies).
    """

    def __init__(
        self,
        *,
        by_gpu: bool = False,
        first: int = 1,
        max_interval: int = 4096,
        coverage: float = COVERAGE,
        half_life: float | None = None,
    ) -> None:
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be a positive number of requests or None, got {half_life}")
        self._counts: Counter[TypicalPod] = Counter()
        self._seen = 0
        self._next = first
        self._max_interval = max_interval
        self._coverage = coverage
        self._by_gpu = by_gpu
        self._growth = 1.0 if half_life is None else 2.0 ** (1.0 / half_life)
        self._weight = 1.0
        self._typical = TypicalSet((), np.zeros(0), 0)

    def observe(self, demand: Demand) -> None:
        self._counts[typical_of(demand)] += self._weight  # type: ignore[assignment]
        self._seen += 1
        if self._growth != 1.0:
            self._weight *= self._growth
            if self._weight > _RESCALE_AT:
                self._rescale()
        if self._seen >= self._next:
            self._typical = select_typical(
                self._counts, epoch=self._typical.epoch + 1, coverage=self._coverage, by_gpu=self._by_gpu
            )
            self._next = self._seen + min(self._seen, self._max_interval)

    def _rescale(self) -> None:
        """Divide every weight by the current one; shapes whose weight became negligible are dropped."""
        scale = self._weight
        self._counts = Counter(
            {pod: n / scale for pod, n in self._counts.items() if n / scale > _NEGLIGIBLE}  # type: ignore[misc]
        )
        self._weight = 1.0

    def current(self) -> TypicalSet:
        return self._typical


_RESCALE_AT = 1e12
_NEGLIGIBLE = 1e-9
