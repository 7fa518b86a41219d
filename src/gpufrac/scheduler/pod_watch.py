"""Pod watching for the scheduler: our pods into the scheduling queue, every bound pod into the books,
and what some pod fields refer to.

Five informers. Our pods (``spec.schedulerName`` = ours, not finished): a pending one is queued (again
only when a user changed it, not for a status write; see ``_meaningful_change``), its nomination by a
preemptor holds room on the nominated node, and a bound one is confirmed in the booking cache. Other
schedulers' pods already bound: they take host resources and count for affinity and spread (and GPUs if
they carry the contract), so the cache books them too. Namespaces (labels, for affinity terms'
``namespaceSelector`` and a namespace's default queue), PersistentVolumeClaims and PersistentVolumes (a
bound volume's node affinity, ``pod_fields.volume_terms``): a change to one wakes the waiting pods.

A pod whose own bind (or clean) is in flight, or that is booked, is left alone: its own writes come
back through the watch. ``PodWatch`` receives its collaborators as callables: where a pod's queue is,
whether a bind is in flight, what preemption and status reporting must hear about a pod leaving, and
what resizes (``gpufrac.scheduler.resize``) must hear: each change of a bound pod of ours (it may carry a
resize request) and each pod that leaves (room may have freed for a deferred one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Namespace, PersistentVolume, PersistentVolumeClaim, Pod

from gpufrac.kube.informer import Informer, object_key
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.placement.model import ModePolicy
from gpufrac.process.controller import Handler
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.objects import gpu_request, pending_pod
from gpufrac.scheduler.scheduling_queue import SchedulingQueue

log = logging.getLogger(__name__)


def _meaningful_change(old: Pod, new: Pod) -> bool:
    """A change a user made (spec, labels, annotations), not a status write; or the names of the claims
    kube-controller-manager generated from the pod's ResourceClaimTemplates (a pod waits for them)."""
    return (
        old.spec != new.spec
        or old.metadata.annotations != new.metadata.annotations
        or old.metadata.labels != new.metadata.labels
        or (old.status.resourceClaimStatuses if old.status else None)
        != (new.status.resourceClaimStatuses if new.status else None)
    )


