"""``Queue`` status: what each queue holds, asks for, deserves and should hold, written by the leader.

The numbers come from the engine's books (``QueueBook``: what placed pods hold, per queue and subtree)
and the scheduling queue (what waiting pods ask for); fair share is ``placement.fair_share.fair_shares``
over that demand. A waiting pod's request in MiB is resolved against the largest GPU of the cluster
when it asks for a portion (where it will run is not known yet); an exclusive request asks for whole
GPUs (and their memory). A waiting pod that cannot join the queue it names (unknown, or a parent) is
no demand on any queue.

Writes are rate-limited: one pass every ``interval`` seconds, and a pass patches only the queues whose
status differs from what the API server has (the informer's copy), so a quiet cluster costs no writes.
Only the leader writes, and only our own ``Queue`` objects: a KAI queue's status is KAI's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.contract.errors import ContractError
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.patch import merge_patch
from gpufrac.placement.fair_share import QueueBook, fair_shares_by_resource
from gpufrac.placement.model import Queue, QueueResource
from gpufrac.scheduler.objects import gpu_request
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.queues import RESOURCE_FIELDS, GpufracQueue, QueueDirectory

log = logging.getLogger(__name__)

RESOURCES = tuple(QueueResource)


@dataclass(frozen=True, slots=True)
class Capacity:
    """The cluster's GPUs as fair share divides them."""

    gpu_memory_mib: int
    gpus: int
    largest_gpu_mib: int

    def of(self, resource: QueueResource) -> int:
        return self.gpu_memory_mib if resource is QueueResource.GPU_MEMORY else self.gpus


def engine_capacity(engine: PlacementEngine) -> Capacity:
    """The GPUs of every node the engine knows."""
    sizes = [ledger.capacity_mib for node in engine.node_names for ledger in engine.ledger(node)]
    return Capacity(gpu_memory_mib=sum(sizes), gpus=len(sizes), largest_gpu_mib=max(sizes, default=0))


def pod_demand(pod: Pod, *, largest_gpu_mib: int) -> dict[QueueResource, int]:
    """What a waiting pod asks for, per resource; nothing for a pod whose request is invalid."""
    try:
        request = gpu_request(pod)
    except ContractError:
        return {}
    mib = sum(c.request_mib(largest_gpu_mib) * c.device_count for c in request.containers)
    gpus = sum(c.device_count for c in request.containers if c.exclusive)
    return {QueueResource.GPU_MEMORY: mib, QueueResource.GPUS: gpus}


def queue_statuses(
    *,
    queues: Iterable[Queue],
    book: QueueBook,
    waiting: Mapping[QueueResource, Mapping[str, int]],
    capacity: Capacity,
) -> dict[str, dict[str, dict[str, int]]]:
    """The status of every queue: ``allocated`` and ``requested`` (its subtree's), ``deserved`` and
    ``fairShare``, each per resource field (``gpuMemory``, ``gpus``); fair share rounded down."""
    queues = list(queues)
    names = {q.name for q in queues}
    own_demand: dict[QueueResource, dict[str, int]] = {}
    for resource in RESOURCES:
        demand = {name: book.own(name, resource) for name in names}
        for name, amount in waiting.get(resource, {}).items():
            demand[name] = demand.get(name, 0) + amount
        own_demand[resource] = demand
    shares = fair_shares_by_resource(queues, own_demand, {r: capacity.of(r) for r in RESOURCES})
    requested: dict[QueueResource, dict[str, int]] = {r: {} for r in RESOURCES}
    for resource in RESOURCES:
        for name, amount in own_demand[resource].items():
            for q in book.lineage(name):
                requested[resource][q] = requested[resource].get(q, 0) + amount
    statuses: dict[str, dict[str, dict[str, int]]] = {}
    for q in queues:
        statuses[q.name] = {
            "allocated": {RESOURCE_FIELDS[r]: book.allocated(q.name, r) for r in RESOURCES},
            "requested": {RESOURCE_FIELDS[r]: requested[r].get(q.name, 0) for r in RESOURCES},
            "deserved": {RESOURCE_FIELDS[r]: q.deserved(r, capacity.of(r)) for r in RESOURCES},
            "fairShare": {RESOURCE_FIELDS[r]: int(shares[r].get(q.name, 0.0)) for r in RESOURCES},
        }
    return statuses


class QueueStatusWriter:
    """See the module docstring. ``passes`` counts completed passes (tests wait on it)."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        directory: QueueDirectory,
        book: Callable[[], QueueBook],
        capacity: Callable[[], Capacity],
        waiting: Callable[[], Iterable[tuple[str, Pod]]],
        is_leader: Callable[[], bool],
        interval: float,
    ) -> None:
        self._client = client
        self._directory = directory
        self._book = book
        self._capacity = capacity
        self._waiting = waiting
        self._is_leader = is_leader
        self._interval = interval
        self.passes = 0
        self.writes = 0
        # A waiting pod's demand by uid, for its resourceVersion and the largest GPU it was resolved
        # against: a pass re-reads only pods that changed (tens of thousands may wait).
        self._demands: dict[str, tuple[tuple[str, int], dict[QueueResource, int]]] = {}

    def statuses(self) -> dict[str, dict[str, dict[str, int]]]:
        capacity = self._capacity()
        waiting: dict[QueueResource, dict[str, int]] = {r: {} for r in RESOURCES}
        demands: dict[str, tuple[tuple[str, int], dict[QueueResource, int]]] = {}
        for queue, pod in self._waiting():
            if self._directory.refusal(pod) is not None:
                continue  # a pod that cannot join its queue is no demand on it
            uid = pod.metadata.uid or ""
            version = (pod.metadata.resourceVersion or "", capacity.largest_gpu_mib)
            known = self._demands.get(uid)
            demand = known[1] if known is not None and known[0] == version else None
            if demand is None:
                demand = pod_demand(pod, largest_gpu_mib=capacity.largest_gpu_mib)
            demands[uid] = (version, demand)
            for resource, amount in demand.items():
                waiting[resource][queue] = waiting[resource].get(queue, 0) + amount
        self._demands = demands
        return queue_statuses(
            queues=self._directory.queues(), book=self._book(), waiting=waiting, capacity=capacity
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self._is_leader() and self._directory.ours.installed:
                try:
                    await self.write_once()
                except Exception:  # one failed pass must not stop the next
                    log.exception("writing queue status failed")
            self.passes += 1

    async def write_once(self) -> int:
        """Patch the status of every ``Queue`` object whose status changed; returns how many."""
        if not len(self._directory.ours.informer.store):
            return 0
        statuses = self.statuses()
        written = 0
        for obj in list(self._directory.ours.informer.store):
            name = obj.metadata.name
            desired = statuses.get(name)
            if desired is None or _current(obj) == desired:
                continue
            try:
                await merge_patch(self._client, GpufracQueue.Status, name=name, patch={"status": desired})
            except NotFound:
                continue  # deleted since the informer saw it
            except KubeError as error:
                log.warning("could not write the status of queue %s: %s", name, error)
                continue
            written += 1
        self.writes += written
        return written


def _current(obj: Any) -> dict[str, Any]:
    status = obj.status or {}
    return {key: status.get(key) for key in ("allocated", "requested", "deserved", "fairShare")}
