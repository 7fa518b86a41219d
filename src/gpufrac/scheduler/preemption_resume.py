"""After a restart, the plan that the pods already leaving make: no new victims while old ones terminate.

A restart (or a new leader) loses ``Preemptions``' books, not the plan it was carrying out: its victims
still terminate (they carry a deletionTimestamp, and ``Preemptions.leaving`` was told) and the pending pod
still carries ``status.nominatedNodeName``. kube-scheduler lets no pod preempt while lower-priority pods
terminate on its nominated node; likewise, when the pods leaving the nodes a pod (or a gang's members) is
nominated to free enough room for it, the scheduler waits for them instead of choosing victims again.

``plan_from_leaving`` finds that plan, reading the engine's books and changing nothing: it runs the
search ``Preemptions`` would run, kind by kind, with every candidate excluded but the leaving pods.
``Preemptions`` files what it finds as if made there (``_resume``, ``_resume_gang``): no eviction is
repeated, the room is held, and the pod is placed first when they are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

import numpy as np
from lightkube.resources.core_v1 import Pod

from gpufrac.placement.engine import Engine
from gpufrac.placement.gang_preemption import GangPreemption
from gpufrac.placement.model import PendingPod
from gpufrac.placement.preemption import Kind, Preemption, ShareBook, eligible_victims


def plan_from_leaving(
    engine: Engine,
    pendings: Sequence[PendingPod],
    pods: Sequence[Pod],
    search: Callable[[Kind, set[str]], Preemption | GangPreemption | None],
    *,
    leaving: AbstractSet[str],
    taken: AbstractSet[str],
    shares: ShareBook | None,
    preempt: bool,
    consolidate: bool,
) -> Preemption | GangPreemption | None:
    """The first plan ``search`` finds, kind by kind (preempt and reclaim when ``preempt``, then
    consolidate when ``consolidate``), among the ``leaving`` pods on the nodes ``pods`` (the API objects
    of ``pendings``) are nominated to alone: every other pod the kind allows is excluded, and so are the
    victims of the plans still open (``taken``). None when no plan takes only them."""
    on_nodes = _leaving_on(engine, pods, leaving=leaving, taken=taken)
    if not on_nodes:
        return None
    table = engine.pods
    kinds = ((Kind.PREEMPT, Kind.RECLAIM) if preempt else ()) + ((Kind.CONSOLIDATE,) if consolidate else ())
    for kind in kinds:
        slots = [eligible_victims(engine, p, kind=kind, shares=shares)[0] for p in pendings]
        eligible = {table.uid[slot] for slot in np.unique(np.concatenate(slots)).tolist()}
        if not eligible & on_nodes:
            continue  # none of the leaving pods may make room for these pods
        plan = search(kind, (eligible - on_nodes) | taken)
        if plan is not None:
            return plan
    return None


def _leaving_on(
    engine: Engine, pods: Sequence[Pod], *, leaving: AbstractSet[str], taken: AbstractSet[str]
) -> set[str]:
    """The booked pods of ``leaving`` on the nodes ``pods`` are nominated to, but those ``taken``."""
    index = engine.state.index
    rows = {
        index[node]
        for pod in pods
        if (node := (pod.status.nominatedNodeName if pod.status else None)) and node in index
    }
    if not rows or not leaving:
        return set()
    table = engine.pods
    return {
        uid
        for uid in leaving - taken
        if (slot := table.slot_of.get(uid)) is not None and int(table.node[slot]) in rows
    }
