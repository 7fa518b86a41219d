"""The placement engine: the one object the scheduler service and the simulator drive.

State comes in as nodes (``add_node`` / ``update_node`` / ``remove_node``) and as pods that already hold
GPUs (``assume``, used at start to rebuild the ledgers from bound pods, so a restart never double-books a
GPU), and as GPU shares no pod holds itself (``hold``: a DRA claim's allocation, booked once however
many pods use it). ``schedule(pods)`` places a batch in queue order and returns one Decision per pod: a
Placement, which the engine has already assumed (the service binds it, and calls ``forget`` if binding
fails), or Unschedulable with the per-reason node counts. ``place(pod)`` is the one-pod form.

How a pod is placed: pods of the same kind (see demand) share a cache of per-node results - reason code,
score packed with the seeded tie-break rank, and the GPU a single-device pod would use. Only nodes whose
version moved since the cache was filled are recomputed (vectorised), then the best node is one argmax.
A placement changes one node, so in steady state each pod costs a few small array operations whatever
the cluster size. Static predicates (readiness, taints, selectors, affinity, mode capability) are cached
separately per constraint signature and node spec version.

Rules that relate a pod to other pods (inter-pod affinity, topology spread) or to node-local resources
besides CPU, memory and GPUs (host ports, extended resources, ephemeral storage, room held for nominated
pods) depend on more than one node, so they are not cached per kind: ``PodBook`` (``topology``)
evaluates them per pod as an overlay on the cached results, and ranks nodes by a pod's preferences
before its policy's score does. A pod with none of them stays on the cached path. Nodes nothing is
placed on but that are topology domains all the same (``add_topology_node``; the scheduler's unmanaged
nodes) and the pods bound to them (``add_topology_pod``) are known to that book alone.

Transactions: ``statement()`` returns a Statement, the one "what if" of the placement core (preemption's
simulation, consolidation's relocation, gang preemption's plan): placements, evictions and assumed pods
made through it are recorded with their inverses and undone newest first by ``rollback`` to a
``checkpoint`` or by ``discard`` (or on an exception), which restores every book exactly, because
applying and releasing an allocation are exact inverses. ``schedule(..., gang=True)`` uses one to
place a batch all-or-nothing (or, with ``min_member``, at least that many of it or nothing: a
PodGroup); a multi-device or multi-container pod is always all-or-nothing within itself.

Determinism: ties between equal scores go to the node with the smallest seeded hash of its name, a fixed
random order per seed (as the paper's simulator does with random name prefixes); nothing else is random.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from gpufrac.contract.request import ComputeMode

from .decision import (
    ContainerPlacement,
    Decision,
    DeviceAssignment,
    Placement,
    Reason,
    Status,
    Unschedulable,
    mig_slice_message,
)
from .demand import PPM, ContainerDemand, Demand, can_fall_back, demand_of, portion_ppm
from .fair_share import QueueBook, scheduling_order
from .filters import STATIC_FILTERS, Fit, GpuRules, container_fit, resource_fit, static_reason
from .mig_book import SliceCharge
from .model import GpuMode, NodeSpec, PendingPod, Queue, QueueResource
from .policies import Policy, Prior, make_policy
from .queue_shares import Amount, QueueAmount, QueueShares, request_amount
from .queue_tally import QueueTally
from .state import EXCLUSIVE, MODE_CODE, Allocation, ClusterState, DeviceCharge, GpuLedger, PodTable
from .topology import Nomination, PodBook

_RANK_BITS = 40
_ABSENT = 255
_MAX_KINDS = 512
_MAX_OBSERVED = 200_000


def tie_rank(seed: int, name: str) -> int:
    """The node's place in the fixed random order of ``seed``: larger wins ties."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=5).digest()
    return (1 << _RANK_BITS) - 1 - int.from_bytes(digest, "big")


class _KindCache:
    """Per-node results for one kind of pod (see module docstring)."""

    __slots__ = ("demand", "epoch", "gpu", "key", "policy", "reason", "spec_key", "version")

    def __init__(self, demand: Demand, policy: Policy, rows: int) -> None:
        self.demand = demand
        self.policy = policy
        self.epoch = policy.epoch
        self.key = np.full(rows, -1, dtype=np.int64)
        self.reason = np.full(rows, _ABSENT, dtype=np.uint8)
        self.gpu = np.full(rows, -1, dtype=np.int64)
        self.version = np.full(rows, -1, dtype=np.int64)
        self.spec_key = (demand.static_key, demand.modes)

    def resize(self, rows: int) -> None:
        old = self.key.size
        if rows <= old:
            return
        for name, fill in (("key", -1), ("reason", _ABSENT), ("gpu", -1), ("version", -1)):
            arr = getattr(self, name)
            grown = np.full(rows, fill, dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)


