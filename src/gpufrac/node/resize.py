"""Resize a running fraction on the node: the pod's binding changed, the container's limits follow live.

The scheduler grants a resize by patching a BOUND pod's binder-written amounts in one patch
(``gpu-memory.request``/``.limit`` in whole MiB and, for sm-sharing, ``gpu-compute.portion``); devices,
mode and device count never change. ``read_binding`` stays the node's only reader of a bound pod, so the
node's whole job is: notice that a running container's binding, as ``read_binding`` reads the pod now,
differs from the ``AllocationRecord`` the node enforces, and apply the new amounts live.

- **Noticing.** ``PodResizeWatch`` keeps an informer on the pods of this node (field selector
  ``spec.nodeName=<node>``, as the kubelet watches its own); a relist after a dropped watch delivers every
  pod again, so a resize missed meanwhile is still seen. Each add/update queues the pod; one worker
  compares each of its fractional containers' records with the binding (``resize_of``).
- **Applying** (``ResizeTracker.apply``): the record takes the pod's amounts first (the store: the
  node's intent, what the metrics' request/limit series and every later audit read), then the enforcer
  sets soft = request, hard = limit on the container's cgroup for each of its GPUs and reads them back
  (``LimitEnforcer.resize``): anything but an exact read-back is not in force, as at start (the
  ``GpuMemoryEnforced`` condition says False and the audit sets it again). For sm-sharing, the MPS
  namespace takes the new active-thread percentage and pinned-memory limit where MPS lets it
  (``MpsContainerHooks.on_resize``): MPS fixes both for a client when it connects, and refuses
  ``namespace set`` while one is attached, so the processes running now keep their ceiling and
  pinned-memory cap; later clients (after all of the container's detach, or a daemon restart) get the
  new ones. The cgroup's hard limit, which the driver changes live, is what bounds the container's memory
  either way; the Event says what MPS kept.
- **The shrink rule.** A hard limit is never lowered below what the container uses now (``currentUsed``
  on that GPU). The new soft limit (request) is applied at once -- safe because the books hold requests
  and limits are never reserved, so a container between its request and its limit is the ordinary burst
  case -- the old hard limit is kept, and every audit sets it again until the use falls below the new
  limit (``enforce.apply_guarded``). Meanwhile the pod's ``gpufrac.io/GpuResizeInProgress`` condition is
  True with reason ``WaitingForUsage``, naming the GPU, the MiB in use and the new limit. After
  ``resize_shrink_timeout`` the node gives up waiting in words: reason ``LimitBelowUsage`` and a Warning
  Event; the old hard limit stays until the use falls (the audit keeps trying) or the pod is resized again.
- **Done.** When the new limits are read back in force the condition is removed and a Normal Event
  ``GpuResizeApplied`` says old -> new. While the driver has not read the new amounts back (it refused;
  the audit retries) the condition is True with reason ``Applying``.
- **Crash safety.** The pod is the source: an agent restarted at any step rebuilds every record from the
  pod at the runtime's Synchronize and adopts the running containers under the same shrink rule
  (``LimitEnforcer.adopt``), so the cgroup, the record and the pod end up saying the same thing (or the
  old hard limit is held back, with the condition saying why); a held-back limit found at adoption is
  tracked from then on (its timeout starts with the new agent).

Out of scope: whole-GPU containers (nothing to resize) and DRA claim containers (their amounts are the
claim's allocation, delivered through its CDI spec; a claim is not resized in place).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.errors import ContractError
from gpufrac.contract.render import BoundContainer, read_binding
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.events import NORMAL, WARNING
from gpufrac.kube.informer import Informer, object_key
from gpufrac.kube.patch import remove_pod_condition, set_pod_condition
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.node.enforcement_audit import EventSink
from gpufrac.node.mapping import AllocationRecord, MappingStore
from gpufrac.node.memlimit.condition import PodCondition
from gpufrac.node.memlimit.driver import MIB
from gpufrac.node.memlimit.enforcer import Booked, LimitEnforcer, pod_ref

log = logging.getLogger(__name__)

#: The pod condition the node agent keeps while a resize is not fully in force; removed once it is.
RESIZE_CONDITION = "gpufrac.io/GpuResizeInProgress"
REASON_APPLYING = "Applying"
REASON_WAITING_FOR_USAGE = "WaitingForUsage"
REASON_LIMIT_BELOW_USAGE = "LimitBelowUsage"
#: Events on the pod: the new limits are in force (Normal); the node gave up waiting (Warning).
EVENT_APPLIED = "GpuResizeApplied"
EVENT_LIMIT_BELOW_USAGE = "GpuResizeLimitBelowUsage"
EVENT_NOT_RESIZED = "GpuResizeRefused"


class NamespaceResizer(Protocol):
    """The MPS side of a resize (``MpsContainerHooks.on_resize``): None when the namespace holds the new
    settings, else why not."""

    async def on_resize(self, bound: BoundContainer, *, container_id: str) -> str | None: ...


def resize_of(record: AllocationRecord, bound: BoundContainer) -> AllocationRecord | str | None:
    """``record`` with the amounts ``bound`` holds when they differ; None when they are the same; a
    sentence when the binding changed what a resize never changes (devices, mode, whole GPU)."""
    if bound.exclusive or record.exclusive or record.claims:
        return None
    if tuple(bound.devices) != tuple(record.devices) or bound.mode.value != record.mode:
        return (
            f"the binding of container {record.container_name} now says devices {','.join(bound.devices)} "
            f"({bound.mode.value}), the container runs on {','.join(record.devices)} ({record.mode}): "
            "devices and mode never change on a running container; only its amounts are resized"
        )
    assert bound.request_mib is not None and bound.limit_mib is not None  # read_binding: fractional
    wanted = (bound.request_mib, bound.limit_mib, bound.compute_portion)
    if wanted == (record.request_mib, record.limit_mib, record.portion):
        return None
    return replace(
        record, request_mib=bound.request_mib, limit_mib=bound.limit_mib, portion=bound.compute_portion
    )


def amounts(record: AllocationRecord) -> str:
    portion = f", compute {record.portion:g}" if record.portion is not None else ""
    return f"request {record.request_mib} MiB, limit {max(record.limit_mib, record.request_mib)} MiB{portion}"


@dataclass(slots=True)
class Resize:
    """One container's resize the node has not finished: ``old`` is None when it was found held back at
    adoption (an agent restarted in the middle of it)."""

    old: AllocationRecord | None
    new: AllocationRecord
    since: float
    gave_up: bool = False
    mps: str | None = None  # why the MPS namespace kept its settings (None: it holds the new ones, or none)


def resize_condition(resizes: Sequence[Resize], booked: Mapping[str, Booked]) -> PodCondition | None:
    """The ``GpuResizeInProgress`` condition of one pod's unfinished resizes (pure); None when every one is
    in force. Reason, worst first: ``Applying`` (not read back), ``LimitBelowUsage`` (waited past the
    timeout), ``WaitingForUsage``."""
    applying, waiting, below = [], [], []
    for resize in sorted(resizes, key=lambda r: r.new.container_name):
        name = resize.new.container_name
        entry = booked.get(resize.new.container_id)
        if entry is None:
            continue
        if not entry.in_force or entry.record != resize.new:
            applying.append(f"{name}: {amounts(resize.new)} not in force yet: {entry.problem or 'not set'}")
        elif entry.held_back:
            said = "; ".join(
                f"{name}: {h.gpu} uses {h.used // MIB} MiB, above the new limit {h.wanted // MIB} MiB; "
                f"the hard limit stays {h.kept // MIB} MiB until the use falls below it"
                for h in entry.held_back
            )
            (below if resize.gave_up else waiting).append(said)
    if applying:
        return PodCondition("True", REASON_APPLYING, "; ".join(applying + below + waiting))
    if below:
        return PodCondition("True", REASON_LIMIT_BELOW_USAGE, "; ".join(below + waiting))
    if waiting:
        return PodCondition("True", REASON_WAITING_FOR_USAGE, "; ".join(waiting))
    return None


class ResizeTracker:
    """Applies resizes through the enforcer and follows them until they are in force (no API I/O: the
    watch below reads pods and writes what this decides)."""

    def __init__(
        self,
        *,
        store: MappingStore,
        limits: LimitEnforcer,
        events: EventSink | None = None,
        mps: NamespaceResizer | None = None,
        shrink_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._limits = limits
        self._events = events
        self._mps = mps
        self._timeout_s = shrink_timeout_s
        self._clock = clock
        self._resizes: dict[str, Resize] = {}  # by container id
        self._refused: dict[str, str] = {}  # container id -> what was said (once per binding)
        self.applied = 0

    def resizes(self, pod_uid: str) -> list[Resize]:
        return [r for r in self._resizes.values() if r.new.pod_uid == pod_uid]

    def condition(self, pod_uid: str) -> PodCondition | None:
        booked = {b.record.container_id: b for b in self._limits.booked()}
        self._take_over(booked)
        return resize_condition(self.resizes(pod_uid), booked)

    def _take_over(self, booked: Mapping[str, Booked]) -> None:
        """Follow held-back limits this tracker did not start: found at adoption after an agent restart in
        the middle of a shrink (their timeout starts now)."""
        now = self._clock()
        for cid, entry in booked.items():
            if entry.held_back and cid not in self._resizes:
                self._resizes[cid] = Resize(old=None, new=entry.record, since=now)

    async def observe(self, *, pod_uid: str, annotations: Mapping[str, str]) -> int:
        """Compare the pod's binding with the records of its fractional containers here and apply what
        changed; returns how many containers were resized."""
        records = [
            r for r in self._store.allocations() if r.pod_uid == pod_uid and not r.exclusive and not r.claims
        ]
        if not records:
            return 0
        try:
            bound = {b.container: b for b in read_binding(annotations)}
        except ContractError as exc:  # the scheduler never writes such a binding; the audit reports it
            log.warning(
                "resize: pod %s/%s: binding unreadable: %s",
                records[0].pod_namespace,
                records[0].pod_name,
                exc,
            )
            return 0
        done = 0
        for record in records:
            placed = bound.get(record.container_name)
            if placed is None:
                continue
            change = resize_of(record, placed)
            if isinstance(change, str):
                if self._refused.get(record.container_id) != change:
                    self._refused[record.container_id] = change
                    self._emit(record, WARNING, EVENT_NOT_RESIZED, change)
                continue
            if change is not None:
                await self.apply(record, change, placed)
                done += 1
        return done

    async def apply(
        self, old: AllocationRecord, new: AllocationRecord, bound: BoundContainer
    ) -> Booked | None:
        """Record, set and read back ``new`` (see the module docstring); None when the container has not
        started here (its start sets ``new``'s amounts: the record is enough)."""
        cid = new.container_id
        earlier = self._resizes.get(cid)
        self._store.put(new)  # the node's intent first: a crash after it re-reads the pod anyway
        booked = await asyncio.to_thread(self._limits.resize, new)
        if booked is None:
            self._resizes.pop(cid, None)
            log.info(
                "resize: %s/%s %s: not started yet, starts with %s",
                new.pod_namespace,
                new.pod_name,
                new.container_name,
                amounts(new),
            )
            return None
        resize = Resize(old=earlier.old if earlier is not None else old, new=new, since=self._clock())
        self._resizes[cid] = resize
        if self._mps is not None:
            resize.mps = await self._mps.on_resize(bound, container_id=cid)
        self._settle(resize, booked)
        return booked

    def after_audit(self) -> set[str]:
        """After each audit cycle (which sets a held-back limit again): finish what is in force now, give
        up waiting past the timeout, and take over held-back limits found at adoption. Returns the pods
        whose condition may have changed."""
        now = self._clock()
        booked = {b.record.container_id: b for b in self._limits.booked()}
        self._take_over(booked)
        pods: set[str] = set()
        for cid, resize in list(self._resizes.items()):
            entry = booked.get(cid)
            pods.add(resize.new.pod_uid)
            if entry is None:  # the container is gone
                del self._resizes[cid]
                continue
            if self._settle(resize, entry):
                continue
            if entry.held_back and not resize.gave_up and now - resize.since >= self._timeout_s:
                resize.gave_up = True
                held = "; ".join(h.describe() for h in entry.held_back)
                self._emit(
                    resize.new,
                    WARNING,
                    EVENT_LIMIT_BELOW_USAGE,
                    f"container {resize.new.container_name}: the new hard limit was not applied within "
                    f"{self._timeout_s:g}s because the container uses more ({held}); the old hard limit "
                    "stays until the use falls below the new one or the pod is resized again",
                )
        return pods

    def forget(self, pod_uid: str) -> None:
        for cid in [cid for cid, r in self._resizes.items() if r.new.pod_uid == pod_uid]:
            del self._resizes[cid]
            self._refused.pop(cid, None)

    def _settle(self, resize: Resize, booked: Booked) -> bool:
        """Finish ``resize`` when its new amounts are in force and nothing is held back."""
        if not booked.in_force or booked.held_back or booked.record != resize.new:
            return False
        self._resizes.pop(resize.new.container_id, None)
        self.applied += 1
        gpus = ", ".join(o.gpu for o in booked.verification.outcomes) if booked.verification else ""
        before = amounts(resize.old) if resize.old is not None else "the limits held at the agent's restart"
        mps = f"; MPS: {resize.mps}" if resize.mps else ""
        self._emit(
            resize.new,
            NORMAL,
            EVENT_APPLIED,
            f"container {resize.new.container_name}: {before} -> {amounts(resize.new)}, read back in force "
            f"on {gpus}{mps}",
        )
        return True

    def _emit(self, record: AllocationRecord, type: str, reason: str, message: str) -> None:
        level = logging.WARNING if type == WARNING else logging.INFO
        log.log(level, "resize: %s/%s %s: %s", record.pod_namespace, record.pod_name, reason, message)
        if self._events is not None:
            self._events.emit(regarding=pod_ref(record), type=type, reason=reason, message=message[:1024])


class AllocationsInForce:
    """The store's records as usage reporting sees them (``AllocationLookup``): the metrics' limit series
    and the audit's over-limit check. A container whose new hard limit is held back (a shrink waiting
    for its use to fall) counts with the limit it is held to, so it is neither shown nor stopped as over
    a limit the node has not set yet."""

    def __init__(self, *, store: MappingStore, limits: LimitEnforcer) -> None:
        self._store = store
        self._limits = limits

    def allocations(self) -> list[AllocationRecord]:
        kept = {
            b.record.container_id: max(h.kept for h in b.held_back) // MIB
            for b in self._limits.booked()
            if b.held_back
        }
        return [
            replace(r, limit_mib=max(r.limit_mib, kept[r.container_id])) if r.container_id in kept else r
            for r in self._store.allocations()
        ]


class PodResizeWatch:
    """The pods of this node, watched; each change goes through the tracker, and the pod's
    ``GpuResizeInProgress`` condition is made what the tracker says (set, changed or removed)."""

    def __init__(self, *, client: AsyncClient, node_name: str, tracker: ResizeTracker) -> None:
        self._client = client
        self.tracker = tracker
        self.informer: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(namespace=ALL_NAMESPACES, fields=f"spec.nodeName={node_name}"),
            name="node-pods",
        )
        self.informer.add_handler(self)
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._uid_key: dict[str, str] = {}
        self.condition_writes = 0

    async def run(self) -> None:
        worker = asyncio.create_task(self._work(), name="resize-worker")
        try:
            await self.informer.run()
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    async def after_audit(self) -> None:
        """The tracker's audit step, then the conditions of the pods it touched."""
        for uid in self.tracker.after_audit():
            key = self._uid_key.get(uid)
            if key is not None:
                self._enqueue(key)

    # -- the informer's handler ---------------------------------------------------------------------------

    def on_add(self, obj: Pod) -> None:
        self._seen(obj)

    def on_update(self, old: Pod, new: Pod) -> None:
        self._seen(new)

    def on_delete(self, obj: Pod) -> None:
        if obj.metadata is not None and obj.metadata.uid:
            self._uid_key.pop(obj.metadata.uid, None)
            self.tracker.forget(obj.metadata.uid)

    def _seen(self, pod: Pod) -> None:
        if pod.metadata is None or not pod.metadata.uid:
            return
        key = object_key(pod)
        self._uid_key[pod.metadata.uid] = key
        self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            pod = self.informer.store.get(key)
            if pod is None or pod.metadata is None or not pod.metadata.uid:
                continue
            try:
                await self.tracker.observe(
                    pod_uid=pod.metadata.uid, annotations=pod.metadata.annotations or {}
                )
                await self._write_condition(pod)
            except Exception:  # one pod's failure must not stop the others' resizes
                log.exception("resize: pod %s", key)

    async def _write_condition(self, pod: Pod) -> None:
        assert pod.metadata is not None and pod.metadata.uid and pod.metadata.name
        wanted = self.tracker.condition(pod.metadata.uid)
        conditions = (pod.status.conditions or []) if pod.status is not None else []
        shown = next((c for c in conditions if c.type == RESIZE_CONDITION), None)
        if wanted is None and shown is None:
            return
        if (
            wanted is not None
            and shown is not None
            and (shown.status, shown.reason, shown.message) == (wanted.status, wanted.reason, wanted.message)
        ):
            return
        name, namespace = pod.metadata.name, pod.metadata.namespace or "default"
        try:
            if wanted is None:
                await remove_pod_condition(
                    self._client, name=name, namespace=namespace, type=RESIZE_CONDITION
                )
            else:
                await set_pod_condition(
                    self._client,
                    name=name,
                    namespace=namespace,
                    type=RESIZE_CONDITION,
                    status=wanted.status,
                    reason=wanted.reason,
                    message=wanted.message[:1024],
                )
        except NotFound:
            return
        except KubeError as exc:  # written again at the next change or audit cycle
            log.warning("resize: cannot write %s on %s/%s: %s", RESIZE_CONDITION, namespace, name, exc)
            return
        self.condition_writes += 1
