"""Three minutes of the embedded cluster under churn and faults: what a day in a cluster does, compressed.

Marked ``soak`` (``pytest -m "not soak"`` leaves it out) but run by ``make test``. What it passes
through, and which of it is compressed:

- watch bookmarks, REAL time: the API server sends one on every watch about once a minute, so each
  informer (the scheduler's three, the simulated kubelet's) receives at least three; this is what killed
  the scheduler and the kubelet's informer 60 s after every start;
- watch deadlines: the simulated kubelet's watch ends every 60 s (a bookmark 2 s before, then a
  re-watch from it); the scheduler's own watches (300 s) are not configurable and do not reach theirs;
- Lease renewals, compressed: the scheduler renews every second (lease 10 s, renew deadline 8 s, so a
  4 s API server pause does not cost it the lease);
- resyncs, compressed: the scheduler retries unschedulable pods every 5 s, the kubelet's informer
  re-delivers its store every 10 s, and the node agents heartbeat every 10 s;
- one fault of each kind, spaced so each recovers before the next: SIGKILL of the scheduler, of a node
  agent and of the webhook, and SIGSTOP/SIGCONT of the control plane (API server and etcd) for 4 s.

The verdict (gpufrac.local.soak.verdict) is read from the API objects and the supervisor's record: no
exit that was not injected, every pod placed or explained, the audit clean at every check, and the
scheduler's per-GPU ledger equal to the bookings the API objects carry.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gpufrac.local.cluster import ClusterShape, LocalCluster
from gpufrac.local.simnodes import NodeShape
from gpufrac.local.soak import (
    SHAPES,
    Auditor,
    Churn,
    Fault,
    Faults,
    Outcome,
    Step,
    background,
    run_schedule,
    soak_timings,
    verdict,
)

pytestmark = [pytest.mark.kube, pytest.mark.soak]

#: Past three bookmarks of every watch (one a minute), with the faults inside the window.
CHURN_S = 190.0
SCHEDULE = (
    Step(at_s=25, fault=Fault.KILL_SCHEDULER),
    Step(at_s=65, fault=Fault.KILL_NODE_AGENT),
    Step(at_s=105, fault=Fault.KILL_WEBHOOK),
    Step(at_s=145, fault=Fault.PAUSE_APISERVER),
)


async def test_three_minutes_of_churn_and_faults_leave_every_component_up_and_every_ledger_true() -> None:
    cluster = LocalCluster(
        shape=ClusterShape(nodes=2, node=NodeShape(gpus=4, model="H100-80GB")), timings=soak_timings()
    )
    async with cluster:
        churn = Churn(cluster, interval_s=1.0, live=12)
        await churn.prepare()
        faults = Faults(cluster, pause_s=4.0)
        auditor = Auditor(cluster, every_s=15.0)
        started = time.monotonic()
        async with background(churn.run(), auditor.run()):
            await run_schedule(faults, SCHEDULE)
            # The churn itself is what is being soaked: it runs for the whole window.
            await asyncio.sleep(max(0.0, started + CHURN_S - time.monotonic()))
        result = await verdict(cluster, faults=faults)
        watch_restarts = cluster.kubelet.informer.watch_restarts if cluster.kubelet else 0

    assert [i.fault for i in faults.injected] == [s.fault for s in SCHEDULE]
    assert result.failures == [], result.failures
    assert auditor.audits >= 5 and auditor.problems == []
    # The churn really ran (every shape several times over, however slow the machine), and both outcomes
    # occurred: the 1000Gi shape fits nowhere, the others are placed.
    assert churn.counts.created >= 5 * len(SHAPES) and churn.counts.deleted >= 4 * len(SHAPES)
    assert churn.counts.outcomes[Outcome.PLACED] >= 2 * len(SHAPES)
    assert churn.counts.outcomes[Outcome.EXPLAINED] >= 2
    assert result.pods[Outcome.PLACED] >= 1
    # The kubelet's watch reached its deadline at least twice (a bookmark, then a re-watch).
    assert watch_restarts >= 2
