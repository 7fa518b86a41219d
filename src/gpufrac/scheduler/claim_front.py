"""The claim front: what kube-scheduler's DynamicResources plugin is, for claims of gpufrac's driver.

It keeps the DRA informers (ResourceClaims, DeviceClasses, ResourceSlices) and what the scheduler reads
from them: the classes of our driver (``claims.driver_class``) and the devices each node publishes
(``claims.published_nodes``). Through a scheduling cycle it does three things, in order:

- ``plan`` (PreFilter): a pod's claims become a ``ClaimPlan`` (``claims.plan_claims``: the shares the
  engine places as the pod's containers, and the nodes they may go to), or the sentence that refuses it;
- ``hold`` (Reserve): once placed, the pod's shares become its claims' allocations, held in the books
  at once (assumed until written), and the pod keeps its host resources only;
- ``write`` (PreBind): ``ClaimWriter`` writes each claim's allocation and reservation before the
  Binding; the books learn which allocations landed.

Every allocated claim of our driver, whoever allocated it, is booked by the booking cache as the claim
informer reports it (``BookingCache.claim_changed``), so annotation pods and claims never book the same
memory. The reading and rendering of claims is ``gpufrac.scheduler.claims`` (no I/O there).

``ClaimFront`` receives its collaborators: the booking cache, ``changed`` (a claim or a class changed:
waiting pods may fit) and the leader fence for its writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx2
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice

from gpufrac.contract import keys
from gpufrac.contract.request import PodGpuRequest
from gpufrac.kube.errors import Conflict, KubeError, NotFound
from gpufrac.kube.informer import Informer
from gpufrac.kube.patch import merge_patch_version
from gpufrac.kube.stream import ALL_NAMESPACES, Selection
from gpufrac.placement.decision import Placement
from gpufrac.placement.model import PendingPod
from gpufrac.process.controller import Handler
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claims import (
    ClaimPlan,
    DriverClass,
    PublishedNode,
    allocation,
    driver_class,
    plan_claims,
    published_nodes,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClaimBind:
    """A claim pod's part of its bind: every claim it uses, and the allocations to write (by claim uid)."""

    plan: ClaimPlan
    allocations: dict[str, dict[str, Any]]


