"""The cluster as ledgers: per-node free host resources and per-GPU ledgers, as numpy arrays.

Why arrays: the engine answers "which nodes can take this pod and how good is each" for a whole cluster
at once. Holding the ledgers as a structure of arrays (one row per node slot, one column per GPU slot)
lets filters and scorers run as a handful of vector operations instead of a Python loop over nodes,
which is what makes thousands of placements per second possible in one Python process.

Per GPU the ledger keeps: free MiB (capacity minus the sum of guaranteed requests), the sum of limits,
the sum of sm-sharing compute portions (ppm), the compute mode (EMPTY until the first tenant, then the
mode of its tenants, or EXCLUSIVE for a whole-GPU pod), the number of pods and the tenants (namespaces).
``apply`` and ``release`` of an ``Allocation`` are exact inverses: integer arithmetic only, and the mode
and tenant return to EMPTY/none when the last pod leaves.

Every change to a node bumps its ``version``; the engine caches per-node filter and score results and
recomputes only nodes whose version moved. Changes to node specs (labels, taints, readiness) bump
``spec_epoch`` so cached static-filter masks are rebuilt.

GPU modes (docs/mig.md): a GPU in mode ``fractions`` starts EMPTY; one in mode ``whole`` starts
WHOLE_IDLE (a whole-GPU pod may take it, a fraction may not); one in mode ``mig`` is MIG for good, with no
fraction room (``free`` 0) and its slices in the MIG book (``gpufrac.placement.mig_book``), which
``apply``/``release`` keep with the arrays. ``base`` is the code a GPU returns to when its last pod
leaves. A GPU whose layout change is pending is FENCED: nothing is booked on it until the node publishes
the change (``fence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpufrac.contract.request import ComputeMode

from .mig_book import MigBook, SliceCharge
from .model import GpuDevice, GpuMode, NodeSpec

EMPTY = 0
TIME_SLICING = 1
SM_SHARING = 2
EXCLUSIVE = 3
ABSENT = 4
MIG = 5
WHOLE_IDLE = 6
FENCED = 7
MODE_CODES = 8
"""How many mode codes there are (tables indexed by a GPU's mode code have this many rows)."""

BASE_CODE = {GpuMode.FRACTIONS: EMPTY, GpuMode.MIG: MIG, GpuMode.WHOLE: WHOLE_IDLE}

MODE_CODE = {ComputeMode.TIME_SLICING: TIME_SLICING, ComputeMode.SM_SHARING: SM_SHARING}
NO_TENANT = -1
MANY_TENANTS = -2


@dataclass(frozen=True, slots=True)
class DeviceCharge:
    """What one container puts on one GPU."""

    gpu: int
    request_mib: int
    limit_mib: int
    ppm: int
    mode: int  # TIME_SLICING, SM_SHARING or EXCLUSIVE


@dataclass(frozen=True, slots=True)
class Allocation:
    """Everything a placed pod holds on its node; applying then releasing it restores every ledger."""

    node: int
    cpu_milli: int
    memory_bytes: int
    tenant: int
    charges: tuple[DeviceCharge, ...]
    #: Pod slots it takes: 1 for a pod, 0 for GPU shares no pod holds itself (a DRA claim's allocation,
    #: ``Engine.hold``).
    pods: int = 1
    #: MIG slices it holds (``gpufrac.placement.mig_book``), beside the fraction charges.
    slices: tuple[SliceCharge, ...] = ()

    @property
    def gpu_mib(self) -> int:
        """Guaranteed GPU memory it books: fraction requests and whole slices (a queue's gpuMemory)."""
        return sum(c.request_mib for c in self.charges) + sum(s.mib for s in self.slices)


@dataclass(frozen=True, slots=True)
class GpuLedger:
    """A read-only view of one GPU's ledger (for tests, metrics and explanations)."""

    uuid: str
    index: int
    capacity_mib: int
    free_mib: int
    limit_sum_mib: int
    compute_ppm: int
    mode: int
    pods: int
    tenants: tuple[str, ...]
    #: MIG UUIDs of its slices that are taken (a GPU in mode mig).
    slices: tuple[str, ...] = ()
    #: The memory of those slices (what a MIG GPU has booked: its ``free_mib`` is no fraction room, 0).
    slice_mib: int = 0


_ARRAYS = [
    "present",
    "version",
    "spec_version",
    "cpu_free",
    "cpu_cap",
    "mem_free",
    "mem_cap",
    "pods_free",
    "model",
    "gpu_count",
    "free_total",
    "cap_total",
    "empty_count",
    "cap",
    "free",
    "limit_sum",
    "ppm",
    "mode",
    "base",
    "npods",
    "tenant",
]


class ClusterState:
    """Node slots and GPU slots as arrays; see the module docstring."""

    hypothetical = False
    """True for ``PodTable.hypothetical``'s what-if copies: they keep the nodes' versions but not their
    free amounts, so caches keyed by version must not serve them."""

    def __init__(self, *, node_slots: int = 64, gpu_slots: int = 8) -> None:
        self.nodes: list[NodeSpec | None] = []
        self.index: dict[str, int] = {}
        self.gpu_at: dict[str, tuple[int, int]] = {}
        self.gpu_uuid: list[list[str]] = []
        self.spec_epoch = 0
        self._free_slots: list[int] = []
        self._namespaces: dict[str, int] = {}
        self._namespace_names: list[str] = []
        self._models: dict[str, int] = {"": 0}
        self._model_names: list[str] = [""]
        self.tenants: dict[tuple[int, int], dict[int, int]] = {}
        self.mig = MigBook()
        #: Node rows of the MIG book per row of these arrays: None here (the same rows); a hypothetical
        #: copy's rows are a selection of the real ones.
        self.mig_rows: np.ndarray | None = None
        #: GPUs not in mode fractions (MIG, whole, fenced): while 0 the filters skip the mode reasons.
        self.partitioned = 0
        self._alloc_arrays(node_slots, gpu_slots)

    # -- storage --------------------------------------------------------------------------------------

    def _alloc_arrays(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.present = np.zeros(rows, dtype=bool)
        self.version = np.zeros(rows, dtype=np.int64)
        self.spec_version = np.zeros(rows, dtype=np.int64)
        self.cpu_free = np.zeros(rows, dtype=np.int64)
        self.cpu_cap = np.zeros(rows, dtype=np.int64)
        self.mem_free = np.zeros(rows, dtype=np.int64)
        self.mem_cap = np.zeros(rows, dtype=np.int64)
        self.pods_free = np.zeros(rows, dtype=np.int64)
        self.model = np.zeros(rows, dtype=np.int64)
        self.gpu_count = np.zeros(rows, dtype=np.int64)
        self.free_total = np.zeros(rows, dtype=np.int64)
        self.cap_total = np.zeros(rows, dtype=np.int64)
        self.empty_count = np.zeros(rows, dtype=np.int64)
        self.cap = np.zeros((rows, cols), dtype=np.int64)
        self.free = np.full((rows, cols), -1, dtype=np.int64)
        self.limit_sum = np.zeros((rows, cols), dtype=np.int64)
        self.ppm = np.zeros((rows, cols), dtype=np.int64)
        self.mode = np.full((rows, cols), ABSENT, dtype=np.int8)
        self.base = np.full((rows, cols), ABSENT, dtype=np.int8)
        self.npods = np.zeros((rows, cols), dtype=np.int64)
        self.tenant = np.full((rows, cols), NO_TENANT, dtype=np.int64)

    def _grow(self, rows: int, cols: int) -> None:
        old = {name: getattr(self, name) for name in _ARRAYS}
        r0, c0 = self.rows, self.cols
        self._alloc_arrays(rows, cols)
        for name, arr in old.items():
            if arr.ndim == 1:
                getattr(self, name)[:r0] = arr
            else:
                getattr(self, name)[:r0, :c0] = arr

    # -- interning ------------------------------------------------------------------------------------

    def namespace_id(self, namespace: str) -> int:
        found = self._namespaces.get(namespace)
        if found is None:
            found = self._namespaces[namespace] = len(self._namespace_names)
            self._namespace_names.append(namespace)
        return found

    def namespace_name(self, ns_id: int) -> str:
        return self._namespace_names[ns_id]

    def model_id(self, model: str) -> int:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = len(self._model_names)
            self._model_names.append(model)
        return found

    @property
    def model_names(self) -> list[str]:
        return self._model_names

    # -- nodes ----------------------------------------------------------------------------------------

    @property
    def node_count(self) -> int:
        return len(self.index)

    def live(self) -> np.ndarray:
        """Indices of present node slots."""
        return np.flatnonzero(self.present)

    def add_node(self, spec: NodeSpec) -> int:
        if spec.name in self.index:
            raise ValueError(f"node {spec.name} already present")
        for gpu in spec.gpus:
            if gpu.uuid in self.gpu_at:
                raise ValueError(f"GPU {gpu.uuid} of node {spec.name} already belongs to another node")
        if self._free_slots:
            n = self._free_slots.pop()
        else:
            n = len(self.nodes)
            self.nodes.append(None)
            self.gpu_uuid.append([])
        need_cols = max(self.cols, len(spec.gpus))
        if n >= self.rows or need_cols > self.cols:
            self._grow(max(self.rows * 2 if n >= self.rows else self.rows, n + 1), need_cols)
        self.nodes[n] = spec
        self.index[spec.name] = n
        self.present[n] = True
        self.version[n] += 1
        self.spec_version[n] += 1
        self.cpu_free[n] = self.cpu_cap[n] = spec.cpu_milli
        self.mem_free[n] = self.mem_cap[n] = spec.memory_bytes
        self.pods_free[n] = spec.max_pods
        self.model[n] = self.model_id(spec.gpu_model)
        self.gpu_count[n] = len(spec.gpus)
        self.cap[n, :] = 0
        self.free[n, :] = -1
        self.limit_sum[n, :] = 0
        self.ppm[n, :] = 0
        self.mode[n, :] = ABSENT
        self.base[n, :] = ABSENT
        self.npods[n, :] = 0
        self.tenant[n, :] = NO_TENANT
        uuids = []
        for g, gpu in enumerate(spec.gpus):
            self.cap[n, g] = gpu.memory_mib
            self._set_gpu_mode(n, g, gpu)
            self.gpu_at[gpu.uuid] = (n, g)
            uuids.append(gpu.uuid)
        self.gpu_uuid[n] = uuids
        self.cap_total[n] = sum(g.memory_mib for g in spec.gpus)
        self.free_total[n] = int(self.free[n, : len(spec.gpus)].sum())
        self.empty_count[n] = int((self.mode[n, : len(spec.gpus)] != MIG).sum())
        self.mig.add_node(n, spec.gpus)
        self.spec_epoch += 1
        return n

    def _set_gpu_mode(self, n: int, g: int, gpu: GpuDevice) -> None:
        """An idle GPU's codes and fraction room by its published mode."""
        code = BASE_CODE[gpu.mode]
        self.mode[n, g] = self.base[n, g] = code
        self.free[n, g] = 0 if code == MIG else gpu.memory_mib
        if code != EMPTY:
            self.partitioned += 1

    def fence(self, uuid: str) -> None:
        """Book nothing more on idle GPU ``uuid``: its layout change is pending (docs/mig.md). Undone by
        ``unfence`` or by the node's next spec, which carries the GPU as the agent left it."""
        n, g = self.gpu_at[uuid]
        if self.npods[n, g] or self.mig.busy(n, g):
            raise ValueError(f"GPU {uuid} holds bookings: its layout cannot change")
        if self.base[n, g] == FENCED:
            return
        if self.base[n, g] == EMPTY:
            self.partitioned += 1
        self.free_total[n] -= max(0, int(self.free[n, g]))
        self.free[n, g] = 0
        self.mode[n, g] = self.base[n, g] = FENCED
        self.mig.fenced.add((n, g))
        self.version[n] += 1

    def unfence(self, uuid: str) -> None:
        n, g = self.gpu_at[uuid]
        if self.base[n, g] != FENCED:
            return
        spec = self.nodes[n]
        assert spec is not None
        self.partitioned -= 1
        self._set_gpu_mode(n, g, spec.gpus[g])
        self.free_total[n] += int(self.free[n, g])
        self.mig.fenced.discard((n, g))
        self.version[n] += 1

    def fenced(self, uuid: str) -> bool:
        at = self.gpu_at.get(uuid)
        return at is not None and int(self.base[at]) == FENCED

    def remove_node(self, name: str) -> int:
        """Drop a node (its allocations must have been released first)."""
        n = self.index.pop(name)
        for uuid in self.gpu_uuid[n]:
            del self.gpu_at[uuid]
        for g in range(len(self.gpu_uuid[n])):
            self.tenants.pop((n, g), None)
            if self.base[n, g] != EMPTY:
                self.partitioned -= 1
        self.mig.remove_node(n)
        self.gpu_uuid[n] = []
        self.nodes[n] = None
        self.present[n] = False
        self.version[n] += 1
        self.spec_version[n] += 1
        self.cap[n, :] = 0
        self.free[n, :] = -1
        self.mode[n, :] = ABSENT
        self.base[n, :] = ABSENT
        self.gpu_count[n] = self.free_total[n] = self.cap_total[n] = self.empty_count[n] = 0
        self.cpu_free[n] = self.mem_free[n] = self.pods_free[n] = 0
        self._free_slots.append(n)
        self.spec_epoch += 1
        return n

    def replace_spec(self, spec: NodeSpec) -> None:
        """New labels, taints, readiness or allocatable host resources for a node whose GPUs are unchanged."""
        n = self.index[spec.name]
        old = self.nodes[n]
        assert old is not None
        self.cpu_free[n] += spec.cpu_milli - old.cpu_milli
        self.cpu_cap[n] = spec.cpu_milli
        self.mem_free[n] += spec.memory_bytes - old.memory_bytes
        self.mem_cap[n] = spec.memory_bytes
        self.pods_free[n] += spec.max_pods - old.max_pods
        self.model[n] = self.model_id(spec.gpu_model)
        self.nodes[n] = spec
        self.version[n] += 1
        self.spec_version[n] += 1
        self.spec_epoch += 1

    # -- ledgers --------------------------------------------------------------------------------------

    def apply(self, a: Allocation) -> None:
        """Book ``a``; a slice taken already raises ValueError and leaves every book as it was."""
        for i, sl in enumerate(a.slices):
            try:
                self.mig.take(sl.uuid)
            except ValueError:
                for taken in a.slices[:i]:
                    self.mig.give(taken.uuid)
                raise
        n = a.node
        self.cpu_free[n] -= a.cpu_milli
        self.mem_free[n] -= a.memory_bytes
        self.pods_free[n] -= a.pods
        for c in a.charges:
            g = c.gpu
            if self.npods[n, g] == 0:
                self.mode[n, g] = c.mode
                self.empty_count[n] -= 1
            self.npods[n, g] += 1
            self.free[n, g] -= c.request_mib
            self.free_total[n] -= c.request_mib
            self.limit_sum[n, g] += c.limit_mib
            self.ppm[n, g] += c.ppm
            self._add_tenant(n, g, a.tenant)
        self.version[n] += 1

    def release(self, a: Allocation) -> None:
        for sl in a.slices:
            self.mig.give(sl.uuid)
        n = a.node
        self.cpu_free[n] += a.cpu_milli
        self.mem_free[n] += a.memory_bytes
        self.pods_free[n] += a.pods
        for c in reversed(a.charges):
            g = c.gpu
            self.npods[n, g] -= 1
            if self.npods[n, g] == 0:
                self.mode[n, g] = self.base[n, g]
                self.empty_count[n] += 1
            self.free[n, g] += c.request_mib
            self.free_total[n] += c.request_mib
            self.limit_sum[n, g] -= c.limit_mib
            self.ppm[n, g] -= c.ppm
            self._drop_tenant(n, g, a.tenant)
        self.version[n] += 1

    def _add_tenant(self, n: int, g: int, tenant: int) -> None:
        counts = self.tenants.setdefault((n, g), {})
        counts[tenant] = counts.get(tenant, 0) + 1
        self.tenant[n, g] = tenant if len(counts) == 1 else MANY_TENANTS

    def _drop_tenant(self, n: int, g: int, tenant: int) -> None:
        counts = self.tenants[(n, g)]
        left = counts[tenant] - 1
        if left:
            counts[tenant] = left
        else:
            del counts[tenant]
        if not counts:
            del self.tenants[(n, g)]
            self.tenant[n, g] = NO_TENANT
        elif len(counts) == 1:
            self.tenant[n, g] = next(iter(counts))
        else:
            self.tenant[n, g] = MANY_TENANTS

    def free_milli(self, nodes: np.ndarray) -> np.ndarray:
        """Free thousandths of a GPU per GPU slot of ``nodes`` (rounded down); 0 on absent slots.

        The unit scorers compare GPU room in (the paper's milli-GPU), whatever the GPU's size.
        """
        return np.maximum(self.free[nodes], 0) * 1000 // np.maximum(self.cap[nodes], 1)

    def ledger(self, node: str) -> list[GpuLedger]:
        n = self.index[node]
        out = []
        for g, uuid in enumerate(self.gpu_uuid[n]):
            tenants = tuple(sorted(self.namespace_name(t) for t in self.tenants.get((n, g), {})))
            taken = [s for s in self.mig.node_slots(n) if s.gpu == g and s.taken]
            out.append(
                GpuLedger(
                    uuid=uuid,
                    index=g,
                    capacity_mib=int(self.cap[n, g]),
                    free_mib=int(self.free[n, g]),
                    limit_sum_mib=int(self.limit_sum[n, g]),
                    compute_ppm=int(self.ppm[n, g]),
                    mode=int(self.mode[n, g]),
                    pods=int(self.npods[n, g]),
                    tenants=tenants,
                    slices=tuple(s.slice.uuid for s in taken),
                    slice_mib=sum(s.slice.mib for s in taken),
                )
            )
        return out


class PodTable:
    """Every placed pod's holdings as arrays, one row (slot) per pod: what preemption searches.

    Why a second view of the same allocations: victim selection asks "what would this node look like
    without these pods" for thousands of (node, victims) hypotheses at once. Rebuilding that from the
    engine's per-pod records would be a Python loop over every placed pod per decision; keeping the
    holdings as arrays (kept on ``add``/``remove`` by the engine, O(1) each) turns a hypothesis into a
    few array sums. Per slot: node, priority, queue id, namespace id, whether consolidation may move it,
    host resources, total guaranteed MiB, how many GPUs it holds, and per GPU slot the request, limit,
    compute ppm and number of charges it puts there.
    """

    NOTHING = 0
    """The slot that pads a set of victims: it holds nothing."""

    def __init__(self, *, slots: int = 1024, gpu_slots: int = 8) -> None:
        self.slot_of: dict[str, int] = {}
        # Slot 0 is never a pod: it holds nothing, so a set of victims padded with 0 sums as without.
        self.uid: list[str | None] = [None]
        self._free: list[int] = []
        self._queues: dict[str, int] = {}
        self.queue_names: list[str] = []
        self._alloc(slots, gpu_slots)

    def _alloc(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.live = np.zeros(rows, dtype=bool)
        self.node = np.full(rows, -1, dtype=np.int64)
        self.priority = np.zeros(rows, dtype=np.int64)
        self.queue = np.zeros(rows, dtype=np.int64)
        self.tenant = np.zeros(rows, dtype=np.int64)
        self.movable = np.zeros(rows, dtype=bool)
        self.cpu = np.zeros(rows, dtype=np.int64)
        self.mem = np.zeros(rows, dtype=np.int64)
        self.mib = np.zeros(rows, dtype=np.int64)
        self.gpus = np.zeros(rows, dtype=np.int64)
        # int32 per GPU slot: MiB and ppm of one pod fit, and it halves the table (100,000 pods: 13 MB).
        self.req = np.zeros((rows, cols), dtype=np.int32)
        self.lim = np.zeros((rows, cols), dtype=np.int32)
        self.ppm = np.zeros((rows, cols), dtype=np.int32)
        self.on = np.zeros((rows, cols), dtype=np.int32)

    def _grow(self, rows: int, cols: int) -> None:
        names = (
            "live",
            "node",
            "priority",
            "queue",
            "tenant",
            "movable",
            "cpu",
            "mem",
            "mib",
            "gpus",
            "req",
            "lim",
            "ppm",
            "on",
        )
        old = {name: getattr(self, name) for name in names}
        r0, c0 = self.rows, self.cols
        self._alloc(rows, cols)
        for name, arr in old.items():
            if arr.ndim == 1:
                getattr(self, name)[:r0] = arr
            else:
                getattr(self, name)[:r0, :c0] = arr

    def queue_id(self, name: str) -> int:
        found = self._queues.get(name)
        if found is None:
            found = self._queues[name] = len(self.queue_names)
            self.queue_names.append(name)
        return found

    def known_queue(self, name: str) -> int | None:
        return self._queues.get(name)

    def add(
        self, uid: str, allocation: Allocation, *, priority: int, queue: str, movable: bool = False
    ) -> None:
        if self._free:
            s = self._free.pop()
        else:
            s = len(self.uid)
            self.uid.append(None)
        cols = max([self.cols] + [c.gpu + 1 for c in allocation.charges])
        if s >= self.rows or cols > self.cols:
            self._grow(max(self.rows * 2 if s >= self.rows else self.rows, s + 1), cols)
        self.slot_of[uid] = s
        self.uid[s] = uid
        self.live[s] = True
        self.node[s] = allocation.node
        self.priority[s] = priority
        self.queue[s] = self.queue_id(queue)
        self.tenant[s] = allocation.tenant
        self.movable[s] = movable
        self.cpu[s] = allocation.cpu_milli
        self.mem[s] = allocation.memory_bytes
        self.mib[s] = allocation.gpu_mib
        self.gpus[s] = len({c.gpu for c in allocation.charges})
        for c in allocation.charges:
            self.req[s, c.gpu] += c.request_mib
            self.lim[s, c.gpu] += c.limit_mib
            self.ppm[s, c.gpu] += c.ppm
            self.on[s, c.gpu] += 1

    def remove(self, uid: str) -> None:
        s = self.slot_of.pop(uid)
        self.uid[s] = None
        self.live[s] = False
        self.movable[s] = False
        self.node[s] = -1
        self.cpu[s] = self.mem[s] = self.mib[s] = self.gpus[s] = 0
        self.req[s, :] = self.lim[s, :] = self.ppm[s, :] = self.on[s, :] = 0
        self._free.append(s)

    def tenant_charges(self, state: ClusterState, tenant: int) -> np.ndarray:
        """(node slots, GPU slots) of ``state``: charges on each GPU from pods of namespace ``tenant``."""
        mine = np.flatnonzero(self.live & (self.tenant == tenant))
        out = np.zeros((state.rows, state.cols), dtype=np.int64)
        for g in range(min(self.cols, state.cols)):
            out[:, g] = np.bincount(self.node[mine], weights=self.on[mine, g], minlength=state.rows)
        return out

    def of_sets(self, victims: np.ndarray, *, tenant: int | None) -> Released:
        """What each row of ``victims`` (slots, padded with ``NOTHING``) gives back: summed gathers, for
        many small sets."""
        v = victims

        def total(arr: np.ndarray) -> np.ndarray:
            return arr[v].sum(axis=1)

        on = self.on[v]
        theirs = None
        if tenant is not None:
            theirs = (on * (self.tenant[v] == tenant)[..., None]).sum(axis=1)
        return Released(
            cpu=total(self.cpu),
            mem=total(self.mem),
            pods=(v != self.NOTHING).sum(axis=1),
            req=total(self.req),
            lim=total(self.lim),
            ppm=total(self.ppm),
            on=on.sum(axis=1),
            on_tenant=theirs,
        )

    def of_groups(self, slots: np.ndarray, starts: np.ndarray, *, tenant: int | None) -> Released:
        """What each group gives back when all its slots leave; ``slots`` is sorted by group and group
        ``i`` starts at ``starts[i]``. One pass per array, for few large sets."""

        def total(arr: np.ndarray) -> np.ndarray:
            return np.add.reduceat(arr[slots], starts, axis=0)

        on = self.on[slots]
        return Released(
            cpu=total(self.cpu),
            mem=total(self.mem),
            pods=np.diff(np.append(starts, slots.size)),
            req=total(self.req),
            lim=total(self.lim),
            ppm=total(self.ppm),
            on=np.add.reduceat(on, starts, axis=0),
            on_tenant=None
            if tenant is None
            else np.add.reduceat(on * (self.tenant[slots] == tenant)[:, None], starts, axis=0),
        )

    def hypothetical(
        self,
        state: ClusterState,
        nodes: np.ndarray,
        released: Released,
        *,
        tenant: int | None,
        tenant_charges: np.ndarray | None = None,
    ) -> ClusterState:
        """Ledgers of ``nodes[i]`` as they would be once the pods of row ``i`` of ``released`` left.

        Row ``i`` of the result is one hypothesis; the filters run on it unchanged, so "would the pod fit
        after these victims leave" is answered by the same code that answers "does it fit". What cannot
        be summed is derived: a GPU whose last pod leaves returns to EMPTY (as ``ClusterState.release``
        does), and the tenant is given relative to ``tenant`` (the pending pod's namespace, with
        ``tenant_charges`` from ``tenant_charges``): that namespace when every remaining pod on the GPU is
        of it, else MANY_TENANTS; that is all the sm-sharing tenancy filter compares. ``tenant=None``
        keeps the tenant as it is (the pod has no sm-sharing container, so no filter reads it).
        """
        cols = state.cols
        r = released.widened(cols)
        out = ClusterState.__new__(ClusterState)
        out.hypothetical = True
        out.nodes = state.nodes
        out.index = state.index
        out._namespaces = state._namespaces
        out._namespace_names = state._namespace_names
        out._models = state._models
        out._model_names = state._model_names
        out.tenants = {}
        out.mig = state.mig
        out.mig_rows = nodes if state.mig_rows is None else state.mig_rows[nodes]
        out.partitioned = state.partitioned
        out.rows, out.cols = nodes.size, cols
        out.present = state.present[nodes]
        out.version = state.version[nodes]
        out.spec_version = state.spec_version[nodes]
        out.model = state.model[nodes]
        out.gpu_count = state.gpu_count[nodes]
        out.cap = state.cap[nodes]
        out.cpu_cap = state.cpu_cap[nodes]
        out.mem_cap = state.mem_cap[nodes]
        out.cap_total = state.cap_total[nodes]
        out.cpu_free = state.cpu_free[nodes] + r.cpu
        out.mem_free = state.mem_free[nodes] + r.mem
        out.pods_free = state.pods_free[nodes] + r.pods
        out.free = state.free[nodes] + r.req
        out.free_total = state.free_total[nodes] + r.req.sum(axis=1)
        out.limit_sum = state.limit_sum[nodes] - r.lim
        out.ppm = state.ppm[nodes] - r.ppm
        out.npods = state.npods[nodes] - r.on
        mode = state.mode[nodes]
        out.base = state.base[nodes]
        out.mode = np.where(out.npods == 0, out.base, mode).astype(np.int8)
        out.empty_count = (out.mode == EMPTY).sum(axis=1)
        if tenant is None:
            out.tenant = state.tenant[nodes]
        else:
            assert tenant_charges is not None and r.on_tenant is not None
            others = out.npods - (tenant_charges[nodes] - r.on_tenant)
            out.tenant = np.where(out.npods == 0, NO_TENANT, np.where(others == 0, tenant, MANY_TENANTS))
        return out


@dataclass(frozen=True, slots=True)
class Released:
    """What leaving pods give back, one row per hypothesis (host resources, and per GPU slot)."""

    cpu: np.ndarray
    mem: np.ndarray
    pods: np.ndarray
    req: np.ndarray
    lim: np.ndarray
    ppm: np.ndarray
    on: np.ndarray
    on_tenant: np.ndarray | None

    def minus(self, other: Released, rows: np.ndarray | None = None) -> Released:
        """This less ``other``; with ``rows`` (a mask) only on those rows."""

        def sub(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
            if a is None or b is None:
                return a
            if rows is None:
                return a - b
            mask = rows if a.ndim == 1 else rows[:, None]
            return np.where(mask, a - b, a)

        return Released(*(sub(getattr(self, f), getattr(other, f)) for f in _RELEASED))  # type: ignore[arg-type]

    def widened(self, cols: int) -> Released:
        """The same with at least ``cols`` GPU columns (the table may know fewer than the cluster)."""
        have = self.req.shape[1]
        if have >= cols:
            return self

        def pad(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.pad(a, ((0, 0), (0, cols - have)))

        return Released(
            self.cpu,
            self.mem,
            self.pods,
            pad(self.req),
            pad(self.lim),
            pad(self.ppm),
            pad(self.on),
            pad(self.on_tenant),
        )  # type: ignore[arg-type]


_RELEASED = ("cpu", "mem", "pods", "req", "lim", "ppm", "on", "on_tenant")
