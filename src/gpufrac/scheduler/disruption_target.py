"""The victim's ``DisruptionTarget`` condition: evicted by gpufrac's scheduler, for preemption, reclaim or
consolidation, and for whom.

kube-scheduler writes ``DisruptionTarget`` (status True, reason ``PreemptionByScheduler``) on a victim
before it deletes it. gpufrac evicts through the Eviction API instead (budgets hold), and the API server
then writes the condition itself, reason ``EvictionByEvictionAPI``, message ``Eviction API: evicting``
(checked against the real API server in tests/scheduler/test_preemption_gates_kube.py), overwriting one
written before. So the scheduler writes it after the eviction, on the terminating pod: the same type and
status (what a Job's ``podFailurePolicy`` and other readers match), with its own reason
(``PreemptionByScheduler`` as kube-scheduler's, ``ReclaimByScheduler``, ``ConsolidationByScheduler``)
and a message that names the scheduler, the pod it made room for, the queues and the Eviction API. A pod
already gone (no grace period) has nothing left to mark.
"""

from __future__ import annotations

import logging

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.errors import KubeError, NotFound
from gpufrac.kube.patch import set_pod_condition
from gpufrac.placement.preemption import Kind

log = logging.getLogger(__name__)

DISRUPTION_TARGET = "DisruptionTarget"
REASON = {
    Kind.PREEMPT: "PreemptionByScheduler",
    Kind.RECLAIM: "ReclaimByScheduler",
    Kind.CONSOLIDATE: "ConsolidationByScheduler",
}


async def mark_disruption_target(client: AsyncClient, pod: Pod, kind: Kind, story: str) -> None:
    """After ``pod``'s eviction: its ``DisruptionTarget`` condition says ``kind`` and ``story`` (the
    victim's Event message), by the scheduler the pod names. Best effort."""
    meta = pod.metadata
    scheduler = (pod.spec.schedulerName if pod.spec else None) or "scheduler"
    try:
        await set_pod_condition(
            client,
            name=meta.name,
            namespace=meta.namespace,
            type=DISRUPTION_TARGET,
            status="True",
            reason=REASON[kind],
            message=f"{scheduler}: {story}; evicted through the Eviction API",
        )
    except NotFound:
        return
    except KubeError as error:
        log.warning("could not mark %s/%s as a %s: %s", meta.namespace, meta.name, DISRUPTION_TARGET, error)