class ClaimFront:
    """See the module docstring. ``informers`` go to the controller runner."""

    def __init__(
        self,
        *,
        client: AsyncClient,
        cache: BookingCache,
        changed: Callable[[], None],
        fence: Callable[[], bool],
    ) -> None:
        self._cache = cache
        self._changed = changed
        self.resource_claims: Informer[ResourceClaim] = Informer(
            client=client,
            resource=ResourceClaim,
            selection=Selection(namespace=ALL_NAMESPACES),
            name="resource-claims",
        )
        self.device_classes: Informer[DeviceClass] = Informer(
            client=client, resource=DeviceClass, name="device-classes"
        )
        self.resource_slices: Informer[ResourceSlice] = Informer(
            client=client, resource=ResourceSlice, name="resource-slices"
        )
        self.resource_claims.add_handler(Handler(changed=self._claim_changed, deleted=self._claim_deleted))
        self.device_classes.add_handler(Handler(changed=self._class_changed, deleted=self._class_deleted))
        self.resource_slices.add_handler(Handler(changed=self._slices_changed, deleted=self._slices_changed))
        self._classes: dict[str, DriverClass | None] = {}
        self._published_cache: dict[str, PublishedNode] | None = {}
        self.writer = ClaimWriter(client=client, fence=fence)

    @property
    def _published(self) -> dict[str, PublishedNode]:
        """What each node publishes, read from the slices again after they changed: once per change of
        the set, not once per slice (a scheduler starting on 1,000 nodes gets 1,000 slice events, and
        reading every slice on each was quadratic)."""
        if self._published_cache is None:
            self._published_cache = published_nodes(self.resource_slices.store)
        return self._published_cache

    @property
    def informers(self) -> tuple[Informer[Any], ...]:
        return (self.resource_claims, self.device_classes, self.resource_slices)

    def plan(self, pod: Pod, gpu: PodGpuRequest) -> ClaimPlan | str:
        """The pod's claims as the engine's request and where it may go, or why it cannot be placed."""
        if gpu.wants_gpu:
            return (
                "spec.resourceClaims and a GPU request in annotations or nvidia.com/gpu: a pod gets its GPUs "
                "one way; use claims or the gpufrac annotations, not both"
            )
        store = self.resource_claims.store
        return plan_claims(
            pod,
            claim=lambda ns, name: store.get(f"{ns}/{name}"),
            classes=self._classes,
            published=self._published,
        )

    def hold(self, pending: PendingPod, placement: Placement, plan: ClaimPlan) -> tuple[Placement, ClaimBind]:
        """A placed claim pod: its shares become its claims' allocations, held at once in the books
        (assumed until written), and the pod keeps its host resources only. Raises ValueError when the
        node does not publish a chosen GPU as a device (its slice lags its inventory)."""
        node = placement.node
        spec, published = self._cache.nodes[node], self._published.get(node)
        allocations: dict[str, dict[str, Any]] = {}
        if plan.to_allocate:
            if published is None:
                raise ValueError(f"node {node} publishes no ResourceSlice of driver {keys.DRA_DRIVER_NAME}")
            for claim in plan.to_allocate:
                allocations[claim.claim.metadata.uid] = allocation(
                    claim, placement=placement, node=spec, published=published
                )
        for claim in plan.to_allocate:
            body = claim.claim.to_dict()
            body["status"] = {
                **(body.get("status") or {}),
                "allocation": allocations[claim.claim.metadata.uid],
            }
            self._cache.hold_claim(body, node=node, assumed=True)
        host = Placement(pod_uid=placement.pod_uid, node=node, containers=())
        self._cache.rebook(pending.uid, replace(pending, gpu=PodGpuRequest()), host)
        return host, ClaimBind(plan, allocations)

    async def write(self, pod: Pod, claims: ClaimBind) -> str | None:
        """Write a claim pod's allocations and reservations: None when all landed (bind the pod), else
        why not. The books learn which allocations landed either way."""
        landed, error = await self.writer.write(
            pod, claims=claims.plan.claims, allocations=claims.allocations
        )
        for claim_uid in claims.allocations:
            if self._cache.claim_written(claim_uid, landed=claim_uid in landed):
                self._changed()
        return error

    # -- informer handlers (synchronous: memory only) -----------------------------------------------------

    def _claim_changed(self, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        self._cache.claim_changed(claim)
        self._changed()  # a claim created, allocated or freed: pods waiting on it may go

    def _claim_deleted(self, claim: ResourceClaim) -> None:
        self._cache.release_claim(claim.metadata.uid)
        self._changed()

    def _class_changed(self, old: DeviceClass | None, device_class: DeviceClass) -> None:
        self._classes[device_class.metadata.name] = driver_class(device_class)
        self._changed()

    def _class_deleted(self, device_class: DeviceClass) -> None:
        self._classes.pop(device_class.metadata.name, None)
        self._changed()

    def _slices_changed(self, *objects: Any) -> None:
        self._published_cache = None
        self._changed()


def consumer(pod: Pod) -> dict[str, str]:
    """The pod as a ``reservedFor`` entry (``ResourceClaimConsumerReference``)."""
    return {"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}


def reserved(claim: ResourceClaim, pod: Pod) -> bool:
    return any(r.uid == pod.metadata.uid for r in (claim.status.reservedFor if claim.status else None) or [])


# -- writing ------------------------------------------------------------------------------------------------


class ClaimWriter:
    """Writes a claim pod's allocations and reservations before its Binding, as kube-scheduler's
    PreBind does: the finalizer first (an allocated claim is not deleted under its pods), then
    ``status.allocation`` with the pod in ``status.reservedFor`` (one write), each a merge patch at the
    version read, so a claim that changed since (another scheduler allocated it) is refused by the API
    server (409) and never allocated twice: the pod's next try plans on the claim as the informer has
    it since. A claim already allocated only gets the pod added to ``reservedFor``. Both writes go on
    the lean HTTP path (``merge_patch_version``), as the Binding does."""

    def __init__(self, *, client: AsyncClient, fence: Callable[[], bool]) -> None:
        self._client = client
        self._fence = fence

    async def write(
        self, pod: Pod, *, claims: Sequence[ResourceClaim], allocations: Mapping[str, dict[str, Any]]
    ) -> tuple[set[str], str | None]:
        """The uids of the claims whose allocation landed, and None when every claim holds its
        allocation and the pod, else why not (nothing is undone: a claim allocated before the failure
        keeps its allocation, and the pod's next try goes where it is)."""
        landed: set[str] = set()
        for claim in claims:
            meta = claim.metadata
            where = f"ResourceClaim {meta.namespace}/{meta.name}"
            if not self._fence():
                return landed, "this scheduler is no longer the leader"
            try:
                version = meta.resourceVersion
                allocation_ = allocations.get(meta.uid)
                if allocation_ is not None and keys.DRA_CLAIM_FINALIZER not in (meta.finalizers or []):
                    version = await merge_patch_version(
                        self._client,
                        ResourceClaim,
                        name=meta.name,
                        namespace=meta.namespace,
                        patch={
                            "metadata": {"finalizers": [*(meta.finalizers or []), keys.DRA_CLAIM_FINALIZER]}
                        },
                        resource_version=version,
                    )
                if allocation_ is None and reserved(claim, pod):
                    continue
                status: dict[str, Any] = {
                    "reservedFor": [
                        *[r.to_dict() for r in (claim.status.reservedFor if claim.status else None) or []],
                        consumer(pod),
                    ]
                }
                if allocation_ is not None:
                    status["allocation"] = allocation_
                await merge_patch_version(
                    self._client,
                    ResourceClaim.Status,
                    name=meta.name,
                    namespace=meta.namespace,
                    patch={"status": status},
                    resource_version=version,
                )
                if allocation_ is not None:
                    landed.add(meta.uid)
            except NotFound:
                return landed, f"{where} was deleted"
            except Conflict:
                return landed, f"{where} changed while it was being allocated; trying again"
            except (KubeError, httpx2.HTTPError, OSError) as error:
                return landed, f"writing the allocation of {where} failed: {error}"
        return landed, None


__all__ = ["ClaimBind", "ClaimFront", "ClaimWriter", "consumer", "reserved"]
