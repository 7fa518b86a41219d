"""The queues the scheduler knows: ``Queue`` objects, KAI Scheduler's Queue objects, the configuration file.

Three sources, one set. ``Queue`` (gpufrac.io/v1alpha1, deploy/crds/gpufrac.io_queues.yaml) is the
resource an administrator manages. KAI Scheduler's Queue (scheduling.run.ai/v2) is read where its CRD is
installed, so a KAI user switches schedulers without rewriting queues. The configuration file's
``queues`` stay as the fallback and for back-compatibility (a cluster without the CRD keeps working as
before). When two sources name the same queue, a ``Queue`` object wins over a KAI queue, which wins over
the file: the object an administrator edits with kubectl is the one in force.

KAI's queue (kai-scheduler/KAI-Scheduler, pkg/apis/scheduling/v2/queue_types.go and resources.go) has
``spec.parentQueue`` and ``spec.resources.{gpu,cpu,memory}.{quota,overQuotaWeight,limit}``, with -1 for
"unlimited" and GPUs counted in fractions. Ours counts GPU memory in MiB and whole GPUs, so the mapping
is: KAI's ``gpu`` becomes our whole-GPU quota (deserved rounded down, limit rounded up, so a mapped queue
is never promised more, nor capped harder, than KAI said); KAI's GPU over-quota weight also weights the
queue's GPU memory (KAI divides fractional GPUs by the same weight); KAI's ``cpu`` and ``memory`` (host
resources) have no counterpart and are ignored; a negative quota is 0 and a negative or absent limit is
none. KAI's ``spec.preemptMinRuntime`` and ``spec.reclaimMinRuntime`` (``metav1.Duration`` strings) are
ours unchanged (a negative one, which protects nobody in KAI, is 0; one that does not parse is unset,
logged). The mapping is documented in docs/queues.md.

Each CRD is probed at start (a list): one that is not installed is not watched,
and probed again every ``probe_interval`` seconds, so installing it later needs no restart. Every change
replaces the engine's set of queues and wakes parked pods (a raised limit may let them fit).

A pod joins the queue its label names (``gpufrac.io/queue``, else ``kai.scheduler/queue``), else its
namespace's default queue (the Namespace label ``gpufrac.io/default-queue``), else the configured default
queue (``gpufrac.placement.queue_access``, the rule the webhook applies too). ``refusal`` says why a pod
cannot join as it is: the queue is unknown (an unknown queue is never an unlimited one), it has child
queues (pods join leaf queues, as in KAI), its namespace may not use the queue, or its priority is above
the queue's ``maxPriority``. The scheduler asks it before every placement, so a webhook outage is no way
into another team's queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Pod

from gpufrac.contract import keys
from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection, list_objects
from gpufrac.placement.model import Queue, QueueResource, Quota
from gpufrac.placement.queue_access import access_refusal, chosen_queue, parse_duration, queue_from_spec
from gpufrac.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

GROUP = keys.API_GROUP
VERSION = keys.QUEUE_API_VERSION
KIND = "Queue"
PLURAL = keys.QUEUE_PLURAL
CRD_NAME = f"{PLURAL}.{GROUP}"
GpufracQueue = create_global_resource(GROUP, VERSION, KIND, PLURAL)

KAI_GROUP = keys.KAI_SCHEDULING_API_GROUP
KAI_VERSION = "v2"
KaiQueue = create_global_resource(KAI_GROUP, KAI_VERSION, KIND, PLURAL)

#: Where a pod refused its queue by the namespace rule waits (not a valid label value: never a queue).
REFUSED_QUEUE = "(refused)"

#: Where each resource's terms live in a Queue's spec.resources (and its amounts in status).
RESOURCE_FIELDS = {QueueResource.GPU_MEMORY: "gpuMemory", QueueResource.GPUS: "gpus"}


def queue_from_object(obj: Any) -> Queue:
    """Our ``Queue`` object as the engine's queue (``queue_access.queue_from_spec``: the webhook reads it
    the same way); raises ``ValueError`` naming a field stored without the CRD's validation."""
    return queue_from_spec(obj.metadata.name, obj.spec)


