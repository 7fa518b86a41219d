"""Dynamic MIG layouts, the scheduler's half (docs/mig.md, "Layout changes"; scheduler setting
``mig.dynamic``).

A post-filter. When a pod fits nowhere and the layout planner (``gpufrac.placement.mig_layouts``) would
serve it by re-partitioning an idle GPU (a MIG pod: slices of its profile laid out on a GPU of a
MIG-capable model on a node the pod may use; a fraction pod: an idle GPU in mode mig or whole given back
to fractions), the pod waits for that change instead of going to preemption. The pods of one cycle are
planned together once the cycle is over (so that several small slices share one GPU; with ``mig.fill``
the rest of each GPU gets free slices in the mix of the MIG pods planned lately): every GPU chosen
is fenced in the engine at once (nothing is booked on it while its change is pending, and the planner
never picks a GPU with a booking or a pending change), its node's ``gpufrac.io/gpu-layout`` is patched
with the next generation and every GPU of that node whose change is pending (only those), and each
waiting pod says for which change it waits ("waiting for node n1's GPU GPU-1 to be re-partitioned to
3g.40gb@0").

``observe`` reads each node update: a change is done when the node publishes the GPU in the wanted mode
with the wanted slices (``gpufrac.io/gpus``); it failed when the node agent's
``gpufrac.io/gpu-layout-status`` reports ``Refused``, ``Failed`` or ``NeedsReset`` for it at that
generation or later, or when no answer came within ``change_timeout_s`` (an agent that does not apply
layouts). Either way the GPU is unfenced and the waiting pods are tried again (the node's change wakes
them); a GPU whose change failed is not planned again for ``retry_refused_s``. A layout annotation whose
generation the status has not reached, found on a node at start, is adopted: its idle GPUs stay fenced
until it is answered, so a restarted scheduler does not book a GPU the agent is re-partitioning.

The writes are the leader's only; every replica observes, so a standby knows the pending changes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, KubeError
from gpufrac.kube.patch import set_annotations
from gpufrac.mig.geometry import Slice, smallest_fitting
from gpufrac.mig.profiles import MIG_MODELS, mig_model
from gpufrac.placement.decision import Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.mig_layouts import (
    FractionWait,
    IdleGpu,
    LayoutChange,
    MigWait,
    RecentMigAsks,
    plan_layouts,
)
from gpufrac.placement.model import GpuDevice, GpuMode, PendingPod
from gpufrac.placement.state import MIG, WHOLE_IDLE
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.config import MigConfig
from gpufrac.scheduler.cycle import CycleItem, PostFilterResult

log = logging.getLogger(__name__)

_FAILED_STATES = ("Refused", "Failed", "NeedsReset")
_WRITE_ATTEMPTS = 3


@dataclass(slots=True)
class PendingChange:
    """A layout change asked for (or about to be): the GPU, what it becomes, the pods it is for, the
    generation it was written at (None until written) and when it was planned (monotonic)."""

    node: str
    uuid: str
    mode: GpuMode
    slices: tuple[Slice, ...]
    serves: tuple[str, ...]
    since: float
    generation: int | None = None

    def describe(self) -> str:
        if self.mode is GpuMode.MIG:
            return ", ".join(str(s) for s in self.slices)
        return self.mode.value

    def wanted(self) -> dict[str, Any]:
        """This GPU's entry of ``gpufrac.io/gpu-layout``."""
        if self.mode is GpuMode.MIG:
            return {"mode": "mig", "slices": [str(s) for s in self.slices]}
        return {"mode": self.mode.value}

    def done_on(self, gpu: GpuDevice | None) -> bool:
        """Whether the node publishes the GPU as this change wants it."""
        if gpu is None or gpu.mode is not self.mode:
            return False
        return self.mode is not GpuMode.MIG or sorted(Slice(s.profile, s.start) for s in gpu.mig) == sorted(
            self.slices
        )


def waiting_message(change: PendingChange) -> str:
    return f"waiting for node {change.node}'s GPU {change.uuid} to be re-partitioned to {change.describe()}"