class _StaticCache:
    __slots__ = ("reason", "spec_version")

    def __init__(self, rows: int) -> None:
        self.reason = np.full(rows, _ABSENT, dtype=np.uint8)
        self.spec_version = np.full(rows, -1, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class _Bound:
    pod: PendingPod
    allocation: Allocation
    placement: Placement
    gpu_mib: int
    whole_gpus: int


class Engine:
    """See the module docstring. All parameters are keyword-only.

    ``policy`` is the default policy name (``gpufrac.placement.policies``); a pod's ``policy`` field
    overrides it. ``typical`` is a prior for FGD-based policies: shape counts of the expected workload
    (without one they learn the distribution online from the pods they schedule). ``rules`` are the
    GPU-fit knobs. ``seed`` fixes the tie-break order.
    """

    def __init__(
        self,
        *,
        policy: str = "fgd",
        seed: int = 0,
        rules: GpuRules | None = None,
        typical: Prior | None = None,
        queues: Iterable[Queue] = (),
    ) -> None:
        self.state = ClusterState()
        self.seed = seed
        self.rules = rules or GpuRules()
        self.default_policy = policy
        self._typical = typical
        self._policies: dict[str, Policy] = {}
        self.policy(policy)  # fail fast on an unknown name
        self.queues = QueueBook()
        for q in queues:
            self.queues.set(q)
        self._rank = np.zeros(self.state.rows, dtype=np.int64)
        self._kinds: OrderedDict[tuple, _KindCache] = OrderedDict()
        self._statics: dict[tuple, _StaticCache] = {}
        self._demands: dict[tuple, Demand] = {}
        self._bound: dict[str, _Bound] = {}
        self.pods = PodTable(gpu_slots=self.state.cols)
        self._on_node: dict[int, set[str]] = {}
        #: Shares no pod holds (``hold``): key -> (allocation, placement, namespace), and per node.
        self._holds: dict[str, tuple[Allocation, Placement, str]] = {}
        self._held_on_node: dict[int, set[str]] = {}
        self._observed: set[str] = set()
        self.book = PodBook(self.state)
        self._nominees: dict[str, PendingPod] = {}
        #: Time-based fair share (``set_usage_history``): historical usage per resource and queue, and k.
        self._usage: Mapping[QueueResource, Mapping[str, float]] = {}
        self._usage_k = 0.0
        #: GPUs whose layout change is pending (``fence``): nothing is booked on them.
        self._fenced: set[str] = set()

    # -- policies -------------------------------------------------------------------------------------

    def policy(self, name: str) -> Policy:
        found = self._policies.get(name)
        if found is None:
            found = self._policies[name] = make_policy(name, self._typical)
        return found

    # -- nodes ----------------------------------------------------------------------------------------

    def add_node(self, spec: NodeSpec) -> None:
        if self.book.is_outside(spec.name):
            raise ValueError(f"node {spec.name} is a topology-only node; remove it as such first")
        n = self.state.add_node(spec)
        if self._rank.size < self.state.rows:
            grown = np.zeros(self.state.rows, dtype=np.int64)
            grown[: self._rank.size] = self._rank
            self._rank = grown
        self._rank[n] = tie_rank(self.seed, spec.name)
        self._on_node[n] = set()
        for gpu in spec.gpus:
            if gpu.uuid in self._fenced:
                self.state.fence(gpu.uuid)

    def remove_node(self, name: str) -> list[str]:
        """Drop a node and every pod the engine holds on it; returns those pods' uids."""
        n = self.state.index[name]
        dropped = sorted(self._on_node.get(n, ()))
        for uid in dropped:
            self.forget(uid)
        for key in sorted(self._held_on_node.pop(n, ())):
            self.release_hold(key)
        self.book.drop_row(n)
        self.state.remove_node(name)
        self._on_node.pop(n, None)
        return dropped

    def update_node(self, spec: NodeSpec) -> list[str]:
        """Apply a new spec. If the GPU inventory changed, pods whose GPUs are gone are dropped and
        returned; the others keep their devices (so do holds: one whose GPUs are gone is released)."""
        n = self.state.index.get(spec.name)
        if n is None:
            self.add_node(spec)
            return []
        old = self.state.nodes[n]
        assert old is not None
        if old.gpus == spec.gpus:
            self.state.replace_spec(spec)
            return []
        bound = [self._bound[uid] for uid in sorted(self._on_node.get(n, ()))]
        for b in bound:
            self.forget(b.pod.uid)
        holds = [(key, self._holds[key]) for key in sorted(self._held_on_node.get(n, ()))]
        for key, _ in holds:
            self.release_hold(key)
        self.state.remove_node(spec.name)
        self.add_node(spec)
        uuids = {g.uuid for g in spec.gpus} | {s.uuid for g in spec.gpus for s in g.mig}
        for key, (_, placement, namespace) in holds:
            if all(set(c.uuids) <= uuids for c in placement.containers):
                self.hold(key, placement, namespace=namespace)
        dropped = []
        for b in bound:
            if all(set(c.uuids) <= uuids for c in b.placement.containers):
                self.assume(b.pod, b.placement)
            else:
                dropped.append(b.pod.uid)
        return dropped

    @property
    def node_names(self) -> list[str]:
        return sorted(self.state.index)

    # -- topology-only nodes --------------------------------------------------------------------------

    def add_topology_node(self, spec: NodeSpec) -> None:
        """Add or replace a node nothing is placed on whose labels and taints still make topology
        domains for affinity and spread (the scheduler: a node it does not manage; kube-scheduler counts
        every node). Only ``spec.name``, ``labels`` and ``taints`` are read."""
        if spec.name in self.state.index:
            raise ValueError(f"node {spec.name} is a node pods are placed on, not a topology-only node")
        self.book.set_outside_node(spec)

    def remove_topology_node(self, name: str) -> list[str]:
        """Drop a topology-only node and the pods counted on it; returns those pods' uids."""
        return self.book.remove_outside_node(name)

    def add_topology_pod(self, pod: PendingPod, node: str) -> bool:
        """Count ``pod``, bound to topology-only node ``node``, for other pods' affinity and spread rules
        (its labels, namespace and terms; it holds no resources here). Replaces an earlier count.
        Returns whether its arrival may let a waiting pod in (a required affinity or a spread
        constraint counted it)."""
        if pod.uid in self._bound:
            raise ValueError(f"pod {pod.key} ({pod.uid}) is placed on {self._bound[pod.uid].placement.node}")
        return self.book.add_outside(pod, node)

    def remove_topology_pod(self, uid: str) -> bool | None:
        """Stop counting a pod of a topology-only node. None when it was not counted; else whether its
        leaving may let a waiting pod in (it carried a required anti-affinity term, or a pod's
        anti-affinity term, preferred term or spread constraint counted it; fewer pods never satisfy a
        required affinity)."""
        return self.book.remove_outside(uid)

    def ledger(self, node: str) -> list[GpuLedger]:
        return self.state.ledger(node)

    def gpu_capacity(self) -> tuple[int, int, int]:
        """Every node's GPUs: their MiB in all, how many, the largest one's MiB. What the ledgers of
        ``node_names`` add up to, read from the arrays: queue status and reclaim ask for it per decision,
        and building 40,000 ledgers for it took most of a preemption's time at 5,000 nodes."""
        state = self.state
        return int(state.cap_total.sum()), int(state.gpu_count.sum()), int(state.cap.max(initial=0))

    # -- GPU modes and layouts (docs/mig.md) ----------------------------------------------------------

    def fence(self, uuid: str) -> None:
        """Book nothing on GPU ``uuid`` (idle; raises ValueError when something is booked on it) until
        ``unfence``: its layout change is pending. Kept across the node's updates."""
        if uuid in self.state.gpu_at:
            self.state.fence(uuid)
        self._fenced.add(uuid)

    def unfence(self, uuid: str) -> None:
        self._fenced.discard(uuid)
        if uuid in self.state.gpu_at:
            self.state.unfence(uuid)

    @property
    def fenced(self) -> frozenset[str]:
        return frozenset(self._fenced)

    def gpu_idle(self, uuid: str) -> bool:
        """Whether nothing is booked on GPU ``uuid`` (no pod, no hold, no MIG slice taken)."""
        n, g = self.state.gpu_at[uuid]
        return not self.state.npods[n, g] and not self.state.mig.busy(n, g)

    def idle_gpus(self, node: str) -> list[tuple[str, str, GpuMode]]:
        """(uuid, model, mode) of the node's GPUs with nothing booked and no pending change."""
        n = self.state.index[node]
        spec = self.state.nodes[n]
        assert spec is not None
        return [
            (g.uuid, g.model or spec.gpu_model, g.mode)
            for g in spec.gpus
            if g.uuid not in self._fenced and self.gpu_idle(g.uuid)
        ]

    # -- bound pods -----------------------------------------------------------------------------------

    def assume(self, pod: PendingPod, placement: Placement) -> Placement:
        """Record a pod that holds (or is being bound to) GPUs: ``placement`` as the engine placed it or,
        for a pod bound before, as its binding reads (``gpufrac.scheduler.objects.bound_placement``)."""
        if pod.uid in self._bound:
            self.forget(pod.uid)
        n = self.state.index[placement.node]
        charges, slices = self._charges(placement, n, holder=f"pod {pod.key}")
        allocation = Allocation(
            node=n,
            cpu_milli=pod.cpu_milli,
            memory_bytes=pod.memory_bytes,
            tenant=self.state.namespace_id(pod.namespace),
            charges=charges,
            slices=slices,
        )
        self._commit(pod, allocation, placement)
        return placement

    def _charges(
        self, placement: Placement, n: int, *, holder: str
    ) -> tuple[tuple[DeviceCharge, ...], tuple[SliceCharge, ...]]:
        """What ``placement`` books on node row ``n``: per device a GPU charge, or for a MIG device
        (a slice's UUID) the slice, whole."""
        charges, slices = [], []
        mig = self.state.mig.slots
        for cp in placement.containers:
            for d in cp.devices:
                found = mig.get(d.uuid)
                if found is not None and found.node == n:
                    slices.append(SliceCharge(found.gpu, d.uuid, found.slice.mib))
                    continue
                at = self.state.gpu_at.get(d.uuid)
                if at is None or at[0] != n:
                    raise ValueError(f"GPU {d.uuid} of {holder} is not on node {placement.node}")
                mode = EXCLUSIVE if cp.exclusive else MODE_CODE[cp.mode]
                ppm = 0 if d.compute_portion is None else portion_ppm(d.compute_portion)
                charges.append(DeviceCharge(at[1], d.request_mib, d.limit_mib, ppm, mode))
        return tuple(charges), tuple(slices)

    # -- shares no pod holds ----------------------------------------------------------------------------

    def hold(self, key: str, placement: Placement, *, namespace: str) -> None:
        """Book GPU shares that no pod holds itself: a DRA claim's allocation, which several pods may
        use and which outlives them until it is deallocated. It charges its GPUs (memory, limits,
        compute, mode, the tenant ``namespace``) like a pod, but no pod slot, no host resources, no
        queue, and it is nobody's preemption victim nor counted by other pods' affinity rules.
        Replaces an earlier hold of ``key``; raises ValueError when a GPU is not on the node."""
        self.release_hold(key)
        n = self.state.index.get(placement.node)
        if n is None:
            raise ValueError(f"node {placement.node} of {key} is not known")
        charges, slices = self._charges(placement, n, holder=key)
        allocation = Allocation(n, 0, 0, self.state.namespace_id(namespace), charges, pods=0, slices=slices)
        self.state.apply(allocation)
        self._holds[key] = (allocation, placement, namespace)
        self._held_on_node.setdefault(n, set()).add(key)

    def release_hold(self, key: str) -> bool:
        """Give back what ``hold`` booked for ``key``; False when it held nothing."""
        found = self._holds.pop(key, None)
        if found is None:
            return False
        allocation = found[0]
        self.state.release(allocation)
        self._held_on_node.get(allocation.node, set()).discard(key)
        return True

    def held(self, key: str) -> Placement | None:
        """What ``hold`` booked for ``key``, or None."""
        found = self._holds.get(key)
        return None if found is None else found[1]

    def forget(self, uid: str) -> bool:
        """Release everything a pod holds (deleted, finished, or its binding failed)."""
        b = self._bound.pop(uid, None)
        if b is None:
            return False
        self.state.release(b.allocation)
        self.pods.remove(uid)
        self.book.remove(uid)
        self._on_node[b.allocation.node].discard(uid)
        self.queues.charge(b.pod.queue, -b.gpu_mib, -b.whole_gpus)
        return True

    def bound_pod(self, uid: str) -> PendingPod | None:
        """The pod as it was booked (its priority and queue are what preemption compares)."""
        b = self._bound.get(uid)
        return None if b is None else b.pod

    def placement_of(self, uid: str) -> Placement | None:
        b = self._bound.get(uid)
        return None if b is None else b.placement

    @property
    def bound_uids(self) -> list[str]:
        return list(self._bound)

    def _commit(self, pod: PendingPod, allocation: Allocation, placement: Placement) -> None:
        self.state.apply(allocation)
        self.pods.add(pod.uid, allocation, priority=pod.priority, queue=pod.queue, movable=pod.movable)
        self.book.add(pod, allocation.node)
        mib = allocation.gpu_mib
        gpus = _whole_gpus(allocation)
        self._bound[pod.uid] = _Bound(pod, allocation, placement, mib, gpus)
        self._on_node[allocation.node].add(pod.uid)
        self.queues.charge(pod.queue, mib, gpus)

    # -- pods that are not placed here --------------------------------------------------------------

    def nominate(self, pod: PendingPod, node: str) -> None:
        """Hold room on ``node`` for a pending pod a preemptor nominated there: pods of lower or equal
        priority do not get that room; the pod itself tries that node first; its queue counts it as
        held (``queue_shares``). A node the engine does not know holds nothing."""
        row = self.state.index.get(node)
        self.book.nominate(pod, row)
        if row is None:
            self._nominees.pop(pod.uid, None)
        else:
            self._nominees[pod.uid] = pod

    def drop_nomination(self, uid: str) -> bool:
        """Stop holding room for ``uid`` (its nomination was cleared, or it was deleted); False when
        none was held."""
        self._nominees.pop(uid, None)
        return self.book.drop_nomination(uid)

    def nominated(self, uid: str) -> bool:
        """Whether pending pod ``uid`` holds a nomination (its queue counts it as held)."""
        return self.book.nomination(uid) is not None

    def nominated_uids(self) -> list[str]:
        """Every uid ``nominated`` says True for (a few: the open plans' pods)."""
        return self.book.held_uids()

    # -- queues as the books will be --------------------------------------------------------------------

    def booked_amount(self, uid: str) -> QueueAmount | None:
        """The queue a placed pod is charged to and what it holds there; None when it is not placed."""
        b = self._bound.get(uid)
        return None if b is None else QueueAmount(b.pod.queue, Amount(b.gpu_mib, b.whole_gpus))

    def nominee_amounts(
        self, *, besides: str | None = None, extra: Mapping[str, QueueAmount] | None = None
    ) -> list[QueueAmount]:
        """What each pod nominated to a node asks for there (resolved against that node's largest GPU),
        charged to its queue, ``extra`` by uid in place of (or besides) the engine's; ``besides`` is
        left out (the pod deciding now)."""
        extra = extra if extra is not None else {}
        if isinstance(extra, QueueTally):  # one sum a queue, kept as plans come and go
            out = extra.totals(besides=besides)
        else:
            out = [amount for uid, amount in extra.items() if uid != besides]
        for uid, pod in list(self._nominees.items()):
            held = self.book.nomination(uid)
            if held is None:  # placed since (placing drops the nomination) or its node went away
                self._nominees.pop(uid, None)
                continue
            if uid == besides or uid in extra:
                continue
            out.append(QueueAmount(pod.queue, request_amount(pod.gpu, int(self.state.cap[held.row].max()))))
        return out

    def _nominees_held(self, *, besides: str) -> dict[str, tuple[int, int]]:
        """Per queue (subtree) what its nominees will book (MiB, whole GPUs): a queue's limit counts
        them, so a pod does not take the place of a nominee its queue's limit has room for only once."""
        held: dict[str, tuple[int, int]] = {}
        for entry in self.nominee_amounts(besides=besides):
            for q in self.queues.lineage(entry.queue):
                mib, gpus = held.get(q, (0, 0))
                held[q] = (mib + entry.amount.mib, gpus + entry.amount.gpus)
        return held

    def queue_shares(
        self,
        *,
        leaving: Iterable[str] = (),
        waiting: Iterable[QueueAmount] = (),
        besides: str | None = None,
        nominees: Mapping[str, QueueAmount] | None = None,
    ) -> QueueShares:
        """The queues as the books will be (``gpufrac.placement.queue_shares``): the placed pods
        ``leaving`` gone, the nominees held (the engine's, and ``nominees`` by uid: what a caller's
        open plans will book, known before the engine hears of the nomination), ``waiting`` the
        demand of the pods still pending. ``leaving`` is uids, or a ``QueueTally`` of what they hold
        (read as one sum a queue, as a ``QueueTally`` of ``nominees`` is)."""
        if isinstance(leaving, QueueTally):
            gone = leaving.totals()
        else:
            gone = [a for a in (self.booked_amount(uid) for uid in leaving) if a is not None]
        capacity = {
            QueueResource.GPU_MEMORY: int(self.state.cap_total.sum()),
            QueueResource.GPUS: int(self.state.gpu_count.sum()),
        }
        return QueueShares(
            self.queues,
            capacity,
            leaving=gone,
            nominated=self.nominee_amounts(besides=besides, extra=nominees),
            waiting=waiting,
            usage=self._usage,
            k=self._usage_k,
        )

    def set_usage_history(self, usage: Mapping[QueueResource, Mapping[str, float]], k: float) -> None:
        """Make every fair share from now on time-based: ``usage`` is each queue's historical usage
        normalized to the cluster's capacity (``UsageHistory.scores``), ``k`` its weight (0: off)."""
        self._usage = {r: dict(v) for r, v in usage.items()}
        self._usage_k = max(0.0, float(k))

    def set_namespace(self, name: str, labels: dict[str, str]) -> None:
        """A namespace's labels, for affinity terms that select namespaces by label."""
        self.book.set_namespace(name, labels)

    # -- queues ---------------------------------------------------------------------------------------

    def set_queue(self, queue: Queue) -> None:
        self.queues.set(queue)

    def set_queues(self, queues: Iterable[Queue]) -> None:
        """Replace the known queues (what pods hold stays charged to their queues)."""
        self.queues.replace(queues)

    # -- scheduling -----------------------------------------------------------------------------------

    def schedule(
        self,
        pods: Sequence[PendingPod],
        *,
        gang: bool = False,
        min_member: int | None = None,
        largest_first: bool | None = None,
        statement: Statement | None = None,
    ) -> list[Decision]:
        """Place ``pods`` in queue order. One Decision per pod, in input order. ``largest_first``
        (default: the policy's look-ahead) places the pods of a queue and priority in the look-ahead's
        order (``batch_key``: largest first unless the policy orders otherwise; ``fair_share``).

        With ``gang`` the batch is one statement: if fewer than ``min_member`` pods (default: all of
        them) are placed, every placement of the batch is discarded and each pod is Unschedulable with
        the gang's count in its message. Members beyond ``min_member`` that do not fit stay
        Unschedulable on their own while the others are kept (a PodGroup's ``minMember``).

        With ``statement`` the placements are made through it (a failed gang is rolled back to where the
        batch began) and kept there, for its caller to commit or undo; without, they are committed."""
        decisions: list[Decision | None] = [None] * len(pods)
        if len(pods) == 1 and not gang:
            return [self.place(pods[0]) if statement is None else statement.place(pods[0])]
        need = len(pods) if min_member is None else min_member
        if gang and not 0 <= need <= len(pods):
            raise ValueError(f"min_member={min_member} must be between 0 and the gang's {len(pods)} pods")
        largest = int(self.state.cap.max()) if self.state.cap.size else 0
        shares = self.queue_shares(
            waiting=[QueueAmount(p.queue, request_amount(p.gpu, largest)) for p in pods]
        )
        fair = functools.cache(lambda queue: float(shares.fair_share(queue)))
        if largest_first is None:
            largest_first = self.policy(self.default_policy).largest_first

        def size(i: int) -> tuple[int, ...]:
            return self.batch_key(pods[i])

        st = self.statement() if statement is None else statement
        with st if statement is None else nullcontext(st):
            start = st.checkpoint()

            def place(i: int) -> None:
                decisions[i] = st.place(pods[i])

            scheduling_order(pods, self.queues, fair, place, size=size if largest_first else None)
            failed = [d for d in decisions if isinstance(d, Unschedulable)]
            placed = len(pods) - len(failed)
            if gang and placed < need:
                st.rollback(start)
                total = self.state.node_count
                detail = f"gang of {len(pods)} needs {need} placed together, {placed} fit"
                decisions = [
                    Unschedulable(
                        p.uid,
                        total,
                        d.counts if isinstance(d, Unschedulable) else (),
                        f"{detail}; {d.detail}" if isinstance(d, Unschedulable) and d.detail else detail,
                    )
                    for p, d in zip(pods, decisions, strict=True)
                ]
            if statement is None:
                st.commit()
        return [d for d in decisions if d is not None]

    def statement(self) -> Statement:
        return Statement(self)

    def batch_key(self, pod: PendingPod) -> tuple[int, ...]:
        """Where ``pod`` goes when a batch is placed by look-ahead, larger first: the default policy's
        order (``Policy.batch_key``; fgd-room's puts the shares that strand the least room first), else
        largest first (``Demand.size``). One order per batch, even for pods that name their own policy."""
        demand = self._demand(pod, pod.policy or self.default_policy, flip=False)
        order = self.policy(self.default_policy).batch_key
        return demand.size if order is None else order(demand)

    def place(self, pod: PendingPod) -> Decision:
        """Place one pod now (assumed on success)."""
        if pod.uid in self._bound:
            raise ValueError(f"pod {pod.key} ({pod.uid}) is already placed")
        name = pod.policy or self.default_policy
        try:
            policy = self.policy(name)
        except ValueError as err:
            return Unschedulable(pod.uid, self.state.node_count, detail=str(err))
        demand = self._demand(pod, name, flip=False)
        if pod.uid not in self._observed:
            # A learned distribution counts each pod once, however often a pending pod is retried.
            if len(self._observed) >= _MAX_OBSERVED:
                self._observed.clear()
            self._observed.add(pod.uid)
            policy.observe(demand)
        policy.prepare(self.state)
        decision = self._place_kind(pod, demand, policy)
        if isinstance(decision, Unschedulable) and can_fall_back(pod):
            fallback = self._place_kind(pod, self._demand(pod, name, flip=True), policy)
            if isinstance(fallback, Placement):
                return fallback
        return decision

    def explain(self, pod: PendingPod, node: str) -> Status:
        """Why ``node`` can or cannot take ``pod`` right now (the first failing filter)."""
        name = pod.policy or self.default_policy
        demand = self._demand(pod, name, flip=False)
        n = self.state.index[node]
        spec = self.state.nodes[n]
        assert spec is not None
        code = static_reason(spec, demand)
        if code is Reason.FITS:
            code = Reason(int(resource_fit(self.state, demand, np.array([n]), self.rules).reasons[0]))
        if code is Reason.FITS:
            overlay = self.book.filter(pod, demand)
            if overlay is not None:
                code = Reason(int(overlay[n]))
        return Status(code, code.message)

    def tie_rank(self, nodes: np.ndarray) -> np.ndarray:
        """The seeded tie-break rank of node slots (larger wins), for callers that order nodes as
        placement does."""
        return self._rank[nodes]

    def demand(self, pod: PendingPod) -> Demand:
        """The pod's request as the filters compute with it, under the pod's policy."""
        return self._demand(pod, pod.policy or self.default_policy, flip=False)

    def static_fits(self, pod: PendingPod) -> np.ndarray:
        """Node slots whose spec alone admits ``pod`` (readiness, taints, selectors, affinity, mode
        capability), from the same per-spec-version cache placement uses."""
        name = pod.policy or self.default_policy
        demand = self._demand(pod, name, flip=False)
        kc = self._kind(demand, self.policy(name))
        live = self.state.live()
        return live[self._static(kc, live) == 0]

    # -- internals ------------------------------------------------------------------------------------

    def _demand(self, pod: PendingPod, policy: str, *, flip: bool) -> Demand:
        sig = (
            pod.gpu,
            pod.cpu_milli,
            pod.memory_bytes,
            pod.namespace,
            policy,
            flip,
            tuple(pod.node_selector.items()) if pod.node_selector else (),
            pod.affinity,
            pod.tolerations,
        )
        found = self._demands.get(sig)
        if found is None:
            if len(self._demands) > 4 * _MAX_KINDS:
                self._demands.clear()
            found = self._demands[sig] = demand_of(pod, policy=policy, flip_modes=flip)
        return found

    def _kind(self, demand: Demand, policy: Policy) -> _KindCache:
        kc = self._kinds.get(demand.kind)
        if kc is None:
            kc = _KindCache(demand, policy, self.state.rows)
            self._kinds[demand.kind] = kc
            if len(self._kinds) > _MAX_KINDS:
                self._kinds.popitem(last=False)
        else:
            self._kinds.move_to_end(demand.kind)
            kc.resize(self.state.rows)
            epoch = policy.epoch
            if kc.epoch != epoch:
                kc.epoch = epoch
                kc.version[:] = -1
        return kc

    def _static(self, kc: _KindCache, nodes: np.ndarray) -> np.ndarray:
        st = self.state
        cache = self._statics.get(kc.spec_key)
        if cache is None or cache.reason.size < st.rows:
            fresh = _StaticCache(st.rows)
            if cache is not None:
                fresh.reason[: cache.reason.size] = cache.reason
                fresh.spec_version[: cache.spec_version.size] = cache.spec_version
            cache = self._statics[kc.spec_key] = fresh
        stale = nodes[cache.spec_version[nodes] != st.spec_version[nodes]]
        for n in stale.tolist():
            spec = st.nodes[n] if n < len(st.nodes) else None
            cache.reason[n] = _ABSENT if spec is None else static_reason(spec, kc.demand, STATIC_FILTERS)
            cache.spec_version[n] = st.spec_version[n]
        return cache.reason[nodes]

    def _refresh(self, kc: _KindCache, stale: np.ndarray) -> None:
        st = self.state
        demand = kc.demand
        reasons = self._static(kc, stale).copy()
        kc.key[stale] = -1
        kc.gpu[stale] = -1
        candidates = stale[reasons == 0]
        if candidates.size:
            fit = resource_fit(st, demand, candidates, self.rules)
            reasons[reasons == 0] = fit.reasons
            feasible = fit.feasible()
            if feasible.nodes.size and demand.mig and not demand.containers:
                kc.key[feasible.nodes] = (_mig_scores(st, demand, feasible.nodes) << _RANK_BITS) | self._rank[
                    feasible.nodes
                ]
            elif feasible.nodes.size:
                scores, gpu = kc.policy.score(st, demand, feasible)
                kc.key[feasible.nodes] = (scores << _RANK_BITS) | self._rank[feasible.nodes]
                single = demand.single
                if single is not None and single.count == 1:
                    if gpu is None:
                        gpu = _first_choice(kc.policy, st, single, feasible)
                    kc.gpu[feasible.nodes] = gpu
        kc.reason[stale] = reasons
        kc.version[stale] = st.version[stale]

    def _place_kind(self, pod: PendingPod, demand: Demand, policy: Policy) -> Decision:
        st = self.state
        kc = self._kind(demand, policy)
        rows = st.rows
        version = st.version
        stale = np.flatnonzero(kc.version[:rows] != version)
        if stale.size:
            self._refresh(kc, stale)
        overlay = self.book.filter(pod, demand)
        key = kc.key[:rows]
        if overlay is not None:
            key = np.where(overlay[:rows] == 0, key, -1)
        soft = self.book.soft(pod, demand, key >= 0)
        nominated = self.state.index.get(pod.nominated_node) if pod.nominated_node else None
        while True:
            if nominated is not None and key[nominated] >= 0:
                best = nominated  # kube-scheduler tries the nominated node first
            elif soft is None:
                best = int(np.argmax(key))  # best score; ties: the best tie-break rank
            else:
                # Preferences rank first (coarse levels), the policy's score among equals.
                open_ = key >= 0
                top = soft[open_].max() if open_.any() else 0
                best = int(np.argmax(np.where(open_ & (soft == top), key, -1)))
            if key[best] < 0:
                return self._unschedulable(pod, kc, overlay)
            allocation = self._allocate(pod, demand, policy, best, int(kc.gpu[best]))
            if allocation is None:
                # The containers fit one by one but not together here: skip this node until it changes.
                key[best] = -1  # a view of kc.key without an overlay, a copy with one
                kc.key[best] = -1
                kc.reason[best] = Reason.DEVICE_ASSIGNMENT
                nominated = None
                continue
            mib = allocation.gpu_mib
            held = self._nominees_held(besides=pod.uid) if self._nominees else None
            exceeded = self.queues.exceeded(pod.queue, mib, _whole_gpus(allocation), held=held)
            if exceeded is not None:
                return Unschedulable(pod.uid, st.node_count, detail=over_limit(pod.queue, *exceeded))
            placement = self._placement(pod, demand, allocation)
            self._commit(pod, allocation, placement)
            return placement

    def _unschedulable(
        self, pod: PendingPod, kc: _KindCache, overlay: np.ndarray | None = None
    ) -> Unschedulable:
        st = self.state
        codes = kc.reason[: st.rows]
        if overlay is not None:
            codes = np.where(codes == 0, overlay[: st.rows], codes)
        codes = codes[st.present[: st.rows]]
        counts = np.bincount(codes, minlength=len(Reason))
        wanted = ", ".join(m.describe() for m in kc.demand.mig)

        def message(code: int) -> str:
            if code == Reason.NO_FREE_MIG_SLICE and wanted:
                return mig_slice_message(wanted)
            return Reason(code).message

        ranked = sorted(
            ((message(code), int(n)) for code, n in enumerate(counts[: len(Reason)]) if n and code),
            key=lambda item: (-item[1], item[0]),
        )
        return Unschedulable(pod.uid, st.node_count, tuple(ranked))

    def _allocate(
        self, pod: PendingPod, demand: Demand, policy: Policy, n: int, gpu: int
    ) -> Allocation | None:
        st = self.state
        tenant = st.namespace_id(pod.namespace)
        charges: list[DeviceCharge] = []
        single = demand.single
        if single is not None and single.count == 1 and gpu >= 0:
            charges.append(_charge(st, single, n, gpu))
        elif demand.containers:
            nodes = np.array([n])
            staged: list[Allocation] = []
            try:
                for c in demand.containers:
                    _, mask = container_fit(st, c, nodes, tenant, self.rules)
                    order = policy.picker.order(st, c, n, mask[0])
                    if order.size < c.count:
                        return None
                    mine = tuple(_charge(st, c, n, int(g)) for g in order[: c.count])
                    charges.extend(mine)
                    # Later containers of the pod must see these devices taken.
                    step = Allocation(n, 0, 0, tenant, mine)
                    st.apply(step)
                    staged.append(step)
            finally:
                for step in reversed(staged):
                    st.release(step)
        slices: tuple[SliceCharge, ...] = ()
        if demand.mig:
            chosen = st.mig.choose(n, demand.mig)
            if chosen is None:
                return None
            slices = tuple(SliceCharge(s.gpu, s.slice.uuid, s.slice.mib) for group in chosen for s in group)
        return Allocation(n, demand.cpu_milli, demand.memory_bytes, tenant, tuple(charges), slices=slices)

    def _placement(self, pod: PendingPod, demand: Demand, allocation: Allocation) -> Placement:
        st = self.state
        n = allocation.node
        spec = st.nodes[n]
        assert spec is not None
        containers = []
        i = 0
        for c in demand.containers:
            devices = []
            for charge in allocation.charges[i : i + c.count]:
                gpu = spec.gpus[charge.gpu]
                devices.append(
                    DeviceAssignment(
                        uuid=gpu.uuid,
                        index=gpu.index,
                        request_mib=charge.request_mib,
                        limit_mib=charge.limit_mib,
                        compute_portion=charge.ppm / PPM if c.mode is ComputeMode.SM_SHARING else None,
                    )
                )
            i += c.count
            containers.append(ContainerPlacement(c.name, c.mode, c.exclusive, tuple(devices)))
        j = 0
        for m in demand.mig:
            devices = []
            for sl in allocation.slices[j : j + m.count]:
                gpu = spec.gpus[sl.gpu]
                devices.append(DeviceAssignment(sl.uuid, gpu.index, sl.mib, sl.mib, None))
            j += m.count
            containers.append(
                ContainerPlacement(m.name, ComputeMode.TIME_SLICING, False, tuple(devices), mig=True)
            )
        return Placement(pod.uid, spec.name, tuple(containers))


def _charge(st: ClusterState, c: ContainerDemand, n: int, g: int) -> DeviceCharge:
    cap = st.cap[n, g : g + 1]
    return DeviceCharge(
        gpu=g,
        request_mib=int(c.request_mib(cap)[0]),
        limit_mib=int(c.limit_mib(cap)[0]),
        ppm=int(c.ppm(cap)[0]),
        mode=EXCLUSIVE if c.exclusive else MODE_CODE[c.mode],
    )


_MIG_SCORE_TOP = (1 << 22) - 1


def _mig_scores(st: ClusterState, demand: Demand, nodes: np.ndarray) -> np.ndarray:
    """Score of each node for a pod that asks only for MIG slices: the less memory its slices would
    waste over a size request the better (a named profile wastes none), then the more slices the node
    has taken already (pack MIG pods, so that idle GPUs stay free to be re-partitioned)."""
    out = np.zeros(nodes.size, dtype=np.int64)
    for i, n in enumerate(nodes.tolist()):
        chosen = st.mig.choose(n, demand.mig)
        if chosen is None:
            continue
        pairs = zip(demand.mig, chosen, strict=True)
        waste = sum(s.slice.mib - (m.min_mib or s.slice.mib) for m, group in pairs for s in group)
        taken = sum(1 for s in st.mig.node_slots(n) if s.taken)
        out[i] = max(0, _MIG_SCORE_TOP - min(waste, 1 << 17) * 16 + min(taken, 15))
    return out


def _first_choice(policy: Policy, st: ClusterState, c: ContainerDemand, fit: Fit) -> np.ndarray:
    """The picker's first GPU for the single container on each node, vectorised when it offers that."""
    if policy.first_gpu is not None:
        return policy.first_gpu.first(fit, 0)
    return np.array(
        [int(policy.picker.order(st, c, int(n), m)[0]) for n, m in zip(fit.nodes, fit.masks[0], strict=True)]
    )


class Statement:
    """Changes to the engine that can be kept or taken back: KAI Scheduler's ``Statement``
    (pkg/scheduler/framework/statement.go: ``Evict``, ``Pipeline`` and ``Allocate`` each append an
    operation that carries its reverse, ``unevict``, ``unpipeline`` or ``unallocate``; ``Checkpoint`` is
    the number of operations and ``Rollback(cp)`` undoes them newest first back to it).

    Every "what if" of the placement core runs on one: the preemption search's ``simulate`` (victims
    evicted, the pod placed), consolidation's ``relocate`` (moved pods evicted, the pod and each moved pod
    placed), gang preemption and gang consolidation (members placed or given room, victims evicted, moved
    pods assumed at their new homes, the gang statement tried per victim given back) and
    ``Engine.schedule``'s all-or-nothing gangs.

    Three operations, each recorded with its exact inverse:

    - ``place(pod)``: the engine's own placement; undone by forgetting the pod.
    - ``evict(uid)``: a placed pod leaves; undone by assuming it again where it was.
    - ``assume(pod, placement)``: a pod is booked at a placement the caller chose (a moved pod at its new
      home, a gang member at the room a search found); a pod that was placed already is evicted first,
      so undoing puts it back where it was.

    Undoing in reverse order restores every book exactly, not just the totals: ``ClusterState.apply``
    and ``release`` are integer inverses, the queue charges and the pod book follow the pod, and the
    pod table reuses the last freed slot first, so each pod gets its old slot back (the preemption
    search keeps slot arrays across simulations and relies on it). Nodes' ``version`` counters move on
    (they only say "recompute"), and what policies learn from a pod they saw stays learnt. Booking a
    nominated pod drops the room held for it; undoing the booking holds that room again.

    ``checkpoint()`` marks a point, ``rollback(to)`` undoes back to it and keeps the statement open (a
    reprieve tries one victim back, then takes it back again), ``commit()`` keeps everything, and
    ``discard()`` undoes everything. Use it as a context manager: leaving the block without ``commit``
    (or by an exception) discards. Changes made to the engine outside the statement while it is open
    must be undone before it rolls back over them (a nested statement, discarded, is): the inverses
    assume the books they were recorded on.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The inverse of each operation, in the order done: a uid to forget, or a pod and placement to
        # assume again.
        self._undo: list[str | tuple[PendingPod, Placement] | _Renominate] = []
        self._open = True

    @property
    def engine(self) -> Engine:
        return self._engine

    def place(self, pod: PendingPod) -> Decision:
        """``Engine.place`` through the statement."""
        self._check()
        held = self._engine.book.nomination(pod.uid)
        decision = self._engine.place(pod)
        if isinstance(decision, Placement):
            self._placed(pod.uid, held)
        return decision

    def evict(self, uid: str) -> tuple[PendingPod, Placement]:
        """Book placed pod ``uid`` off; returns it as it was booked and where."""
        self._check()
        engine = self._engine
        booked, placement = engine.bound_pod(uid), engine.placement_of(uid)
        if booked is None or placement is None:
            raise ValueError(f"pod {uid} is not placed")
        engine.forget(uid)
        self._undo.append((booked, placement))
        return booked, placement

    def assume(self, pod: PendingPod, placement: Placement) -> Placement:
        """``Engine.assume`` through the statement (a pod placed already leaves its old place first)."""
        self._check()
        if self._engine.bound_pod(pod.uid) is not None:
            self.evict(pod.uid)
        held = self._engine.book.nomination(pod.uid)
        self._engine.assume(pod, placement)
        self._placed(pod.uid, held)
        return placement

    def _placed(self, uid: str, held: Nomination | None) -> None:
        # Booking a pod drops the room held for its nomination: forgetting it again holds that room.
        if held is not None:
            self._undo.append(_Renominate(uid, held))
        self._undo.append(uid)

    def checkpoint(self) -> int:
        """A mark to ``rollback`` to."""
        return len(self._undo)

    def rollback(self, to: int = 0) -> None:
        """Undo, newest first, every operation since checkpoint ``to``; the statement stays open."""
        engine, undo = self._engine, self._undo
        if not 0 <= to <= len(undo):
            raise ValueError(f"checkpoint {to} is not in this statement (it has {len(undo)} operations)")
        while len(undo) > to:
            step = undo.pop()
            if isinstance(step, str):
                engine.forget(step)
            elif isinstance(step, _Renominate):
                engine.book.renominate(step.uid, step.hold)
            else:
                engine.assume(*step)

    def commit(self) -> None:
        """Keep every change; the statement closes."""
        self._undo.clear()
        self._open = False

    def discard(self) -> None:
        """Undo every change; the statement closes."""
        self.rollback(0)
        self._open = False

    def _check(self) -> None:
        if not self._open:
            raise RuntimeError("statement already closed")

    def __enter__(self) -> Statement:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._open:
            self.discard()


@dataclass(frozen=True, slots=True)
class _Renominate:
    uid: str
    hold: Nomination


def _whole_gpus(allocation: Allocation) -> int:
    """GPUs the allocation holds exclusively (a queue's whole-GPU count)."""
    return sum(1 for c in allocation.charges if c.mode == EXCLUSIVE)


def over_limit(queue: str, at: str, resource: QueueResource, limit: int) -> str:
    what = (
        f"GPU-memory limit of {limit} MiB"
        if resource is QueueResource.GPU_MEMORY
        else (f"limit of {limit} whole GPUs")
    )
    if at == queue:
        return f"queue {queue} would exceed its {what}"
    return f"queue {queue} would take its ancestor queue {at} past that queue's {what}"
