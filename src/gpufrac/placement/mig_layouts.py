"""Which idle GPUs to re-partition, and how, for the pods that wait (docs/mig.md, "Dynamic layouts").

Pure: the scheduler hands in what waits and which GPUs are idle (nothing booked, no change pending), and
gets back the layout changes to ask the node agents for (``gpufrac.io/gpu-layout``). Nothing here books,
so a plan that the agent refuses or that new pods overtake costs nothing but the ask.

MIG demand first. Each waiting MIG pod brings its slices resolved per model (a named profile is itself on
every model that has it; a size request is ``gpufrac.mig.geometry.smallest_fitting`` per model) and the
nodes it may use. Idle GPUs of a MIG-capable model are tried in a fixed order: GPUs already in mode mig
first (no mode switch, no GPU reset), then whole-mode GPUs, then fractions GPUs (turning one to MIG takes
its room from fractions); then by node name and GPU index. On each, the pods not served yet that may use
its node are packed with ``gpufrac.mig.geometry.pack`` (largest profiles first, each at the start that
leaves the most placements possible: the fragmentation-aware part). A GPU in mode mig keeps its slices
when the wanted ones fit beside them (the smallest change); otherwise it is laid out anew with the wanted
slices first and its old ones added back where they still fit. A pod is served when all its slices fit
on that one GPU; a change is asked only for a GPU that serves at least one pod.

Fill (``fill``, on by default; scheduler setting ``mig.fill``): a GPU laid out for the pods that wait now
gets the rest of its room in free slices too (``gpufrac.mig.geometry.fill``), in the mix of profiles
asked by the pods waiting now and those seen lately (``recent``, kept by the caller in
:class:`RecentMigAsks`), then the smallest profile, until no profile fits. A GPU that holds a slice is
busy and no longer re-partitioned, so without fill the rest of it stays empty until every pod on it has
left; with fill the next isolation pods land on its free slices with no change at all.

Then fraction demand that no pool holds: idle GPUs in mode mig or whole (not chosen above) on a node a
waiting fraction pod may use go back to fractions, one GPU per pod unless a GPU already going back holds
it too (its memory counted down by what each pod asks).

Deterministic: the same inputs give the same changes in the same order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufrac.mig.geometry import MigLayoutError, Slice, check_layout, fill, pack
from gpufrac.mig.profiles import MigModel, mig_model

from .model import GpuMode


@dataclass(frozen=True, slots=True)
class MigWait:
    """A waiting pod's MIG slices: per model the profiles it needs (one entry per slice), and the nodes
    it may use (None: any)."""

    key: str
    profiles: Mapping[str, tuple[str, ...]]
    nodes: frozenset[str] | None = None

    def may_use(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes


@dataclass(frozen=True, slots=True)
class FractionWait:
    """A waiting fraction pod no GPU in mode fractions holds: ``mib(gpu_mib)`` is what one of its devices
    asks on a GPU of that size, ``count`` devices; the nodes it may use (None: any)."""

    key: str
    mib: Callable[[int], int]
    count: int = 1
    nodes: frozenset[str] | None = None

    def may_use(self, node: str) -> bool:
        return self.nodes is None or node in self.nodes


@dataclass(frozen=True, slots=True)
class IdleGpu:
    """A GPU with nothing booked and no change pending: where it is, its model, mode and slices."""

    node: str
    uuid: str
    index: int
    model: str
    memory_mib: int
    mode: GpuMode
    slices: tuple[Slice, ...] = ()


@dataclass(frozen=True, slots=True)
class LayoutChange:
    """Ask node ``node`` to put GPU ``uuid`` in ``mode`` (with ``slices`` for mig); ``serves`` the waiting
    pods it is planned for."""

    node: str
    uuid: str
    mode: GpuMode
    slices: tuple[Slice, ...]
    serves: tuple[str, ...]

    def describe(self) -> str:
        """The change as a waiting pod's message says it: ``3g.40gb@0, 1g.10gb@6`` or ``fractions``."""
        if self.mode is GpuMode.MIG:
            return ", ".join(str(s) for s in self.slices) or "MIG with no slices"
        return self.mode.value


