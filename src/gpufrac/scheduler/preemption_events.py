"""The words of preemption, reclaim and consolidation: Event reasons, and how a plan's pods, nodes and
queues are named in its Events and messages (``gpufrac.scheduler.preemption`` emits them).

A victim's Event names the queue that took its room and, when that is another queue, its own: a tenant
reading ``kubectl describe pod`` sees whose quota evicted it, not only which pod.
"""

from __future__ import annotations

from lightkube.resources.core_v1 import Pod

from gpufrac.kube.events import ObjectRef
from gpufrac.placement.consolidation import Consolidation
from gpufrac.placement.gang_preemption import GangPreemption
from gpufrac.placement.preemption import Kind, Preemption

#: Event reasons: on the pending pod, and on a victim by the kind of removal.
PREEMPTING = "Preempting"
CONSOLIDATING = "Consolidating"
PREEMPTION_BLOCKED = "PreemptionBlocked"
VICTIM_REASON = {Kind.PREEMPT: "Preempted", Kind.RECLAIM: "Reclaimed", Kind.CONSOLIDATE: "Moved"}
VERB = {Kind.PREEMPT: "Preempting", Kind.RECLAIM: "Reclaiming", Kind.CONSOLIDATE: "Moving"}

Plan = Preemption | Consolidation | GangPreemption


def where(plan: Plan) -> str:
    """ "node a" or, for a gang's plan over several, "nodes a, b"."""
    if isinstance(plan, GangPreemption):
        nodes = plan.nodes
        return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {', '.join(nodes)}"
    return f"node {plan.node}"


def queues(kind: Kind, taker: str, victim: str) -> str:
    """Which queue took from which, as a victim's Event says it."""
    if kind is Kind.RECLAIM:
        return f"(queue {taker}, below its fair share, reclaiming from queue {victim})"
    return f"(queue {taker})" if taker == victim else f"(queue {taker}; this pod's queue {victim})"


def pod_key(pod: Pod) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


def pod_ref(pod: Pod) -> ObjectRef:
    meta = pod.metadata
    return ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid or "")