def _annotation(node: Node, key: str) -> dict[str, Any]:
    raw = (node.metadata.annotations or {}).get(key) if node.metadata else None
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        log.warning("node %s: %s is not JSON; read as empty", node.metadata.name, key)
        return {}
    return found if isinstance(found, dict) else {}


def _generation(value: dict[str, Any]) -> int:
    try:
        return int(value.get("generation", 0))
    except (TypeError, ValueError):
        return 0


class MigLayouts:
    """See the module docstring: ``post_filter`` (a ``PostFilter``) and ``observe`` (each node update)."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        cache: BookingCache,
        config: MigConfig,
        node_of: Callable[[str], Node | None],
        report: Callable[[Any, str], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        changed: Callable[[], None],
        is_leader: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._cache = cache
        self.config = config
        self._node_of = node_of
        self._report = report
        self._spawn = spawn
        self._changed = changed
        self._is_leader = is_leader
        self._clock = clock
        #: By GPU uuid: the changes planned or written and not yet done or failed.
        self.pending: dict[str, PendingChange] = {}
        #: By GPU uuid: until when a GPU whose change failed is left alone, and why it failed.
        self.refused: dict[str, tuple[float, str]] = {}
        self._batch: dict[str, tuple[CycleItem, MigWait | FractionWait, str]] = {}
        #: The MIG pods planned lately: the mix the rest of a GPU is filled with (``mig.fill``).
        self.recent = RecentMigAsks()
        self._flush_due = False

    @classmethod
    def of_service(cls, service: Any, client: AsyncClient) -> MigLayouts:
        """The one a ``SchedulerService`` runs, wired to its books, node informer, reporter and queue."""
        return cls(
            client=client,
            cache=service.cache,
            config=service.config.mig,
            node_of=lambda name: service.node_watch.nodes.store.get(name),
            report=lambda pod, message: service.report.unschedulable(pod, message),
            spawn=service._chores.spawn,
            changed=service.queue.cluster_changed,
            is_leader=service.is_leader,
        )

    @property
    def _engine(self) -> Engine:
        engine = self._cache.engine
        assert isinstance(engine, Engine)
        return engine

    # -- the post-filter ----------------------------------------------------------------------------------

    def post_filter(
        self, item: CycleItem, decision: Unschedulable, cache: BookingCache
    ) -> PostFilterResult | None:
        if not self.config.dynamic or not isinstance(cache.engine, Engine):
            return None
        self._expire()
        for change in self.pending.values():
            if item.uid in change.serves:
                return PostFilterResult(report=waiting_message(change))
        if decision.detail:  # a queue's limit or the pod's policy: no layout would let it in
            return None
        wait = self._wait_of(item.pending)
        if wait is None:
            return None
        waits = [w for _, w, _ in self._batch.values()] + [wait]
        if not any(item.uid in c.serves for c in self._plan(waits, fill=False)):  # the fill serves no one
            return None
        self._batch[item.uid] = (item, wait, decision.message)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)
        return PostFilterResult()  # the flush, after the cycle, says what it waits for

    def _wait_of(self, pod: PendingPod) -> MigWait | FractionWait | None:
        """What the pod would wait for: MIG slices (per model), or fractions no GPU in mode fractions
        holds (only when some GPU is in another mode); None when layouts cannot help it."""
        containers = pod.gpu.containers
        if not containers:
            return None
        state = self._engine.state
        mig = any(c.mig is not None for c in containers)
        if not mig and not state.partitioned:
            # Asked first: every pod that fits nowhere comes here, and the names below are every node's.
            return None
        nodes = frozenset(
            spec.name for n in self._engine.static_fits(pod).tolist() if (spec := state.nodes[n])
        )
        if mig:
            profiles: dict[str, tuple[str, ...]] = {}
            for name, model in MIG_MODELS.items():
                wanted: list[str] = []
                for c in containers:
                    if c.mig is None:
                        continue
                    found = (
                        model.profile(c.mig.profile)
                        if c.mig.profile is not None
                        else smallest_fitting(model, c.mig.min_mib or 0)
                    )
                    if found is None:
                        break
                    wanted.extend([found.name] * c.mig.count)
                else:
                    profiles[name] = tuple(wanted)
            return MigWait(pod.uid, profiles, nodes) if profiles else None

        def mib(gpu_mib: int) -> int:
            return max(gpu_mib if c.exclusive else c.request_mib(gpu_mib) for c in containers)

        return FractionWait(pod.uid, mib, max(c.device_count for c in containers), nodes)

    def _plan(self, waits: list[MigWait | FractionWait], *, fill: bool) -> list[LayoutChange]:
        migs = [w for w in waits if isinstance(w, MigWait)]
        fractions = [w for w in waits if isinstance(w, FractionWait)]
        idle = self._idle(migs, fractions)
        return plan_layouts(migs, fractions, idle, fill_rest=fill, recent=self.recent.waits())

    def _idle(self, migs: list[MigWait], fractions: list[FractionWait]) -> list[IdleGpu]:
        """Idle GPUs on nodes some wait may use: any mode for MIG waits (of MIG-capable models), not in
        mode fractions for fraction waits; none fenced, none whose change failed lately."""
        engine, now = self._engine, self._clock()
        st = engine.state
        if migs:
            names = list(self._cache.nodes)
        else:  # fractions only: the nodes with a GPU in another mode (one array pass, not every GPU)
            rows = np.flatnonzero(((st.base == MIG) | (st.base == WHOLE_IDLE)).any(axis=1) & st.present)
            names = [spec.name for n in rows.tolist() if (spec := st.nodes[n]) is not None]
        out = []
        for name in names:
            spec = self._cache.nodes.get(name)
            if spec is None:
                continue
            want_mig = any(w.may_use(name) for w in migs)
            if not (want_mig or any(w.may_use(name) for w in fractions)) or not spec.ready:
                continue
            by_uuid = {g.uuid: g for g in spec.gpus}
            for uuid, model, mode in engine.idle_gpus(name):
                refused = self.refused.get(uuid)
                if refused is not None and refused[0] > now:
                    continue
                if mode is GpuMode.FRACTIONS and (not want_mig or mig_model(model) is None):
                    continue
                g = by_uuid[uuid]
                slices = tuple(Slice(s.profile, s.start) for s in g.mig)
                out.append(IdleGpu(name, uuid, g.index, model, g.memory_mib, mode, slices))
        return out

    def _flush(self) -> None:
        """After the cycle: plan its waiting pods together, fence and ask, and tell each pod."""
        self._flush_due = False
        batch, self._batch = self._batch, {}
        if not batch:
            return
        waits = [w for _, w, _ in batch.values()]
        try:
            changes = self._plan(waits, fill=self.config.fill)
        except Exception:
            log.exception("planning MIG layouts failed")
            changes = []
        self.recent.add(w for w in waits if isinstance(w, MigWait))
        nodes: set[str] = set()
        now = self._clock()
        for change in changes:
            try:
                self._engine.fence(change.uuid)
            except (KeyError, ValueError) as error:  # booked since the plan: not this time
                log.info("not re-partitioning GPU %s of %s: %s", change.uuid, change.node, error)
                continue
            self.pending[change.uuid] = PendingChange(
                change.node, change.uuid, change.mode, change.slices, change.serves, now
            )
            nodes.add(change.node)
        for node in sorted(nodes):
            self._spawn(self._write(node))
        for uid, (item, _, message) in batch.items():
            change = next((c for c in self.pending.values() if uid in c.serves), None)
            self._report(item.pod, message if change is None else waiting_message(change))

    async def _write(self, node: str) -> None:
        """Patch the node's layout annotation: the next generation, with each of its pending GPUs."""
        for attempt in range(_WRITE_ATTEMPTS):
            mine = [c for c in self.pending.values() if c.node == node]
            if not mine:
                return
            if not self._is_leader():
                return
            current = self._node_of(node)
            if attempt or current is None:
                try:
                    current = await self._client.get(Node, node)
                except Exception as error:
                    self._fail(mine, f"the node could not be read: {error}")
                    return
            generation = _generation(_annotation(current, keys.NODE_GPU_LAYOUT_ANNOTATION)) + 1
            body = {"generation": generation, "gpus": {c.uuid: c.wanted() for c in mine}}
            try:
                await set_annotations(
                    self._client,
                    Node,
                    name=node,
                    annotations={keys.NODE_GPU_LAYOUT_ANNOTATION: json.dumps(body, sort_keys=True)},
                    resource_version=current.metadata.resourceVersion,
                )
            except Conflict:
                continue
            except (KubeError, OSError) as error:
                self._fail(mine, f"writing {keys.NODE_GPU_LAYOUT_ANNOTATION} failed: {error}")
                return
            for c in mine:
                c.generation = generation
            log.info(
                "asked node %s for GPU layout generation %d: %s",
                node,
                generation,
                "; ".join(f"{c.uuid} -> {c.describe()}" for c in mine),
            )
            return
        self._fail([c for c in self.pending.values() if c.node == node], "the node kept changing")

    # -- what the node answers ----------------------------------------------------------------------------

    def observe(self, node: Node) -> None:
        """A managed node changed (after the booking cache took its new spec): settle its changes."""
        name = node.metadata.name
        spec = self._cache.nodes.get(name)
        if spec is None:
            return
        gpus = {g.uuid: g for g in spec.gpus}
        status = _annotation(node, keys.NODE_GPU_LAYOUT_STATUS_ANNOTATION)
        answered = _generation(status)
        states = status.get("gpus") if isinstance(status.get("gpus"), dict) else {}
        settled = False
        for change in [c for c in self.pending.values() if c.node == name]:
            if change.done_on(gpus.get(change.uuid)):
                self._settle(change)
                settled = True
                continue
            entry = states.get(change.uuid) if change.generation is not None else None
            if (
                isinstance(entry, dict)
                and answered >= (change.generation or 0)
                and entry.get("state") in _FAILED_STATES
            ):
                self._fail([change], f"{entry.get('state')}: {entry.get('message', '')}".rstrip(": "))
                settled = True
        self._adopt(node, gpus, answered, states)
        if settled:
            self._changed()

    def _adopt(self, node: Node, gpus: dict[str, GpuDevice], answered: int, states: dict[str, Any]) -> None:
        """Fence the idle GPUs of a layout the agent has not answered yet (found at start, or written by
        another replica)."""
        layout = _annotation(node, keys.NODE_GPU_LAYOUT_ANNOTATION)
        generation = _generation(layout)
        wanted = layout.get("gpus") if isinstance(layout.get("gpus"), dict) else {}
        if not wanted or answered >= generation:
            return
        for uuid, entry in wanted.items():
            if uuid in self.pending or uuid not in gpus or not isinstance(entry, dict):
                continue
            try:
                mode = GpuMode(entry.get("mode"))
                slices = tuple(Slice.parse(s) for s in entry.get("slices") or ())
            except ValueError:
                continue
            change = PendingChange(node.metadata.name, uuid, mode, slices, (), self._clock(), generation)
            if change.done_on(gpus[uuid]) or not self._engine.gpu_idle(uuid):
                continue
            self._engine.fence(uuid)
            self.pending[uuid] = change

    def _settle(self, change: PendingChange) -> None:
        self.pending.pop(change.uuid, None)
        self._engine.unfence(change.uuid)
        log.info("node %s re-partitioned GPU %s to %s", change.node, change.uuid, change.describe())

    def _fail(self, changes: list[PendingChange], why: str) -> None:
        until = self._clock() + self.config.retry_refused_s
        for change in changes:
            self.pending.pop(change.uuid, None)
            self._engine.unfence(change.uuid)
            self.refused[change.uuid] = (until, why)
            log.warning(
                "node %s did not re-partition GPU %s to %s: %s",
                change.node,
                change.uuid,
                change.describe(),
                why,
            )
        if changes:
            self._changed()

    def _expire(self) -> None:
        """Give up on changes no agent answered in time (time passing is no API event: checked here)."""
        now = self._clock()
        late = [c for c in self.pending.values() if now - c.since > self.config.change_timeout_s]
        if late:
            self._fail(late, f"no answer from the node agent in {self.config.change_timeout_s:.0f}s")


__all__ = ["MigLayouts", "PendingChange", "waiting_message"]