_MODE_ORDER = {GpuMode.MIG: 0, GpuMode.WHOLE: 1, GpuMode.FRACTIONS: 2}


class RecentMigAsks:
    """The last ``size`` MIG pods handed to the planner, one entry per pod (the newest ask of a pod seen
    again): the recent mix ``plan_layouts`` fills GPUs with. The caller's memory, so the planner stays
    pure."""

    def __init__(self, size: int = 64) -> None:
        if size < 1:
            raise ValueError(f"size {size}: the number of recent MIG asks kept must be at least 1")
        self.size = size
        self._waits: OrderedDict[str, MigWait] = OrderedDict()

    def add(self, waits: Iterable[MigWait]) -> None:
        for w in waits:
            self._waits.pop(w.key, None)
            self._waits[w.key] = w
        while len(self._waits) > self.size:
            self._waits.popitem(last=False)

    def waits(self) -> tuple[MigWait, ...]:
        return tuple(self._waits.values())


def _asked(model: str, mig: Sequence[MigWait], recent: Sequence[MigWait]) -> Counter[str]:
    """How often each profile of ``model`` is asked by the waiting pods and the recent ones (a pod in
    both counted once)."""
    by_key = {w.key: w for w in recent} | {w.key: w for w in mig}
    return Counter(p for w in by_key.values() for p in w.profiles.get(model, ()))


def plan_layouts(
    mig: Sequence[MigWait],
    fractions: Sequence[FractionWait],
    idle: Sequence[IdleGpu],
    *,
    fill_rest: bool = True,
    recent: Sequence[MigWait] = (),
) -> list[LayoutChange]:
    """The layout changes to ask for; see the module docstring. ``fill_rest`` False lays out only the
    waiting pods' slices; ``recent``: MIG pods seen lately, for the fill's mix."""
    changes: list[LayoutChange] = []
    chosen: set[str] = set()
    waiting = list(mig)
    asked: dict[str, Counter[str]] = {}
    for g in sorted(idle, key=lambda g: (_MODE_ORDER[g.mode], g.node, g.index, g.uuid)):
        if not waiting:
            break
        model = mig_model(g.model)
        if model is None:
            continue
        mine = [w for w in waiting if w.may_use(g.node) and w.profiles.get(model.model)]
        if not mine:
            continue
        layout, served, kept = _lay_out(g, mine)
        if not served:
            continue
        if fill_rest:
            if model.model not in asked:
                asked[model.model] = _asked(model.model, mig, recent)
            layout = _filled(model, layout, kept, served, asked[model.model])
        if g.mode is GpuMode.MIG and sorted(layout) == sorted(g.slices):
            continue  # nothing to change (its slices serve them already: the engine places there)
        keys = {w.key for w in served}
        waiting = [w for w in waiting if w.key not in keys]
        chosen.add(g.uuid)
        changes.append(LayoutChange(g.node, g.uuid, GpuMode.MIG, layout, tuple(w.key for w in served)))
    changes.extend(_back_to_fractions(fractions, [g for g in idle if g.uuid not in chosen]))
    return changes


def _filled(
    model: MigModel,
    layout: tuple[Slice, ...],
    kept: tuple[Slice, ...],
    served: list[MigWait],
    asked: Mapping[str, int],
) -> tuple[Slice, ...]:
    """``layout`` with the rest of the GPU filled: the served pods' slices re-packed with the fill beside
    the slices ``kept`` in place, or, should that lose one of them, the fill beside ``layout`` as it is."""
    needed = [p for w in served for p in w.profiles[model.model]]
    filled = fill(model, kept, asked, needed)
    if Counter(needed) - Counter(s.profile for s in filled if s not in kept):
        return fill(model, layout, asked)
    return filled


