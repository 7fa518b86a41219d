"""What the service needs from the placement engine, and the engine it gets.

The engine (``gpufrac.placement.Engine``) is pure and shared with the simulator. The service only asks
it to learn and forget nodes (and the nodes it does not manage, as topology domains with the pods
bound to them), place a batch (holding what it placed; a gang all-or-nothing), book a
placement it did not make (a bound pod seen at start-up or bound by a previous leader), hold a DRA
claim's allocation (booked once, whatever pods use it), let go of a pod or a claim, and show its
ledgers.
``PlacementEngine`` names exactly that, so the seam stays narrow and visible; ``build_engine`` maps the
scheduler's configuration onto the engine's knobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gpufrac.placement.decision import Decision, Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.fair_share import QueueBook
from gpufrac.placement.filters import GpuRules
from gpufrac.placement.model import NodeSpec, PendingPod, Queue, QueueResource
from gpufrac.placement.queue_shares import QueueAmount, QueueShares
from gpufrac.placement.state import GpuLedger
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.queues import config_queues


class PlacementEngine(Protocol):
    def add_node(self, spec: NodeSpec) -> None:
        """A new node, its GPUs empty until pods are assumed on it."""

    def update_node(self, spec: NodeSpec) -> list[str]:
        """A new spec for a known node; returns the pods dropped because their GPUs are gone."""

    def remove_node(self, name: str) -> list[str]:
        """Drop a node and every pod held on it; returns those pods."""

    def add_topology_node(self, spec: NodeSpec) -> None:
        """Add or replace a node nothing is placed on that is a topology domain all the same (a node
        the scheduler does not manage: its labels and taints)."""

    def remove_topology_node(self, name: str) -> list[str]:
        """Drop a topology-only node and the pods counted on it; returns those pods."""

    def add_topology_pod(self, pod: PendingPod, node: str) -> bool:
        """Count a pod bound to a topology-only node for other pods' affinity and spread rules; returns
        whether its arrival may let a waiting pod in."""

    def remove_topology_pod(self, uid: str) -> bool | None:
        """Stop counting a pod of a topology-only node: None when it was not counted, else whether its
        leaving may let a waiting pod in."""

    def schedule(
        self, pods: Sequence[PendingPod], *, gang: bool = False, min_member: int | None = None
    ) -> list[Decision]:
        """One decision per pod, in input order; every Placement returned is already held. With
        ``gang``, at least ``min_member`` (default all) are placed in one statement, or none."""

    def assume(self, pod: PendingPod, placement: Placement) -> Placement:
        """Book a placement made elsewhere (a bound pod); replaces what the pod held before."""

    def forget(self, uid: str) -> bool:
        """Give back everything ``uid`` holds; False when it held nothing."""

    def hold(self, key: str, placement: Placement, *, namespace: str) -> None:
        """Book GPU shares no pod holds itself (a DRA claim's allocation); replaces an earlier hold."""

    def release_hold(self, key: str) -> bool:
        """Give back a hold; False when there was none."""

    def set_queues(self, queues: Iterable[Queue]) -> None:
        """Replace the known queues (``gpufrac.scheduler.queues`` merges their sources)."""

    def set_usage_history(self, usage: Mapping[QueueResource, Mapping[str, float]], k: float) -> None:
        """Make fair shares time-based (``gpufrac.scheduler.queue_usage``); k = 0 turns it off."""

    @property
    def queues(self) -> QueueBook:
        """What each queue holds (read for Queue status and fair share)."""

    def queue_shares(
        self,
        *,
        leaving: Iterable[str] = (),
        waiting: Iterable[QueueAmount] = (),
        besides: str | None = None,
        nominees: Mapping[str, QueueAmount] | None = None,
    ) -> QueueShares:
        """The queues as the books will be: one tree, one capacity, one fair share for queue status,
        reclaim and its limit checks (``gpufrac.placement.queue_shares``)."""

    def nominate(self, pod: PendingPod, node: str) -> None:
        """Hold room on ``node`` for a pending pod a preemptor nominated there."""

    def nominated(self, uid: str) -> bool:
        """Whether a pending pod holds a nomination."""

    def nominated_uids(self) -> list[str]:
        """Every uid ``nominated`` says True for."""

    def drop_nomination(self, uid: str) -> bool:
        """Stop holding room for ``uid``; False when none was held."""

    def set_namespace(self, name: str, labels: dict[str, str]) -> None:
        """A namespace's labels, for affinity terms that select namespaces by label."""

    def ledger(self, node: str) -> list[GpuLedger]:
        """The GPUs of ``node`` as ledgers (for metrics)."""

    def gpu_capacity(self) -> tuple[int, int, int]:
        """Every node's GPUs: their MiB in all, how many, the largest one's MiB."""

    @property
    def node_names(self) -> list[str]: ...


def build_engine(config: SchedulerConfig) -> PlacementEngine:
    return Engine(
        policy=config.policy,
        rules=GpuRules(
            sm_sharing_single_tenant=config.sm_sharing_tenancy == "namespace",
            limit_overcommit=config.overcommit_cap,
        ),
        queues=config_queues(config),
    )
