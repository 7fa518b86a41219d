"""The words of preemption, reclaim and consolidation: Event reasons, and how a plan's pods, nodes and
queues are named in its Events and messages (``gpufrac.scheduler.preemption`` emits them).

A victim's Event names the queue that took its room and, when that is another queue, its own: a tenant
reading ``kubectl describe pod`` sees whose quota evicted it, not only which pod. A reclaim's Events
give the numbers it was decided on (``reclaim_story``): how far the taking queue is below its fair share
and how far each victim queue is above its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from lightkube.resources.core_v1 import Pod

from gpufrac.kube.events import ObjectRef
from gpufrac.placement.consolidation import Consolidation
from gpufrac.placement.engine import Engine, over_limit
from gpufrac.placement.gang_preemption import GangPreemption
from gpufrac.placement.model import PendingPod
from gpufrac.placement.preemption import Kind, Preemption, least_ask
from gpufrac.placement.queue_shares import FAIR_SHARE, QueueAmount, QueueShares, placed_amount

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


def queues(kind: Kind, taker: str, victim: str, book: QueueShares | None = None) -> str:
    """Which queue took from which, as a victim's Event says it; for reclaim, with the numbers it was
    decided on (``book``: what each queue will hold against its fair share or deserved quota)."""
    if kind is Kind.RECLAIM:
        if book is None:
            return f"(queue {taker}, below its {FAIR_SHARE}, reclaiming from queue {victim})"
        return f"({reclaim_story(taker, [victim], book)})"
    return f"(queue {taker})" if taker == victim else f"(queue {taker}; this pod's queue {victim})"


def reclaim_story(taker: str, victims: Iterable[str], book: QueueShares) -> str:
    """ "queue prod is 163840 MiB below its fair share 327680; reclaiming from queue batch, 163840 MiB
    over its fair share 81920": the numbers a reclaim was decided on."""
    bar = book.bar

    def over(q: str) -> str:
        return f"queue {q}, {book.allocated(q) - book.share_bar(q)} MiB over its {bar} {book.share_bar(q)}"

    below = book.share_bar(taker) - book.allocated(taker)
    head = f"queue {taker} is {below} MiB below its {bar} {book.share_bar(taker)}"
    return f"{head}; reclaiming from " + "; ".join(over(q) for q in sorted(set(victims)))


def taking_message(
    kind: Kind, head: str, victims: list[tuple[str, str]], taker: str, book: QueueShares | None
) -> str:
    """The preemptor's Event: ``head`` ("evicted 2 pod(s) on node n to make room"), each victim with its
    queue, and for reclaim the queues' numbers."""
    text = f"{head}: " + ", ".join(f"{name} (queue {queue})" for name, queue in victims)
    if kind is Kind.RECLAIM and book is not None and victims:
        story = reclaim_story(taker, [q for _, q in victims], book)
        text += f". {story[:1].upper()}{story[1:]}"
    return text


def limit_note(engine: Engine, book: QueueShares, pending: PendingPod, said: str) -> str:
    """Why nobody is evicted for a pod its queue's limit refuses once the pods already promised to the
    queue (nominees) are placed: " No pod is evicted for it: queue prod would exceed ..."; "" otherwise,
    or when the message ``said`` names the limit already."""
    exceeded = book.exceeded(pending.queue, least_ask(engine, pending))
    if exceeded is None or over_limit(pending.queue, *exceeded) in said:
        return ""
    return f" No pod is evicted for it: {over_limit(pending.queue, *exceeded)}, counting its nominated pods."


def plan_amounts(plans: Iterable[tuple[Plan, str]]) -> dict[str, QueueAmount]:
    """Per pod a plan (with its queue) makes room for: what the plan's placement books, in that queue."""
    out = {}
    for plan, queue in plans:
        placements = plan.placements if isinstance(plan, GangPreemption) else (plan.placement,)
        for placement in placements:
            out[placement.pod_uid] = QueueAmount(queue, placed_amount(placement))
    return out


def waiting_for(engine: Engine, plan: Plan) -> str:
    """What an open plan waits for, as the pod's message ends: "Evicting 2 pod(s) on node n: ns/a, ns/b."."""
    names = ", ".join(booked_name(engine, v) for v in plan.victims)
    return f"{VERB[plan.kind]} {len(plan.victims)} pod(s) on {where(plan)}: {names}."


class Filed(Protocol):
    """An open plan as the scheduler files it (``gpufrac.scheduler.preemption``'s nomination)."""

    plan: Plan
    pod: Pod
    members: list[Pod]
    queue: str
    book: QueueShares | None

    @property
    def owner(self) -> str: ...


def whom(filed: Filed) -> str:
    """Whom a plan makes room for: the pod, or the gang (its owner key) and its members."""
    if isinstance(filed.plan, GangPreemption):
        return f"gang {filed.owner} ({', '.join(pod_key(p) for p in filed.members)})"
    return pod_key(filed.pod)


def victim_story(engine: Engine, filed: Filed, victim: str) -> tuple[str, str]:
    """A victim's Event: its reason, and the message naming whom it made room for, the queues and the
    node (for a moved pod, where it goes)."""
    plan = filed.plan
    reason = VICTIM_REASON[plan.kind]
    if plan.kind is Kind.CONSOLIDATE:
        target = next(m.target.node for m in plan.moves if m.uid == victim)  # type: ignore[union-attr]
        return reason, (
            f"Moved by consolidation to make room for {whom(filed)} on {where(plan)}; "
            f"its controller recreates it (room for it was found on node {target})"
        )
    story = queues(plan.kind, filed.queue, booked_queue(engine, victim), filed.book)
    return reason, f"{reason} by {whom(filed)} {story} on {where(plan)}"


def taking_story(engine: Engine, filed: Filed, victims: list[tuple[str, Pod | None]]) -> tuple[str, str]:
    """The Event on each pod a plan makes room for: its reason, and the victims with their queues."""
    plan = filed.plan
    moved = plan.kind is Kind.CONSOLIDATE
    room = "to make room" if len(filed.members) == 1 else f"to make room for {whom(filed)}"
    return CONSOLIDATING if moved else PREEMPTING, taking_message(
        plan.kind,
        f"{'moved' if moved else 'evicted'} {len(victims)} pod(s) on {where(plan)} {room}",
        [(pod_key(p) if p else v, booked_queue(engine, v)) for v, p in victims],
        filed.queue,
        filed.book,
    )


def booked_queue(engine: Engine, uid: str) -> str:
    """The queue a booked pod is charged to ("?" once its booking is gone)."""
    booked = engine.bound_pod(uid)
    return "?" if booked is None else booked.queue


def booked_name(engine: Engine, uid: str) -> str:
    """namespace/name of a booked pod (its uid once its booking is gone)."""
    booked = engine.bound_pod(uid)
    return uid if booked is None else booked.key


def pod_key(pod: Pod) -> str:
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


def pod_ref(pod: Pod) -> ObjectRef:
    meta = pod.metadata
    return ObjectRef(kind="Pod", namespace=meta.namespace, name=meta.name, uid=meta.uid or "")
