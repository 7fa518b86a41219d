"""The booking cache's DRA claims: every allocated claim of our driver held once in the engine.

An allocated claim of our driver holds GPU memory whoever allocated it (this scheduler or
kube-scheduler) and however many pods use it, so it is booked once, as a hold of its own in the engine
(``Engine.hold``: its GPUs' memory, limits, compute and mode, no pod slot), from its allocation as the
node reads it (``claims.claim_placement``). ``changed`` follows the informer: an allocation seen is
held, a deallocated or deleted claim is released. A claim this scheduler has just allocated is held at
once (``hold(assumed=True)``), before its write lands, and a view of the claim without an allocation
does not release it until the informer has shown the allocation, or the write failed (``written``).

Claims of a node the cache does not know wait for it, like pods, holding nothing; ``hold_on`` re-holds a
node's claims when it comes (back) or changes GPUs. The pods that use claims are booked with their host
resources only (``BookingCache.rebook``): their GPUs are the claims'.

``ClaimHolds`` is ``BookingCache``'s: the cache lends it the engine and ``node``, the spec of a node it
knows (None for one it does not), and calls ``hold_on`` from its one node-change method. It keeps no
pod bookings and never reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightkube.resources.resource_v1 import ResourceClaim

from gpufrac.placement.model import NodeSpec
from gpufrac.scheduler.claims import allocated_node, claim_placement, hold_key, ours_allocated
from gpufrac.scheduler.placement_engine import PlacementEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClaimHold:
    """An allocated claim of our driver: ``claim`` (as a dict) carries the allocation on ``node``.
    ``assumed``: this scheduler wrote (or is writing) it and the informer has not shown it yet."""

    namespace: str
    node: str
    claim: dict[str, Any]
    assumed: bool


class ClaimHolds:
    """Allocated claims of our driver by claim uid, held in the engine while their node is known."""

    def __init__(self, *, engine: PlacementEngine, node: Callable[[str], NodeSpec | None]) -> None:
        self._engine = engine
        self._node = node
        self._claims: dict[str, ClaimHold] = {}

    def get(self, uid: str) -> ClaimHold | None:
        return self._claims.get(uid)

    def changed(self, claim: ResourceClaim) -> bool:
        """The informer's view of a claim: held when allocated to our driver, released when not (unless
        this scheduler's own write of it is still out). True when the books changed."""
        uid = claim.metadata.uid
        body = claim.to_dict()
        node = allocated_node(claim) if ours_allocated(claim) else None
        current = self._claims.get(uid)
        if node is None:
            if current is not None and current.assumed:
                return False  # an older view than our write; its outcome decides
            return self.release(uid)
        if current is not None and not current.assumed and current.claim.get("status") == body.get("status"):
            return False
        return self.hold(body, node=node, assumed=False)

    def hold(self, claim: dict[str, Any], *, node: str, assumed: bool) -> bool:
        """Hold an allocated claim (``claim`` with its ``status.allocation``) on ``node``."""
        meta = claim.get("metadata") or {}
        uid = str(meta.get("uid"))
        self._claims[uid] = ClaimHold(str(meta.get("namespace")), node, claim, assumed)
        return self._hold(uid)

    def written(self, uid: str, *, landed: bool) -> bool:
        """This scheduler's write of a claim's allocation answered. Landed: the hold stays assumed until
        the informer shows the allocation (an older view, such as the finalizer's write just before it,
        must not release it meanwhile). Failed: the assumed hold is released. True when the books
        changed."""
        current = self._claims.get(uid)
        if landed or current is None or not current.assumed:
            return False
        return self.release(uid)

    def release(self, uid: str) -> bool:
        """A claim deallocated or deleted: its GPUs are free again. True when it held something."""
        if self._claims.pop(uid, None) is None:
            return False
        self._engine.release_hold(hold_key(uid))
        return True

    def hold_on(self, node: str) -> None:
        """Hold again every claim allocated on ``node`` (it came, came back, or changed GPUs)."""
        for uid in sorted(u for u, h in self._claims.items() if h.node == node):
            self._hold(uid)

    def _hold(self, uid: str) -> bool:
        hold = self._claims[uid]
        spec = self._node(hold.node)
        key = hold_key(uid)
        if spec is None:
            return self._engine.release_hold(key)  # booked when its node comes
        placement = claim_placement(hold.claim, spec)
        if placement is None:
            return self._engine.release_hold(key)
        try:
            self._engine.hold(key, placement, namespace=hold.namespace)
        except ValueError as error:
            log.error("cannot book ResourceClaim %s on %s: %s", uid, hold.node, error)
            return self._engine.release_hold(key)
        return True
