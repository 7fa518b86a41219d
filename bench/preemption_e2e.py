"""Preemption and reclaim end to end through the real API server: a full cluster, then a burst of a more
important workload's pods.

A real control plane (testenv), ``--nodes`` simulated nodes of ``--gpus`` GPUs, ``gpufrac scheduler`` as
its own process (as deployed). The fill: two pods of half a GPU on every GPU, of low priority, in queue
``batch``; the cluster is then full. The burst: ``--burst`` pods of one whole GPU each, created as fast as
a client can create them, that fit only once two halves leave:

- ``--mode preempt``: the burst has a higher PriorityClass, in the same queue (preemption);
- ``--mode reclaim``: the burst is queue ``prod``, which deserves half the cluster and holds nothing,
  while ``batch`` (deserving the other half) holds it all (reclaim; priority plays no part).

No kubelet runs: a victim with a zero grace period is deleted by its eviction at once, as a kubelet
finishing it would, and a bound pod is as far as a pod gets ("running" here means bound).

Measured: the seconds from the burst's first create until its last pod is bound, and each pod's latency
(create to seen bound), p50 and p99; the victims (fill pods gone) and the ``Preempted``/``Reclaimed``
Events per victim: each must be evicted exactly once (one Event, by its uid). The Events are read once
the scheduler has written every Event it queued (``events_written_s`` after the last bind;
``events_dropped`` when its queue overflowed, and then a victim may lack its Event). Also the
scheduler's CPU per burst pod. Throughout the burst the bookings are audited from the API objects every
``--audit-every`` seconds (``gpufrac.scheduler.booking_audit``: no GPU over-committed, no mixed modes),
not only at the end.

    .venv/bin/python bench/preemption_e2e.py                      # 100 nodes x 8 GPUs, 200 pods, preempt
    .venv/bin/python bench/preemption_e2e.py --mode reclaim
    .venv/bin/python bench/preemption_e2e.py --nodes 1000 --burst 2000

The last line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from lightkube.resources.scheduling_v1 import PriorityClass

from gpufrac.contract import keys
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.scheduler.booking_audit import audit
from scheduler_e2e import (
    BindClock,
    cpu_ms_per_pod,
    cpu_seconds,
    percentile,
    scheduler_process,
    wait_events_written,
    wait_leading,
)

NAMESPACE = "bench-preempt"
LOW, HIGH = "bench-low", "bench-high"


def pod(
    name: str,
    *,
    annotations: dict[str, str],
    queue: str,
    priority: str,
    whole: bool = False,
    namespace: str = NAMESPACE,
) -> Pod:
    """A pod of ``gpufrac scheduler`` in ``queue`` with PriorityClass ``priority``, zero grace period (its
    eviction deletes it at once: no kubelet runs), one container ``app`` asking ``annotations``'s GPU share
    or, ``whole``, one whole GPU (``nvidia.com/gpu: 1``)."""
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    if whole:
        resources["limits"] = {keys.GPU_RESOURCE: "1"}
    return Pod.from_dict(
        {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "annotations": annotations,
                "labels": {keys.QUEUE_LABEL: queue},
            },
            "spec": {
                "schedulerName": keys.DEFAULT_SCHEDULER_NAME,
                "priorityClassName": priority,
                "terminationGracePeriodSeconds": 0,
                "containers": [{"name": "app", "image": "busybox", "resources": resources}],
            },
        }
    )


async def create_all(
    client: AsyncClient, pods: list[Pod], *, concurrency: int, rate: float = 0.0
) -> dict[str, float]:
    """Create ``pods`` with ``concurrency`` requests in flight, in order, and with ``rate`` a steady stream
    of that many pods a second at most (0: as fast as the requests in flight allow); when each create
    started."""
    gate = asyncio.Semaphore(concurrency)
    started: dict[str, float] = {}
    begin = time.monotonic()

    async def create(i: int, p: Pod) -> None:
        if rate:
            await asyncio.sleep(max(0.0, begin + i / rate - time.monotonic()))
        async with gate:
            started[p.metadata.name] = time.monotonic()
            await client.create(p)

    await asyncio.gather(*(create(i, p) for i, p in enumerate(pods)))
    return started


async def wait_until(check: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def auditor(
    client: AsyncClient,
    every: float,
    found: list[str],
    count: list[int],
    *,
    snapshot: Callable[[], list[Pod]] | None = None,
    nodes: list[Node] | None = None,
) -> None:
    """Audit the bookings from the API objects every ``every`` seconds until cancelled: the pods and nodes
    listed each time, or ``snapshot()``'s pods (a watch's copy of the namespace, as consistent as a list
    and costing the API server nothing) against ``nodes``, audited in a worker thread so that the
    watch timing the pods keeps its loop."""
    while True:
        if snapshot is None:
            pods = [p async for p in client.list(Pod, namespace=NAMESPACE)]
            report = audit(nodes=[n async for n in client.list(Node)], pods=pods)
        else:
            report = await asyncio.to_thread(audit, nodes=nodes or [], pods=snapshot())
        count[0] += 1
        found.extend(report.problems)
        await asyncio.sleep(every)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpufrac-bench-"))
    gpus = args.nodes * args.gpus
    result: dict[str, Any] = {
        "bench": "preemption_e2e",
        "mode": args.mode,
        "nodes": args.nodes,
        "gpus": gpus,
        "fill_pods": 2 * gpus,
        "burst_pods": args.burst,
    }
    reclaim = args.mode == "reclaim"
    settings: dict[str, Any] = {"policy": args.policy}
    if reclaim:
        settings["queues"] = [
            {"name": "batch", "deserved_share": 0.5},
            {"name": "prod", "deserved_share": 0.5},
        ]
    else:
        settings["queues"] = [{"name": "batch"}]
    settings["default_queue"] = "batch"
    with ControlPlane(data_dir=workdir / "cp") as cp:
        client = cp.async_client(timeout=30)
        try:
            await create_sim_nodes(client, count=args.nodes, shape=NodeShape(gpus=args.gpus), concurrency=32)
            await client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
            for name, value in ((LOW, 5), (HIGH, 1000)):
                await client.create(PriorityClass(metadata=ObjectMeta(name=name), value=value))
            clock = BindClock()
            gone: set[str] = set()

            class Gone:
                def on_add(self, p: Pod) -> None:
                    pass

                def on_update(self, old: Pod, p: Pod) -> None:
                    pass

                def on_delete(self, p: Pod) -> None:
                    gone.add(p.metadata.name)

            informer: Informer[Pod] = Informer(
                client=client, resource=Pod, selection=Selection(namespace=NAMESPACE)
            )
            informer.add_handler(clock)
            informer.add_handler(Gone())
            watching = asyncio.create_task(informer.run())
            with scheduler_process(cp, workdir=workdir, tag="preempt", settings=settings) as (
                proc,
                port,
                ended,
            ):
                await wait_leading(port, proc, timeout=120.0)
                await asyncio.wait_for(informer.synced.wait(), 30)
                fill = [
                    pod(f"fill-{i:05d}", annotations={keys.GPU_FRACTION: "0.5"}, queue="batch", priority=LOW)
                    for i in range(2 * gpus)
                ]
                started = time.monotonic()
                await create_all(client, fill, concurrency=args.concurrency)
                await wait_until(
                    lambda: all(p.metadata.name in clock.bound_at for p in fill),
                    timeout=args.timeout,
                    what="the fill bound",
                )
                result["fill_s"] = round(time.monotonic() - started, 1)
                burst = [
                    pod(
                        f"burst-{i:05d}",
                        annotations={},
                        queue="prod" if reclaim else "batch",
                        priority=LOW if reclaim else HIGH,
                        whole=True,
                    )
                    for i in range(args.burst)
                ]
                problems: list[str] = []
                audits = [0]
                auditing = asyncio.create_task(auditor(client, args.audit_every, problems, audits))
                scheduler_before = cpu_seconds(proc.pid)
                try:
                    created = await create_all(client, burst, concurrency=args.concurrency)
                    await wait_until(
                        lambda: all(p.metadata.name in clock.bound_at for p in burst),
                        timeout=args.timeout,
                        what="the burst bound",
                    )
                finally:
                    auditing.cancel()
                    await asyncio.gather(auditing, return_exceptions=True)
                result["scheduler_cpu_ms_per_burst_pod"] = cpu_ms_per_pod(
                    proc.pid, scheduler_before, args.burst
                )
                # Events are written by the scheduler as it goes, behind the burst's own writes.
                (
                    result["events_written_s"],
                    result["events_dropped"],
                    result["events_failed"],
                ) = await wait_events_written(port, timeout=args.timeout)
                reason = "Reclaimed" if reclaim else "Preempted"
                every = [e async for e in client.list(Event, namespace=NAMESPACE)]
                events = [e for e in every if e.reason == reason]
                result["events_by_reason"] = dict(Counter(e.reason for e in every).most_common())
            result["scheduler_exit"] = ended["exit"]
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            first = min(created.values())
            last = max(clock.bound_at[p.metadata.name] for p in burst)
            latencies = [clock.bound_at[n] - t for n, t in created.items()]
            result["burst_s"] = round(last - first, 2)
            result["burst_pods_per_s"] = round(args.burst / (last - first), 1)
            result["p50_ms"] = round(1000 * statistics.median(latencies), 1)
            result["p99_ms"] = round(1000 * percentile(latencies, 0.99), 1)
            victims = {p for p in gone if p.startswith("fill-")}
            per_victim = Counter(e.involvedObject.uid for e in events)
            result["victims"] = len(victims)
            result["victim_events"] = len(events)
            result["victims_evicted_twice"] = sum(1 for n in per_victim.values() if n > 1)
            result["audits_during_burst"] = audits[0]
            result["audit_problems_during_burst"] = problems[:5]
            pods = [p async for p in client.list(Pod, namespace=NAMESPACE)]
            report = audit(nodes=[n async for n in client.list(Node)], pods=pods)
            result["audit_ok"] = report.ok and not problems
            result["burst_bound"] = sum(
                1 for p in pods if p.metadata.name.startswith("burst-") and p.spec.nodeName
            )
        finally:
            await client.close()
    # Every victim has its Event, unless the scheduler's Event queue overflowed (at most that many lack one).
    with_event = len(per_victim)
    result["pass"] = bool(
        result["audit_ok"]
        and result["burst_bound"] == args.burst
        and result["victims_evicted_twice"] == 0
        and result["victims"] - result["events_dropped"] <= with_event <= result["victims"]
    )
    result["workdir"] = str(workdir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("preempt", "reclaim"), default="preempt")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--burst", type=int, default=200, help="whole-GPU pods in the burst (default 200)")
    parser.add_argument("--policy", default="fgd-plus")
    parser.add_argument("--concurrency", type=int, default=32, help="create requests in flight")
    parser.add_argument("--audit-every", type=float, default=0.5, help="seconds between audits in the burst")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.burst > args.nodes * args.gpus:
        parser.error(f"--burst {args.burst} is more than the cluster's {args.nodes * args.gpus} GPUs")
    print(json.dumps(asyncio.run(run(args)), separators=(",", ":")))


if __name__ == "__main__":
    main()