def _kai_number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _kai_duration(spec: dict[str, Any], key: str, *, name: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    try:
        return parse_duration(value, where=f"KAI queue {name}: spec.{key}", negative=True)
    except ValueError as error:
        log.warning("%s; read as not set", error)
        return None


def queue_from_kai(obj: Any) -> Queue:
    """KAI Scheduler's Queue as ours (the mapping in the module docstring)."""
    spec = obj.spec or {}
    gpu = (spec.get("resources") or {}).get("gpu") or {}
    quota = _kai_number(gpu.get("quota"))
    limit = _kai_number(gpu.get("limit"))
    weight = _kai_number(gpu.get("overQuotaWeight"))
    weight = 1.0 if weight is None or weight < 0 else weight
    return Queue(
        name=obj.metadata.name,
        parent=spec.get("parentQueue") or None,
        gpu_memory=Quota(over_quota_weight=weight),
        gpus=Quota(
            deserved=0 if quota is None or quota < 0 else math.floor(quota),
            over_quota_weight=weight,
            limit=None if limit is None or limit < 0 else math.ceil(limit),
        ),
        preempt_min_runtime_s=_kai_duration(spec, "preemptMinRuntime", name=obj.metadata.name),
        reclaim_min_runtime_s=_kai_duration(spec, "reclaimMinRuntime", name=obj.metadata.name),
    )


def config_queues(config: SchedulerConfig) -> list[Queue]:
    """The configuration file's queues (top-level; a GPU-memory limit, a deserved share, min-runtimes)."""
    return [
        Queue(
            name=q.name,
            gpu_memory=Quota(limit=q.gpu_memory_limit_mib),
            deserved_share=q.deserved_share,
            preempt_min_runtime_s=q.preempt_min_runtime_s,
            reclaim_min_runtime_s=q.reclaim_min_runtime_s,
        )
        for q in config.queues
    ]


def merge_queues(
    *, configured: Iterable[Queue], kai: Iterable[Queue], ours: Iterable[Queue]
) -> dict[str, Queue]:
    """One set by name; later sources win (ours over KAI's over the file's)."""
    merged: dict[str, Queue] = {}
    for source in (configured, kai, ours):
        merged.update((q.name, q) for q in source)
    return merged


class _Source:
    """One Queue kind: its informer once its CRD is found to be installed."""

    def __init__(
        self, *, client: AsyncClient, resource: type, name: str, read: Callable[[Any], Queue]
    ) -> None:
        self.resource = resource
        self.read = read
        self.informer: Informer[Any] = Informer(
            client=client, resource=resource, selection=Selection(), name=name
        )
        self.installed = False
        self.probed = asyncio.Event()

    def queues(self) -> list[Queue]:
        if not self.installed:
            return []
        found = []
        for obj in self.informer.store:
            try:
                found.append(self.read(obj))
            except ValueError as error:
                log.warning("ignoring %s: %s", self.informer.name, error)
        return found

    @property
    def synced(self) -> bool:
        return self.probed.is_set() and (not self.installed or self.informer.synced.is_set())


class QueueDirectory:
    """See the module docstring. ``apply`` receives the full set on every change; ``changed`` is called
    after it (the service wakes its parked pods). ``namespace_labels`` gives a Namespace's labels (None:
    not known yet, read as no labels); without it every namespace has none."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        config: SchedulerConfig,
        apply: Callable[[list[Queue]], None],
        changed: Callable[[], None],
        probe_interval: float = 60.0,
        namespace_labels: Callable[[str], Mapping[str, str] | None] = lambda _: None,
    ) -> None:
        self._client = client
        self._configured = config_queues(config)
        self.default_queue = config.default_queue
        self._namespace_labels = namespace_labels
        self._apply = apply
        self._changed = changed
        self._probe_interval = probe_interval
        self.ours = _Source(client=client, resource=GpufracQueue, name="queues", read=queue_from_object)
        self.kai = _Source(client=client, resource=KaiQueue, name="kai-queues", read=queue_from_kai)
        for source in (self.ours, self.kai):
            source.informer.add_handler(_Refresh(self.refresh))
        self._merged = merge_queues(configured=self._configured, kai=(), ours=())
        self._children: dict[str, list[str]] = {}
        #: Bumped by every ``refresh``: an answer of ``refusal`` read at another epoch may be stale.
        self.epoch = 0

    @property
    def synced(self) -> bool:
        return self.ours.synced and self.kai.synced

    async def wait_synced(self) -> None:
        """Until every source is probed and, where installed, listed."""
        for source in (self.ours, self.kai):
            await source.probed.wait()
            if source.installed:
                await source.informer.synced.wait()

    @property
    def informers(self) -> list[Informer[Any]]:
        return [s.informer for s in (self.ours, self.kai) if s.installed]

    def queues(self) -> list[Queue]:
        return list(self._merged.values())

    def get(self, name: str) -> Queue | None:
        return self._merged.get(name)

    def children(self, name: str) -> list[str]:
        return self._children.get(name, [])

    def refresh(self) -> None:
        self._merged = merge_queues(
            configured=self._configured, kai=self.kai.queues(), ours=self.ours.queues()
        )
        children: dict[str, list[str]] = {}
        for q in self._merged.values():
            if q.parent is not None and q.parent in self._merged:
                children.setdefault(q.parent, []).append(q.name)
        self._children = {k: sorted(v) for k, v in children.items()}
        self.epoch += 1
        self._apply(self.queues())
        self._changed()

    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        """``namespace``'s labels as ``refusal`` reads them (None: not known yet)."""
        return self._namespace_labels(namespace)

    def default_for(self, namespace: str) -> str:
        """The queue of a pod of ``namespace`` that names none."""
        labels = self._namespace_labels(namespace) or {}
        return chosen_queue(
            pod_labels={}, namespace=namespace, namespace_labels=labels, fallback=self.default_queue
        ).queue

    def queue_of(self, pod: Pod) -> str:
        """The queue ``pod`` is in (its label, else its namespace's default queue); ``REFUSED_QUEUE`` for
        a pod its namespace may not put there, so that a tenant's refused pods never count as another
        team's pending pods (the ``gpufrac_scheduler_pending_pods`` gauge and its alert)."""
        meta = pod.metadata
        namespace = meta.namespace or ""
        labels = self._namespace_labels(namespace) or {}
        pod_labels = meta.labels or {}
        refused = access_refusal(
            pod_labels=pod_labels,
            namespace=namespace,
            namespace_labels=labels,
            priority=(pod.spec.priority if pod.spec else None) or 0,
            queues=self._merged,
            fallback=self.default_queue,
        )
        if refused is not None:
            return REFUSED_QUEUE
        return chosen_queue(
            pod_labels=pod_labels, namespace=namespace, namespace_labels=labels, fallback=self.default_queue
        ).queue

    def refusal(self, pod: Pod) -> str | None:
        """Why ``pod`` cannot join its queue (the module docstring); None when it can."""
        meta = pod.metadata
        namespace = meta.namespace or ""
        labels = self._namespace_labels(namespace) or {}
        choice = chosen_queue(
            pod_labels=meta.labels or {},
            namespace=namespace,
            namespace_labels=labels,
            fallback=self.default_queue,
        )
        queue = choice.queue
        if queue not in self._merged:
            return f"queue {queue} ({choice.via}) is not configured"
        children = self.children(queue)
        if children:
            return (
                f"queue {queue} ({choice.via}) has child queues ({', '.join(children)}); "
                "pods join a queue without children"
            )
        return access_refusal(
            pod_labels=meta.labels or {},
            namespace=namespace,
            namespace_labels=labels,
            priority=(pod.spec.priority if pod.spec else None) or 0,
            queues=self._merged,
            fallback=self.default_queue,
        )

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._follow(s), name=f"follow-{s.informer.name}")
            for s in (self.ours, self.kai)
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, source: _Source) -> None:
        """Probe for the source's CRD until it is installed, then run its informer."""
        while not await self._installed(source.resource):
            source.probed.set()
            await asyncio.sleep(self._probe_interval)
        source.installed = True
        log.info("watching %s", source.informer.name)
        source.probed.set()
        await source.informer.run()

    async def _installed(self, resource: type) -> bool:
        try:
            await list_objects(self._client, resource, selection=Selection())
        except NotFound:
            return False
        except httpx2.HTTPStatusError as error:  # lightkube raises a list's 404 as the HTTP error itself
            if error.response.status_code == 404:
                return False
            log.warning("probing %s failed (%s); probing again later", resource.__name__, error)
            return False
        except (KubeError, httpx2.HTTPError, OSError) as error:
            log.warning("probing %s failed (%s); probing again later", resource.__name__, error)
            return False
        return True


class _Refresh:
    """An informer handler that re-reads every queue when one is added, deleted or its spec changes
    (queues are few). A status write (the scheduler's own) changes nothing the engine uses."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        self._refresh = refresh

    def on_add(self, obj: Any) -> None:
        self._refresh()

    def on_update(self, old: Any, new: Any) -> None:
        if old.spec != new.spec:
            self._refresh()

    def on_delete(self, obj: Any) -> None:
        self._refresh()


__all__ = [
    "CRD_NAME",
    "REFUSED_QUEUE",
    "GpufracQueue",
    "KaiQueue",
    "QueueDirectory",
    "config_queues",
    "merge_queues",
    "queue_from_kai",
    "queue_from_object",
]
