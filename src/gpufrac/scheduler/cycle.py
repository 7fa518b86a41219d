"""What one scheduling cycle carries, and where other code plugs into it (kube-scheduler's framework).

A pod read for a cycle is one ``CycleItem``: the API's Pod, the engine's ``PendingPod``, the GPU request
its bind writes, and its claim plan when its GPUs come from DRA claims. It travels the whole cycle as
one value, from reading through placing to binding or reporting.

Two extension points, called by the service (``gpufrac.scheduler.service``) in this order:

- ``PodFilter.narrow`` (Filter): narrows where one pod may go with what the engine cannot see;
- ``PostFilter.post_filter`` (PostFilter): for a pod that fits nowhere, a chance to make room (the
  preemption step, ``PreemptionPostFilter``) before the pod is reported unschedulable. The post-filters
  are asked in order; the first that answers decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lightkube.resources.core_v1 import Pod

from gpufrac.contract.request import PodGpuRequest
from gpufrac.placement.decision import Unschedulable
from gpufrac.placement.model import PendingPod
from gpufrac.scheduler.booking_cache import BookingCache
from gpufrac.scheduler.claims import ClaimPlan
from gpufrac.scheduler.preemption import Preemptions


@dataclass(frozen=True, slots=True)
class CycleItem:
    """One pod through one scheduling cycle. ``gpu`` is what the bind writes into the pod's annotations
    (nothing for a claim pod: its GPUs are its claims'); ``plan`` is set for a claim pod."""

    pending: PendingPod
    pod: Pod
    gpu: PodGpuRequest
    plan: ClaimPlan | None = None

    @property
    def uid(self) -> str:
        return self.pending.uid


@dataclass(frozen=True, slots=True)
class PostFilterResult:
    """A post-filter's answer for a pod that fits nowhere: ``report`` a sentence (the pod is reported
    unschedulable with it), ``defer_s`` (the pod is tried again after that many seconds, unreported),
    or neither: the post-filter took the pod in hand (victims are being evicted and the pod nominated),
    so it waits unreported until the cluster changes."""

    report: str | None = None
    defer_s: float | None = None


class PodFilter(Protocol):
    """Narrows where one pod may go, with what the engine cannot see (e.g. the pods on each node).

    Returns the pod as the engine should place it (for instance with extra required node-affinity
    terms), or a sentence saying why it cannot be placed now (the pod is reported unschedulable with it
    and retried when the cluster changes).
    """

    def narrow(self, pending: PendingPod, pod: Pod, cache: BookingCache) -> PendingPod | str: ...


class PostFilter(Protocol):
    """What to do for a pod that fits nowhere. None: not this post-filter's pod (the next one is asked;
    when none answers, the pod is reported unschedulable with the engine's reasons)."""

    def post_filter(
        self, item: CycleItem, decision: Unschedulable, cache: BookingCache
    ) -> PostFilterResult | None: ...


class PreemptionPostFilter:
    """The preemption step as a post-filter: preempt, reclaim or consolidate for the pod if that makes
    room (``gpufrac.scheduler.preemption``), and report why it waits; defer it when this cycle's search
    budget is spent."""

    def __init__(self, preemptions: Preemptions) -> None:
        self._preemptions = preemptions

    def post_filter(self, item: CycleItem, decision: Unschedulable, cache: BookingCache) -> PostFilterResult:
        message = self._preemptions.consider(item.pending, item.pod, decision)
        if message is None:  # this cycle's search budget is spent: a later cycle searches for it
            return PostFilterResult(defer_s=self._preemptions.deferral_s())
        return PostFilterResult(report=message)


__all__ = ["CycleItem", "PodFilter", "PostFilter", "PostFilterResult", "PreemptionPostFilter"]