def _lay_out(
    gpu: IdleGpu, waiting: list[MigWait]
) -> tuple[tuple[Slice, ...], list[MigWait], tuple[Slice, ...]]:
    """The layout for ``gpu``, the pods it serves whole, in their order, and the GPU's slices it keeps
    where they are (none when laid out anew)."""
    model = mig_model(gpu.model)
    assert model is not None
    wanted = [p for w in waiting for p in w.profiles[model.model]]
    options: list[tuple[tuple[Slice, ...], tuple[Slice, ...]]] = []  # (layout, slices kept in place)
    keep = tuple(gpu.slices) if gpu.mode is GpuMode.MIG else ()
    if keep:
        try:
            check_layout(model, keep)
            options.append((pack(model, wanted, keep)[0], keep))
        except MigLayoutError:
            keep = ()
    fresh, _ = pack(model, wanted)
    if keep:
        fresh, _ = pack(model, [s.profile for s in keep], fresh)
    options.append((fresh, ()))
    best: tuple[tuple[Slice, ...], list[MigWait], tuple[Slice, ...]] = ((), [], ())
    for layout, kept in options:
        served = _served(layout, keep, waiting, model.model)
        if len(served) > len(best[1]):
            best = (layout, served, kept)
    return best


def _served(
    layout: tuple[Slice, ...], keep: tuple[Slice, ...], waiting: list[MigWait], model: str
) -> list[MigWait]:
    """The pods, in order, whose slices the layout holds, each slice for one pod only. Slices the GPU
    had already serve nobody new: they were free and the pods still wait, so the engine found them not
    to serve (another node's pods, or too few of them); only the added ones count."""
    free: dict[str, int] = {}
    for s in layout:
        free[s.profile] = free.get(s.profile, 0) + 1
    for s in keep:
        if s in layout:
            free[s.profile] -= 1
    out = []
    for w in waiting:
        need: dict[str, int] = {}
        for p in w.profiles[model]:
            need[p] = need.get(p, 0) + 1
        if all(free.get(p, 0) >= n for p, n in need.items()):
            for p, n in need.items():
                free[p] -= n
            out.append(w)
    return out


def _back_to_fractions(fractions: Sequence[FractionWait], idle: Sequence[IdleGpu]) -> list[LayoutChange]:
    candidates = sorted(
        (g for g in idle if g.mode is not GpuMode.FRACTIONS), key=lambda g: (g.node, g.index, g.uuid)
    )
    room: dict[str, int] = {}
    serves: dict[str, list[str]] = {}
    for w in fractions:
        on = [g for g in candidates if w.may_use(g.node)]
        if on:
            _fit_fraction(w, on, room, serves)
    return [
        LayoutChange(g.node, g.uuid, GpuMode.FRACTIONS, (), tuple(serves[g.uuid]))
        for g in candidates
        if g.uuid in serves
    ]


def _fit_fraction(
    w: FractionWait, on: list[IdleGpu], room: dict[str, int], serves: dict[str, list[str]]
) -> bool:
    """Give ``w`` its devices on one node's GPUs going back (those already going back first)."""
    by_node: dict[str, list[IdleGpu]] = {}
    for g in on:
        by_node.setdefault(g.node, []).append(g)
    for node in sorted(by_node, key=lambda n: (-sum(g.uuid in serves for g in by_node[n]), n)):
        gpus = sorted(by_node[node], key=lambda g: (g.uuid not in serves, g.index))
        fit = [g for g in gpus if room.get(g.uuid, g.memory_mib) >= w.mib(g.memory_mib)][: w.count]
        if len(fit) < w.count:
            continue
        for g in fit:
            room[g.uuid] = room.get(g.uuid, g.memory_mib) - w.mib(g.memory_mib)
            serves.setdefault(g.uuid, []).append(w.key)
        return True
    return False
