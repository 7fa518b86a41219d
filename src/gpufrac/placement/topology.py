"""The pods on each node, as far as other pods' rules care: inter-pod affinity, topology spread, host
ports, extended resources, ephemeral storage, and the room preemptors hold for nominated pods.

Why a separate book: the engine caches filter and score results per kind of pod and per node, and
recomputes a node only when that node changes. That is right for CPU, memory and GPUs, which depend on
the node alone, but an affinity or spread rule depends on the pods of a whole topology domain (a zone)
or of the whole cluster. So these rules are evaluated per pod, as an overlay on the cached results:
``filter`` answers a reason per node slot (0: no objection), ``soft`` a preference level per node slot.
A pod that carries none of these rules, asks for none of these resources, and is repelled or attracted
by no placed pod's terms gets ``None`` from both at the cost of a dictionary lookup, so the common pod
keeps the cached path.

Counting: a *tracker* is a count, per node slot, of the placed pods that one predicate selects (the pods
matching all required affinity terms of a pod, the pods one anti-affinity term selects, the pods of a
namespace one spread selector selects). Trackers are built on first use by one pass over the placed
pods and then kept current as pods are placed and released, so a rule costs a few vector operations per
pod (counts summed per topology domain with ``bincount``) whatever the number of pods. Pods placed in
the same batch are placed one after another through ``add``, so a batch keeps these rules between its
own pods, as kube-scheduler does between its scheduling cycles.

Topology-only nodes. kube-scheduler counts every node as a topology domain and every pod bound
anywhere, but the engine places only on the nodes it holds ledgers for (for the scheduler: the managed
nodes). Nodes it must know for their labels and taints alone (``set_outside_node``; the scheduler's
unmanaged nodes) and the pods bound to them (``add_outside``: labels, namespace, the terms they carry)
live here only: they have slots after the state's rows, so every per-slot count is one array laid out
as [state rows | topology-only slots], moved to a new layout when either part grows (rare: the state
doubles its rows, the topology-only part doubles its capacity). They are domains and hold counted pods
like any node, but ``filter`` and ``soft`` answer for the state's rows only: nothing is placed on them.
With no topology-only node the layout is the state's rows alone, as before.

Semantics follow kube-scheduler v1.34 (pkg/scheduler/framework/plugins/interpodaffinity/filtering.go
and scoring.go, podtopologyspread/filtering.go and scoring.go, nodeports, noderesources/fit.go):

- required affinity: the node must carry every term's topology key, and for every term the node's
  domain must hold a pod that matches *all* the terms; unless no such pod exists anywhere and the pod
  matches all its own terms (the first pod of a self-affine group).
- required anti-affinity: no term's domain on the node may hold a pod that the term selects.
- existing pods' required anti-affinity (the symmetric rule): a placed pod whose term selects the new
  pod repels it from every node of the placed pod's domain.
- topology spread (DoNotSchedule): the node must carry the key; domains are the values on nodes that
  pass the constraint's nodeAffinityPolicy and nodeTaintsPolicy and carry every constraint's key; the
  global minimum is 0 when fewer domains than ``minDomains`` exist; ``count(domain) + self - min`` must
  not exceed ``maxSkew``.
- preferences (preferred pod and node affinity terms; ScheduleAnyway spread; PreferNoSchedule taints
  the pod does not tolerate) are scores normalised as kube-scheduler normalises them (0..100, with its
  default plugin weights: 2, 2, 2, 3), then cut into ``SOFT_LEVELS`` coarse levels
  that rank nodes before the GPU policy does: the GPU policy chooses among nodes of about the same
  preference. (kube-scheduler adds the scores of all its plugins; a GPU scheduler whose placement
  score is a fragmentation measure cannot add them meaningfully, so a preference ranks first, coarsely.)
- the inter-pod affinity score counts placed pods' terms too, as kube-scheduler's does: a placed pod's
  preferred affinity (+weight) and anti-affinity (-weight) terms, and its required affinity terms
  (+``HARD_POD_AFFINITY_WEIGHT``), that select the new pod score every node of the placed pod's domain.
  A pod with no preference of its own is ranked by them too.

The domains are those of the nodes this engine places on and of the topology-only nodes, and the pods
counted those placed or booked on either, including pods of other schedulers the service books.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .decision import Reason
from .demand import Demand
from .filters import NodeAffinity, NodeSelector, TaintToleration
from .model import NodeSpec, PendingPod, TaintEffect
from .pod_constraints import (
    NO_EXTRAS,
    HostPort,
    InclusionPolicy,
    NodeExtras,
    PodAffinityTerm,
    SpreadConstraint,
    selects,
)
from .state import ClusterState

SOFT_LEVELS = 10
#: kube-scheduler's InterPodAffinityArgs.hardPodAffinityWeight (default 1): what a placed pod's required
#: affinity term that selects the new pod adds to the score of its domain's nodes.
HARD_POD_AFFINITY_WEIGHT = 1
_MAX_TRACKERS = 1024
_MAX_MATCH_CACHE = 8192
_OUTSIDE_MIN_CAPACITY = 8
#: What counted a pod (``_count``: tracker kinds, and "anti" for a required anti-affinity of its own)
#: when its leaving, or its arrival, may let a waiting pod in: fewer pods can lift an anti-affinity or
#: lower a spread domain's count; more pods can satisfy a required affinity or raise a spread minimum.
_HELPS_WHEN_LEAVING = frozenset({"anti", "term", "spread"})
_HELPS_WHEN_ARRIVING = frozenset({"all", "spread"})

#: A term a placed pod carries that scores other pods: the term and its signed weight.
ScoredTerm = tuple[PodAffinityTerm, int]


@dataclass(frozen=True, slots=True)
class _Entry:
    namespace: str
    labels: Mapping[str, str]
    #: the state's node slot, or ``~i`` for topology-only slot ``i`` (negative)
    row: int
    anti: tuple[PodAffinityTerm, ...]
    scored: tuple[ScoredTerm, ...]
    extras: NodeExtras


@dataclass(frozen=True, slots=True)
class Nomination:
    """Room held on node slot ``row`` for a pod a preemptor nominated there (``Engine.nominate``)."""

    row: int
    priority: int
    cpu_milli: int
    memory_bytes: int
    extras: NodeExtras


def _labels_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items())) if labels else ()


def scored_terms(pod: PendingPod) -> tuple[ScoredTerm, ...]:
    """The terms of ``pod`` that score *other* pods once it is placed (kube-scheduler's
    processExistingPod): preferred affinity (+weight), preferred anti-affinity (-weight), required
    affinity (+``HARD_POD_AFFINITY_WEIGHT``)."""
    c = pod.constraints
    if not (c.preferred_affinity or c.preferred_anti_affinity or c.required_affinity):
        return ()
    return (
        *((w.term, w.weight) for w in c.preferred_affinity),
        *((w.term, -w.weight) for w in c.preferred_anti_affinity),
        *((t, HARD_POD_AFFINITY_WEIGHT) for t in c.required_affinity),
    )


class _HeldTerms:
    """Terms placed pods carry that act on *other* pods, each with its holders counted per slot.

    Used twice: for required anti-affinity (the symmetric rule; key: the term) and for the terms scored
    back (key: a ``ScoredTerm``). Which keys select a label set is cached by the label set alone (most
    pods share a few); the namespace is checked on the few whose selector matched.
    """

    def __init__(self, term_of: Callable[[Any], PodAffinityTerm]) -> None:
        self.holders: dict[Hashable, np.ndarray] = {}
        self._total: Counter[Hashable] = Counter()
        self._hits: dict[tuple[tuple[str, str], ...], tuple[Hashable, ...]] = {}
        self._term_of = term_of

    def count(self, key: Hashable, slot: int, delta: int, span: int) -> None:
        holders = self.holders.get(key)
        if holders is None:
            holders = self.holders[key] = np.zeros(span, dtype=np.int64)
            # A new key: the label sets seen so far learn whether it selects them (cheaper than
            # forgetting them all, which every first replica of a deployment would cause).
            selector = self._term_of(key).selector
            for labels, hits in self._hits.items():
                if selects(selector, dict(labels)):
                    self._hits[labels] = (*hits, key)
        holders[slot] += delta
        self._total[key] += delta
        if self._total[key] <= 0:
            del self.holders[key], self._total[key]
            for labels, hits in self._hits.items():
                if key in hits:
                    self._hits[labels] = tuple(k for k in hits if k != key)

    def selecting(
        self, pod: PendingPod, namespace_labels: Mapping[str, Mapping[str, str]]
    ) -> tuple[Any, ...]:
        """The keys whose term selects ``pod``."""
        if not self.holders:
            return ()
        key = _labels_key(pod.labels)
        found = self._hits.get(key)
        if found is None:
            if len(self._hits) > _MAX_MATCH_CACHE:
                self._hits.clear()
            found = self._hits[key] = tuple(
                k for k in self.holders if selects(self._term_of(k).selector, pod.labels)
            )
        if not found:
            return found
        return tuple(
            k for k in found if self._term_of(k).matches(pod.namespace, pod.labels, namespace_labels)
        )

    def clear_matches(self) -> None:
        self._hits.clear()


class PodBook:
    """See the module docstring. ``namespace_labels`` are what namespace selectors match against."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.namespace_labels: dict[str, Mapping[str, str]] = {}
        self._entries: dict[str, _Entry] = {}
        self._by_label: dict[tuple[str, str], set[str]] = {}  # label pair -> uids of placed pods
        self._trackers: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        # Trackers by one label pair every pod they count must carry (None: no such pair), so placing a
        # pod tests only the trackers that can count it, not all of them.
        self._buckets: dict[tuple[str, str] | None, set[Hashable]] = {}
        self._anti = _HeldTerms(lambda term: term)
        self._scored = _HeldTerms(lambda scored: scored[0])
        self._ports: dict[tuple[str, int], dict[int, Counter[str]]] = {}
        self._ext_used: dict[str, np.ndarray] = {}
        self._eph_used = np.zeros(0, dtype=np.int64)
        self._holds: dict[str, Nomination] = {}
        # Topology-only nodes (see the module docstring): specs by slot, slots by name, pods by slot.
        self._out_specs: list[NodeSpec | None] = []
        self._out_index: dict[str, int] = {}
        self._out_free: list[int] = []
        self._out_pods: dict[int, set[str]] = {}
        self._out_capacity = 0
        self._out_epoch = 0
        self._layout = (state.rows, 0)
        self._epoch: tuple[int, int, tuple[int, int]] | None = None
        self._domains: dict[str, np.ndarray] = {}
        self._eligible: dict[Hashable, np.ndarray] = {}
        self._ext_cap: dict[str, np.ndarray] = {}
        self._node_scores: dict[Hashable, np.ndarray] = {}
        self._domain_sets: dict[Hashable, tuple[np.ndarray, np.ndarray]] = {}
        self._any_prefer_no_schedule: bool | None = None

    # -- bookkeeping ------------------------------------------------------------------------------------

    def set_namespace(self, name: str, labels: Mapping[str, str]) -> None:
        """A namespace's labels changed: trackers that select by namespace labels are rebuilt."""
        if dict(self.namespace_labels.get(name, {})) == dict(labels):
            return
        self.namespace_labels[name] = dict(labels)
        self._trackers.clear()
        self._buckets.clear()
        self._anti.clear_matches()
        self._scored.clear_matches()

    def add(self, pod: PendingPod, row: int) -> None:
        """``pod`` is placed (or bound) on node slot ``row`` of the state."""
        self._enter(pod, row)

    def _enter(self, pod: PendingPod, row: int) -> bool:
        if pod.uid in self._entries:
            self.remove(pod.uid)
        self._holds.pop(pod.uid, None)
        entry = _Entry(
            pod.namespace,
            pod.labels,
            row,
            pod.constraints.required_anti_affinity,
            scored_terms(pod),
            # Nothing is placed on a topology-only node, so what a pod takes there is not counted.
            pod.extras if row >= 0 else NO_EXTRAS,
        )
        self._entries[pod.uid] = entry
        for pair in entry.labels.items():
            self._by_label.setdefault(pair, set()).add(pod.uid)
        if row < 0:
            self._out_pods.setdefault(~row, set()).add(pod.uid)
        return bool(self._count(entry, +1) & _HELPS_WHEN_ARRIVING)

    def remove(self, uid: str) -> bool:
        """Forget a pod; True when its leaving may let another pod in (``_HELPS_WHEN_LEAVING``)."""
        entry = self._entries.pop(uid, None)
        if entry is None:
            return False
        for pair in entry.labels.items():
            holders = self._by_label[pair]
            holders.discard(uid)
            if not holders:
                del self._by_label[pair]
        if entry.row < 0:
            self._out_pods[~entry.row].discard(uid)
        return bool(self._count(entry, -1) & _HELPS_WHEN_LEAVING)

    def nominate(self, pod: PendingPod, row: int | None) -> None:
        """Hold ``pod``'s resources on node slot ``row`` (None, an unknown node: hold nothing)."""
        if row is None:
            self._holds.pop(pod.uid, None)
            return
        self._holds[pod.uid] = Nomination(row, pod.priority, pod.cpu_milli, pod.memory_bytes, pod.extras)

    def drop_nomination(self, uid: str) -> bool:
        return self._holds.pop(uid, None) is not None

    def nomination(self, uid: str) -> Nomination | None:
        """The room held for ``uid`` (placing the pod drops it), for an undo to ``renominate``."""
        return self._holds.get(uid)

    def renominate(self, uid: str, hold: Nomination) -> None:
        self._holds[uid] = hold

    def held_uids(self) -> list[str]:
        """Every uid room is held for (nominees, and holds of no pod)."""
        return list(self._holds)

    def drop_row(self, row: int) -> None:
        """A node slot went away: holds on it go too (placed pods were released one by one)."""
        for uid in [uid for uid, h in self._holds.items() if h.row == row]:
            del self._holds[uid]

    # -- topology-only nodes ----------------------------------------------------------------------------

    def is_outside(self, name: str) -> bool:
        return name in self._out_index

    def set_outside_node(self, spec: NodeSpec) -> None:
        """Add or replace a topology-only node (only its labels and taints are read)."""
        slot = self._out_index.get(spec.name)
        if slot is None:
            if self._out_free:
                slot = self._out_free.pop()
            else:
                slot = len(self._out_specs)
                self._out_specs.append(None)
            self._out_index[spec.name] = slot
            if slot >= self._out_capacity:
                self._out_capacity = max(_OUTSIDE_MIN_CAPACITY, 2 * self._out_capacity)
        self._out_specs[slot] = spec
        self._out_epoch += 1

    def remove_outside_node(self, name: str) -> list[str]:
        """Drop a topology-only node and the pods counted on it; returns those pods' uids."""
        slot = self._out_index.pop(name, None)
        if slot is None:
            return []
        uids = sorted(self._out_pods.get(slot, ()))
        for uid in uids:
            self.remove(uid)
        self._out_pods.pop(slot, None)
        self._out_specs[slot] = None
        self._out_free.append(slot)
        self._out_epoch += 1
        return uids

    def add_outside(self, pod: PendingPod, node: str) -> bool:
        """Count ``pod``, bound to topology-only node ``node``, for other pods' rules; True when its
        arrival may let a waiting pod in (``_HELPS_WHEN_ARRIVING``)."""
        slot = self._out_index.get(node)
        if slot is None:
            raise ValueError(f"pod {pod.key}: node {node} is not a known topology-only node")
        return self._enter(pod, ~slot)

    def remove_outside(self, uid: str) -> bool | None:
        """Stop counting a pod on a topology-only node: None when it was not counted, else whether its
        leaving may let another pod in (``remove``)."""
        entry = self._entries.get(uid)
        if entry is None or entry.row >= 0:
            return None
        return self.remove(uid)

    def _slot(self, row: int) -> int:
        return row if row >= 0 else self.state.rows + ~row

    @property
    def _span(self) -> int:
        return self.state.rows + self._out_capacity

    def _all_specs(self) -> Iterator[tuple[int, NodeSpec]]:
        """(slot, spec) of every node: the state's, then the topology-only ones."""
        for n, spec in enumerate(self.state.nodes):
            if spec is not None:
                yield n, spec
        base = self.state.rows
        for i, spec in enumerate(self._out_specs):
            if spec is not None:
                yield base + i, spec

    def _sync_layout(self) -> None:
        """Move every per-slot count to [state rows | topology-only capacity] when either grew."""
        rows, capacity = self.state.rows, self._out_capacity
        if self._layout == (rows, capacity):
            return
        old_rows, old_capacity = self._layout

        def moved(arr: np.ndarray) -> np.ndarray:
            out = np.zeros(rows + capacity, dtype=arr.dtype)
            out[:old_rows] = arr[:old_rows]
            out[rows : rows + old_capacity] = arr[old_rows : old_rows + old_capacity]
            return out

        for store in (self._trackers, self._anti.holders, self._scored.holders):
            for key, arr in list(store.items()):
                store[key] = moved(arr)
        self._layout = (rows, capacity)

    def _count(self, entry: _Entry, delta: int) -> set[str]:
        """Add ``delta`` of ``entry`` to every count; returns what counted it: the kinds of the trackers
        that did, and "anti" when it carries a required anti-affinity term."""
        self._sync_layout()
        row = entry.row
        slot = self._slot(row)
        span = self._span
        candidates = set(self._buckets.get(None, ()))
        for pair in entry.labels.items():
            candidates.update(self._buckets.get(pair, ()))
        kinds = {"anti"} if entry.anti else set()
        for key in candidates:
            if self._tracker_matches(key, entry.namespace, entry.labels):
                self._trackers[key][slot] += delta
                kinds.add(key[0])  # type: ignore[index]
        for term in entry.anti:
            self._anti.count(term, slot, delta, span)
        for scored in entry.scored:
            self._scored.count(scored, slot, delta, span)
        extras = entry.extras
        if not extras:
            return kinds
        for port in extras.host_ports:
            by_row = self._ports.setdefault((port.protocol, port.port), {})
            ips = by_row.setdefault(row, Counter())
            ips[port.ip] += delta
            if ips[port.ip] <= 0:
                del ips[port.ip]
                if not ips:
                    del by_row[row]
        for name, amount in extras.extended:
            used = self._ext_used.get(name)
            used = self._ext_used[name] = self._grown(
                np.zeros(self.state.rows, dtype=np.int64) if used is None else used
            )
            used[row] += delta * amount
        if extras.ephemeral_bytes:
            self._eph_used = self._grown(self._eph_used)
            self._eph_used[row] += delta * extras.ephemeral_bytes
        return kinds

    def _grown(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` (indexed by the state's rows only) grown to the state's rows."""
        rows = self.state.rows
        if arr.size >= rows:
            return arr
        out = np.zeros(rows, dtype=arr.dtype)
        out[: arr.size] = arr
        return out

    # -- trackers ---------------------------------------------------------------------------------------

    def _tracker_matches(self, key: Hashable, namespace: str, labels: Mapping[str, str]) -> bool:
        kind, what = key  # type: ignore[misc]
        if kind == "all":
            return all(t.matches(namespace, labels, self.namespace_labels) for t in what)
        if kind == "term":
            return what.matches(namespace, labels, self.namespace_labels)
        space, selector = what
        return namespace == space and selects(selector, labels)

    @staticmethod
    def _bucket(key: Hashable) -> tuple[str, str] | None:
        kind, what = key  # type: ignore[misc]
        selector = what[0].selector if kind == "all" else what.selector if kind == "term" else what[1]
        if selector is None or not selector.match_labels:
            return None
        return selector.match_labels[0]

    def _tracker(self, key: Hashable) -> np.ndarray:
        """Counts per slot, over the whole layout (the state's rows, then the topology-only slots)."""
        self._sync_layout()
        counts = self._trackers.get(key)
        if counts is None:
            counts = np.zeros(self._span, dtype=np.int64)
            bucket = self._bucket(key)
            entries = self._entries
            # Only pods carrying the bucket's label pair can be counted: look at those alone.
            for uid in entries if bucket is None else self._by_label.get(bucket, ()):
                entry = entries[uid]
                if self._tracker_matches(key, entry.namespace, entry.labels):
                    counts[self._slot(entry.row)] += 1
            self._trackers[key] = counts
            self._buckets.setdefault(bucket, set()).add(key)
            if len(self._trackers) > _MAX_TRACKERS:
                old, _ = self._trackers.popitem(last=False)
                self._buckets[self._bucket(old)].discard(old)
        else:
            self._trackers.move_to_end(key)
        return counts

    # -- topology ---------------------------------------------------------------------------------------

    def _sync_epoch(self) -> None:
        self._sync_layout()
        epoch = (self.state.spec_epoch, self._out_epoch, self._layout)
        if self._epoch != epoch:
            self._epoch = epoch
            self._domains.clear()
            self._eligible.clear()
            self._ext_cap.clear()
            self._node_scores.clear()
            self._domain_sets.clear()
            self._any_prefer_no_schedule = None

    def domain(self, key: str) -> np.ndarray:
        """Per slot of the layout, the id of its node's value of label ``key`` (-1: absent, or no node)."""
        found = self._domains.get(key)
        if found is None:
            found = np.full(self._span, -1, dtype=np.int64)
            values: dict[str, int] = {}
            for n, spec in self._all_specs():
                if key in spec.labels:
                    found[n] = values.setdefault(spec.labels[key], len(values))
            self._domains[key] = found
        return found

    @staticmethod
    def _per_domain(dom: np.ndarray, counts: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """For each slot, the sum of ``counts`` over the slots (within ``mask``) of its domain."""
        use = dom >= 0 if mask is None else (dom >= 0) & mask
        out = np.zeros(dom.size, dtype=np.int64)
        if not use.any():
            return out
        per = np.bincount(dom[use], weights=counts[use], minlength=int(dom.max()) + 1).astype(np.int64)
        has = dom >= 0
        out[has] = per[dom[has]]
        return out

    def _policy_eligible(self, demand: Demand, c: SpreadConstraint) -> np.ndarray:
        honour_affinity = c.node_affinity_policy is InclusionPolicy.HONOR
        honour_taints = c.node_taints_policy is InclusionPolicy.HONOR
        key = (demand.static_key, honour_affinity, honour_taints)
        found = self._eligible.get(key)
        if found is None:
            found = np.zeros(self._span, dtype=bool)
            selector, affinity, taints = NodeSelector(), NodeAffinity(), TaintToleration()
            for n, spec in self._all_specs():
                ok = True
                if honour_affinity:
                    ok = (
                        selector.check(spec, demand) is Reason.FITS
                        and affinity.check(spec, demand) is Reason.FITS
                    )
                if ok and honour_taints:
                    ok = taints.check(spec, demand) is Reason.FITS
                found[n] = ok
            self._eligible[key] = found
        return found

    # -- the overlay ------------------------------------------------------------------------------------

    def _holds_against(self, pod: PendingPod) -> list[Nomination]:
        return [h for uid, h in self._holds.items() if uid != pod.uid and h.priority >= pod.priority]

    def filter(self, pod: PendingPod, demand: Demand) -> np.ndarray | None:
        """A reason per node slot (0: no objection), or None when nothing here concerns the pod."""
        self._sync_epoch()
        c, extras = pod.constraints, pod.extras
        repelled = self._anti.selecting(pod, self.namespace_labels)
        holds = self._holds_against(pod) if self._holds else []
        hard = c.required_affinity or c.required_anti_affinity or c.hard_spread
        if not (hard or extras or repelled or holds):
            return None
        rows = self.state.rows
        reason = np.zeros(rows, dtype=np.uint8)

        def fail(mask: np.ndarray, code: Reason) -> None:
            # Masks over the whole layout: only the state's rows can take the pod.
            reason[mask[:rows] & (reason == 0)] = code

        if holds:
            self._check_holds(pod, holds, fail)
        if extras:
            self._check_extras(extras, holds, fail)
        if c.required_affinity:
            fail(~self._affinity_ok(pod, c.required_affinity), Reason.POD_AFFINITY)
        for term in c.required_anti_affinity:
            dom = self.domain(term.topology_key)
            near = self._per_domain(dom, self._tracker(("term", term)))
            fail((dom >= 0) & (near > 0), Reason.POD_ANTI_AFFINITY)
        for term in repelled:
            dom = self.domain(term.topology_key)
            near = self._per_domain(dom, self._anti.holders[term])
            fail((dom >= 0) & (near > 0), Reason.EXISTING_ANTI_AFFINITY)
        if c.hard_spread:
            self._check_spread(pod, demand, c.hard_spread, fail)
        return reason

    def _check_holds(self, pod: PendingPod, holds: list[Nomination], fail) -> None:  # type: ignore[no-untyped-def]
        st = self.state
        cpu = np.zeros(st.rows, dtype=np.int64)
        mem = np.zeros(st.rows, dtype=np.int64)
        slots = np.zeros(st.rows, dtype=np.int64)
        for h in holds:
            cpu[h.row] += h.cpu_milli
            mem[h.row] += h.memory_bytes
            slots[h.row] += 1
        fail(st.pods_free[: st.rows] - slots < 1, Reason.TOO_MANY_PODS)
        fail(st.cpu_free[: st.rows] - cpu < pod.cpu_milli, Reason.INSUFFICIENT_CPU)
        fail(st.mem_free[: st.rows] - mem < pod.memory_bytes, Reason.INSUFFICIENT_MEMORY)

    def _check_extras(self, extras: NodeExtras, holds: list[Nomination], fail) -> None:  # type: ignore[no-untyped-def]
        st = self.state
        rows = st.rows
        if extras.host_ports:
            taken = np.zeros(rows, dtype=bool)
            for want in extras.host_ports:
                for row, ips in self._ports.get((want.protocol, want.port), {}).items():
                    if any(want.conflicts(HostPort(want.port, want.protocol, ip)) for ip in ips):
                        taken[row] = True
                for h in holds:
                    if any(want.conflicts(p) for p in h.extras.host_ports):
                        taken[h.row] = True
            fail(taken, Reason.HOST_PORTS)
        for name, amount in extras.extended:
            cap = self._ext_cap.get(name)
            if cap is None:
                cap = np.zeros(rows, dtype=np.int64)
                for n, spec in enumerate(st.nodes):
                    if spec is not None:
                        cap[n] = spec.extended.get(name, 0)
                self._ext_cap[name] = cap
            used = self._ext_used.get(name)
            free = cap[:rows] - (0 if used is None else self._grown(used)[:rows])
            for h in holds:
                free[h.row] -= dict(h.extras.extended).get(name, 0)
            fail(free < amount, Reason.INSUFFICIENT_EXTENDED)
        if extras.ephemeral_bytes:
            cap = np.array(
                [0 if spec is None else spec.ephemeral_bytes for spec in st.nodes]
                + [0] * (rows - len(st.nodes)),
                dtype=np.int64,
            )[:rows]
            free = cap - self._grown(self._eph_used)[:rows]
            for h in holds:
                free[h.row] -= h.extras.ephemeral_bytes
            fail(free < extras.ephemeral_bytes, Reason.INSUFFICIENT_EPHEMERAL)

    def _affinity_ok(self, pod: PendingPod, terms: tuple[PodAffinityTerm, ...]) -> np.ndarray:
        counts = self._tracker(("all", terms))
        has_all = np.ones(self._span, dtype=bool)
        exist = np.ones(self._span, dtype=bool)
        anywhere = False
        for term in terms:
            dom = self.domain(term.topology_key)
            has_all &= dom >= 0
            near = self._per_domain(dom, counts)
            exist &= near > 0
            anywhere = anywhere or bool(counts[dom >= 0].sum() > 0)
        if not anywhere and all(t.matches(pod.namespace, pod.labels, self.namespace_labels) for t in terms):
            return has_all
        return has_all & exist

    def _spread_frame(
        self, demand: Demand, c: SpreadConstraint, keys: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(domain per slot, eligible slots, eligible domains) of one constraint: node-spec facts, so
        kept until a node spec changes. Eligible: carries every one of ``keys`` and passes the
        constraint's inclusion policies."""
        key = (demand.static_key, c.node_affinity_policy, c.node_taints_policy, c.topology_key, keys)
        found = self._domain_sets.get(key)
        dom = self.domain(c.topology_key)
        if found is None:
            eligible = self._policy_eligible(demand, c).copy()
            for k in keys:
                eligible &= self.domain(k) >= 0
            found = self._domain_sets[key] = (eligible, np.unique(dom[eligible]))
        return dom, found[0], found[1]

    def _spread_counts(
        self, pod: PendingPod, demand: Demand, c: SpreadConstraint, keys: tuple[str, ...]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(domain per slot, matching pods in the slot's domain, eligible slots, per-domain counts)."""
        dom, eligible, _ = self._spread_frame(demand, c, keys)
        counts = self._tracker(("spread", (pod.namespace, c.selector)))
        size = int(dom.max()) + 1 if dom.size else 0
        use = eligible[: dom.size]
        per = np.bincount(dom[use], weights=counts[use], minlength=size).astype(np.int64)
        near = np.zeros(dom.size, dtype=np.int64)
        has = dom >= 0
        near[has] = per[dom[has]]
        return dom, near, eligible, per

    def _check_spread(self, pod: PendingPod, demand: Demand, constraints, fail) -> None:  # type: ignore[no-untyped-def]
        keys = tuple(c.topology_key for c in constraints)
        for c in constraints:
            dom, near, _, per = self._spread_counts(pod, demand, c, keys)
            fail(dom < 0, Reason.SPREAD_LABEL_MISSING)
            domains = self._spread_frame(demand, c, keys)[2]
            least = 0 if domains.size < c.min_domains else int(per[domains].min())
            mine = 1 if selects(c.selector, pod.labels) else 0
            fail((dom >= 0) & (near + mine - least > c.max_skew), Reason.SPREAD)

    # -- preferences ------------------------------------------------------------------------------------

    def soft(self, pod: PendingPod, demand: Demand, candidates: np.ndarray) -> np.ndarray | None:
        """Preference level (0..SOFT_LEVELS) per node slot of the state, normalised over ``candidates``;
        None when neither the pod nor a placed pod's terms state a preference about it."""
        c = pod.constraints
        self._sync_epoch()
        back = self._scored.selecting(pod, self.namespace_labels)
        prefer = c.preferred_affinity or c.preferred_anti_affinity or back
        spread = c.soft_spread
        untolerated = self._prefer_no_schedule(demand)
        if not (prefer or spread or c.preferred_node or untolerated is not None) or not candidates.any():
            return None
        rows = self.state.rows
        total = np.zeros(rows, dtype=np.float64)
        parts = 0
        if c.preferred_node:
            raw = self._preferred_node(c.preferred_node)[:rows]
            hi = raw[candidates].max()
            if hi > 0:
                total += 2 * 100 * raw / hi
            parts += 2
        if untolerated is not None:
            raw = untolerated[:rows]
            hi = raw[candidates].max()
            if hi > 0:
                total += 3 * (100 - 100 * raw / hi)
            else:
                total += 3 * 100
            parts += 3
        if prefer:
            raw = np.zeros(rows, dtype=np.float64)
            for sign, weighted in ((1, c.preferred_affinity), (-1, c.preferred_anti_affinity)):
                for w in weighted:
                    dom = self.domain(w.term.topology_key)
                    raw += sign * w.weight * self._per_domain(dom, self._tracker(("term", w.term)))[:rows]
            for scored in back:  # placed pods' terms that select this pod, on their domains' nodes
                term, weight = scored
                dom = self.domain(term.topology_key)
                raw += weight * self._per_domain(dom, self._scored.holders[scored])[:rows]
            lo, hi = raw[candidates].min(), raw[candidates].max()
            if hi > lo:
                total += 2 * 100 * (raw - lo) / (hi - lo)
            parts += 2
        if spread:
            keys = tuple(sc.topology_key for sc in spread)
            keys_present = np.ones(rows, dtype=bool)
            for k in keys:
                keys_present &= self.domain(k)[:rows] >= 0
            raw = np.zeros(rows, dtype=np.float64)
            for sc in spread:
                _, near, _, _ = self._spread_counts(pod, demand, sc, keys)
                weight = math.log(self._spread_frame(demand, sc, keys)[2].size + 2)
                raw += near[:rows] * weight + (sc.max_skew - 1)
            scored = candidates & keys_present
            if scored.any():
                lo, hi = raw[scored].min(), raw[scored].max()
                level = np.full(rows, 100.0) if hi == 0 else 100 * (hi + lo - raw) / hi
                total += 2 * np.where(scored, level, 0)
            parts += 2
        return np.floor(total * SOFT_LEVELS / (100 * parts) + 1e-9).astype(np.int64)

    def _preferred_node(self, terms: tuple[tuple[int, Any], ...]) -> np.ndarray:
        """Per node slot, the sum of the weights of the preferred node-affinity terms it matches."""
        key = ("node", terms)
        found = self._node_scores.get(key)
        if found is None:
            found = np.zeros(self.state.rows, dtype=np.float64)
            for n, spec in enumerate(self.state.nodes):
                if spec is not None:
                    found[n] = sum(w for w, term in terms if term.matches(spec.labels))
            self._node_scores[key] = found
        return found

    def _prefer_no_schedule(self, demand: Demand) -> np.ndarray | None:
        """Per node slot, PreferNoSchedule taints the pod does not tolerate; None when no node has one."""
        if self._any_prefer_no_schedule is None:
            self._any_prefer_no_schedule = any(
                t.effect is TaintEffect.PREFER_NO_SCHEDULE
                for spec in self.state.nodes
                if spec is not None
                for t in spec.taints
            )
        if not self._any_prefer_no_schedule:
            return None
        _, _, tolerations = demand.static_key  # type: ignore[misc]
        key = ("taints", tolerations)
        if key not in self._node_scores:
            found = np.zeros(self.state.rows, dtype=np.float64)
            for n, spec in enumerate(self.state.nodes):
                if spec is None:
                    continue
                found[n] = sum(
                    1
                    for t in spec.taints
                    if t.effect is TaintEffect.PREFER_NO_SCHEDULE
                    and not any(tol.tolerates(t) for tol in tolerations)
                )
            self._node_scores[key] = found
        found = self._node_scores[key]
        return found if found.any() else None