class PodWatch:
    """See the module docstring. ``leaving(uid)``: a booked pod got a deletionTimestamp;
    ``victim_deleted(uid)``: True when the deleted pod was a preemption victim (its room stays booked
    for its preemptor); ``forget(uid)``: the pod is gone."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        scheduler_name: str,
        cache: BookingCache,
        queue: SchedulingQueue[Pod],
        queue_of: Callable[[Pod], str],
        default_queue: Callable[[str], str],
        mode_policy: ModePolicy,
        in_flight: Callable[[str], bool],
        leaving: Callable[[str], None],
        victim_deleted: Callable[[str], bool],
        forget: Callable[[str], None],
        resize: Callable[[Pod, bool], None] | None = None,
    ) -> None:
        self._cache = cache
        self._queue = queue
        self._queue_of = queue_of
        self._default_queue = default_queue
        self._mode_policy = mode_policy
        self._in_flight = in_flight
        self._leaving = leaving
        self._victim_deleted = victim_deleted
        self._forget = forget
        self._resize = resize or (lambda pod, gone: None)
        self._first_seen: dict[str, float] = {}
        name, live = scheduler_name, "status.phase!=Succeeded,status.phase!=Failed"
        self.pods: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(namespace=ALL_NAMESPACES, fields=f"spec.schedulerName={name},{live}"),
            name="pods",
        )
        self.foreign_pods: Informer[Pod] = Informer(
            client=client,
            resource=Pod,
            selection=Selection(
                namespace=ALL_NAMESPACES,
                fields=f"spec.schedulerName!={name},spec.nodeName!=,{live}",
            ),
            name="foreign-pods",
        )
        self.namespaces: Informer[Namespace] = Informer(client=client, resource=Namespace, name="namespaces")
        self.claims: Informer[PersistentVolumeClaim] = Informer(
            client=client,
            resource=PersistentVolumeClaim,
            selection=Selection(namespace=ALL_NAMESPACES),
            name="claims",
        )
        self.volumes: Informer[PersistentVolume] = Informer(
            client=client, resource=PersistentVolume, name="volumes"
        )
        self.pods.add_handler(Handler(changed=self._pod_changed, deleted=self._pod_deleted))
        self.foreign_pods.add_handler(Handler(changed=self._foreign_changed, deleted=self._pod_deleted))
        self.namespaces.add_handler(Handler(changed=self._namespace_changed, deleted=self._storage_changed))
        self.claims.add_handler(Handler(changed=self._storage_changed, deleted=self._storage_changed))
        self.volumes.add_handler(Handler(changed=self._storage_changed, deleted=self._storage_changed))

    @property
    def informers(self) -> tuple[Informer[Any], ...]:
        return (self.pods, self.foreign_pods)

    @property
    def field_informers(self) -> tuple[Informer[Any], ...]:
        """What pod fields refer to: namespaces, claims and volumes."""
        return (self.namespaces, self.claims, self.volumes)

    def latest(self, pod: Pod) -> Pod | None:
        """The informer's newest copy of the pod; None when it is gone or replaced by a namesake."""
        latest = self.pods.store.get(object_key(pod))
        return latest if latest is not None and latest.metadata.uid == pod.metadata.uid else None

    def arrived(self, uid: str) -> float | None:
        """When the pod was first seen pending (monotonic), forgotten as it is read."""
        return self._first_seen.pop(uid, None)

    def namespace_labels(self, name: str) -> dict[str, str] | None:
        namespace = self.namespaces.store.get(name)
        return None if namespace is None else dict(namespace.metadata.labels or {})

    # -- informer handlers (synchronous: memory only) -----------------------------------------------------

    def _pod_changed(self, old: Pod | None, pod: Pod) -> None:
        uid = pod.metadata.uid
        if pod.spec and pod.spec.nodeName:
            self._queue.remove(uid)
            if self._cache.confirm(pod):
                self._queue.cluster_changed()
            if pod.metadata.deletionTimestamp is not None:
                self._leaving(uid)
            else:
                self._resize(pod, False)
            return
        if pod.metadata.deletionTimestamp is not None:
            self._queue.remove(uid)
            return
        if self._in_flight(uid) or uid in self._cache:
            return  # its own bind (or clean) is writing it
        self._nominated(pod)
        queue = self._queue_of(pod)
        if old is None or uid not in self._queue or _meaningful_change(old, pod):
            self._first_seen.setdefault(uid, time.monotonic())
            self._queue.add(uid, pod, queue=queue)
        else:
            self._queue.update(uid, pod)

    def _nominated(self, pod: Pod) -> None:
        """Hold room on the node a preemptor nominated for this pending pod (status.nominatedNodeName)."""
        node = (pod.status.nominatedNodeName if pod.status else None) or None
        meta = pod.metadata
        engine = self._cache.engine
        if node is None:
            if engine.drop_nomination(meta.uid):
                self._queue.cluster_changed()  # the room it held is free
            return
        try:
            pending = pending_pod(
                pod,
                gpu=gpu_request(pod),
                arrival=0,
                default_queue=self._default_queue,
                mode_policy=self._mode_policy,
            )
        except Exception as error:  # its own scheduling attempt reports the problem
            log.debug("not holding room for %s/%s: %s", meta.namespace, meta.name, error)
            return
        engine.nominate(pending, node)

    def _foreign_changed(self, old: Pod | None, pod: Pod) -> None:
        # A pod counted on an unmanaged node that a waiting pod's affinity or spread counts wakes the
        # parked pods (kube-scheduler's queueing hints do as much).
        if pod.spec and pod.spec.nodeName and self._cache.confirm(pod):
            self._queue.cluster_changed()

    def _pod_deleted(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if self._cache.engine.drop_nomination(uid):
            self._queue.cluster_changed()
        self._queue.remove(uid)
        self._first_seen.pop(uid, None)
        self._forget(uid)
        self._resize(pod, True)
        if self._victim_deleted(uid):
            return  # a victim: its room stays booked until its preemptor takes it
        if self._cache.remove(pod):
            self._queue.cluster_changed()

    def _namespace_changed(self, old: Namespace | None, namespace: Namespace) -> None:
        self._cache.engine.set_namespace(namespace.metadata.name, dict(namespace.metadata.labels or {}))
        # Labels choose a namespace's default queue and which queues it may use, as well as affinity.
        if old is None or old.metadata.labels != namespace.metadata.labels:
            self._queue.cluster_changed()

    def _storage_changed(self, *objects: Any) -> None:
        """A claim, volume or namespace changed: pods waiting on one may fit now."""
        self._queue.cluster_changed()


__all__ = ["PodWatch"]
