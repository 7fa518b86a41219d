"""MIG slices as a small exact book beside the array ledgers (docs/mig.md, "Placement").

Why apart from ``ClusterState``'s arrays: a slice is not an amount of a GPU but a fixed device (a MIG
GPU instance with its own UUID) that one container holds whole. The arrays' per-GPU sums would say
nothing useful about it, and MIG demand is small (a few slices per GPU, a few GPUs per node), so a dict of
slices keyed by MIG UUID, with a taken flag each, is both exact and cheap: ``take`` refuses a slice that
is taken, ``give`` one that is not, so applying and releasing an allocation stay exact inverses and no
slice is ever double-booked.

The order slices are chosen in, on one node: a named profile takes a free slice of that profile; a size
request (``min_mib``) takes the smallest free slice with at least that much memory, ties to fewer
compute slices (``gpufrac.mig.geometry``'s order of profiles); among equal slices the one on the GPU
with the most slices already taken (so that idle GPUs stay idle, free to be re-partitioned), then the
lowest GPU index and start.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .model import GpuDevice, GpuMode, MigSlice


@dataclass(frozen=True, slots=True)
class SliceCharge:
    """One MIG slice a container holds: its GPU column on the node, its MIG UUID and memory."""

    gpu: int
    uuid: str
    mib: int


@dataclass(frozen=True, slots=True)
class MigDemand:
    """One container's MIG request as the engine computes with it: a named ``profile`` or, with none, a
    slice of at least ``min_mib``; ``count`` slices (of one node)."""

    name: str
    profile: str | None
    min_mib: int | None
    count: int = 1

    def wants(self, s: MigSlice) -> bool:
        if self.profile is not None:
            return s.profile == self.profile
        return self.min_mib is not None and s.mib >= self.min_mib

    def describe(self) -> str:
        """What it asks for, as an unschedulable message names it."""
        if self.profile is not None:
            return self.profile
        return f"at least {self.min_mib} MiB"


def compute_slices(profile: str) -> int:
    """Compute slices of a profile by its name (``3g.40gb`` -> 3): the ``<g>g.`` prefix NVIDIA's names
    carry; 7 (a whole GPU's) when the name has none."""
    head = profile.split("g.", 1)[0]
    return int(head) if head.isdigit() else 7


@dataclass(slots=True)
class SliceSlot:
    """A slice as the book holds it: where it is (node row, GPU column) and whether it is taken."""

    node: int
    gpu: int
    slice: MigSlice
    taken: bool = False


class MigBook:
    """Every MIG slice of the cluster, by MIG UUID and per node row; see the module docstring.

    ``fenced`` GPUs (node row, GPU column) offer no slice: a layout change is pending on them."""

    def __init__(self) -> None:
        self.slots: dict[str, SliceSlot] = {}
        self.on_node: dict[int, list[str]] = {}
        self.fenced: set[tuple[int, int]] = set()

    # -- nodes ----------------------------------------------------------------------------------------

    def add_node(self, n: int, gpus: Sequence[GpuDevice]) -> None:
        uuids: list[str] = []
        for g, gpu in enumerate(gpus):
            if gpu.mode is not GpuMode.MIG:
                continue
            for s in sorted(gpu.mig, key=lambda s: s.start):
                if s.uuid in self.slots:
                    raise ValueError(f"MIG device {s.uuid} of GPU {gpu.uuid} is published twice")
                self.slots[s.uuid] = SliceSlot(n, g, s)
                uuids.append(s.uuid)
        if uuids:
            self.on_node[n] = uuids

    def remove_node(self, n: int) -> None:
        for uuid in self.on_node.pop(n, ()):
            del self.slots[uuid]
        self.fenced = {f for f in self.fenced if f[0] != n}

    # -- bookings -------------------------------------------------------------------------------------

    def take(self, uuid: str) -> None:
        slot = self._slot(uuid)
        if slot.taken:
            raise ValueError(f"MIG slice {slot.slice} ({uuid}) is booked already")
        slot.taken = True

    def give(self, uuid: str) -> None:
        slot = self._slot(uuid)
        if not slot.taken:
            raise ValueError(f"MIG slice {slot.slice} ({uuid}) is not booked")
        slot.taken = False

    def _slot(self, uuid: str) -> SliceSlot:
        slot = self.slots.get(uuid)
        if slot is None:
            raise ValueError(f"MIG device {uuid} is not a known slice")
        return slot

    # -- questions ------------------------------------------------------------------------------------

    def has_slices(self, n: int) -> bool:
        return n in self.on_node

    def node_slots(self, n: int) -> list[SliceSlot]:
        return [self.slots[u] for u in self.on_node.get(n, ())]

    def busy(self, n: int, g: int) -> bool:
        """Whether a slice of GPU column ``g`` of node row ``n`` is taken."""
        return any(s.taken and s.gpu == g for s in self.node_slots(n))

    def free_slots(self, n: int) -> list[SliceSlot]:
        return [s for s in self.node_slots(n) if not s.taken and (n, s.gpu) not in self.fenced]

    def choose(self, n: int, demands: Iterable[MigDemand]) -> list[list[SliceSlot]] | None:
        """Per demand (in the given order) the free slices of node row ``n`` it would take, or None when
        they do not all fit together. Named profiles choose first, then size requests largest first, so
        a size request never takes the one slice a named profile needed."""
        slots = self.node_slots(n)
        free = [s for s in slots if not s.taken and (n, s.gpu) not in self.fenced]
        busy: dict[int, int] = {}
        for s in slots:
            busy[s.gpu] = busy.get(s.gpu, 0) + int(s.taken)
        wanted = list(demands)
        order = sorted(
            range(len(wanted)),
            key=lambda i: (wanted[i].profile is None, -(wanted[i].min_mib or 0), i),
        )
        chosen: list[list[SliceSlot]] = [[] for _ in wanted]
        used: set[str] = set()
        for i in order:
            d = wanted[i]
            fits = [s for s in free if s.slice.uuid not in used and d.wants(s.slice)]
            if len(fits) < d.count:
                return None
            fits.sort(
                key=lambda s: (
                    s.slice.mib,
                    compute_slices(s.slice.profile),
                    -busy.get(s.gpu, 0),
                    s.gpu,
                    s.slice.start,
                )
            )
            chosen[i] = fits[: d.count]
            used.update(s.slice.uuid for s in chosen[i])
        return chosen
