"""Mixed load through the real API server: queues, priorities and a preemption burst interleaved with a
stream of creates (issue #39).

A real control plane (testenv), ``--nodes`` simulated nodes of ``--gpus`` GPUs (as
``bench/scheduler_e2e.py`` makes them), ``gpufrac scheduler`` as its own process, as deployed (leader
election on, its default policy unless ``--policy`` says otherwise, preemption on). The chart's Queue
CRD and a tree of ``Queue`` objects (docs/queues.md): ``mixed-research`` deserving 60 % of the
cluster's GPU memory and whole GPUs, divided between its children ``mixed-vision`` and ``mixed-nlp``
(30 % each), and ``mixed-prod`` (40 %). Three PriorityClasses: low (5), mid (100), high (1000).

The load, one namespace, no kubelet (a victim with a zero grace period is deleted by its eviction at
once, and "running" means bound):

- the fill, a stream of pods created in order, ``--rate`` a second (0: as fast as ``--concurrency``
  requests in flight allow), asking in all ``--fill`` times the cluster's GPUs (beyond 1, the end of
  the stream meets a full cluster): a quarter GPU, half a GPU, 12 GiB sm-sharing, one whole GPU, two
  halves of two GPUs (5:6:2:3:4), priority low (60 %) or mid, in the three leaf queues in proportion
  to what they deserve (``fill_mix``);
- the burst: once the bound pods book ``--burst-at`` of the cluster's GPUs (or the whole fill is
  created and nothing has bound for 2 s), ``--burst`` pods of a quarter or half a GPU in turn, priority
  high, in the leaf queues likewise, created as fast as the requests in flight allow while the fill's
  stream goes on: each fits only once lower-priority pods of its own queue leave (preemption never
  crosses queues; reclaim may, by fair share).

The bench waits until every burst pod is bound or gone (reclaim may take a burst pod for a queue below
its fair share, any priority: docs/queues.md "Reclaim"; nothing re-creates it here, so waiting for it
would wait forever), then until nothing has been bound or deleted for
``--settle`` seconds. Measured: pods/s over the run (pods seen bound, victims included, from the first
create to the last bind), create-to-bound latency p50/p99 per class (fill low, fill mid, burst);
decisions per second from the scheduler's own counter (``gpufrac_scheduler_schedule_attempts_total``:
every placement attempt, scheduled, unschedulable or failed, over the run until settled) beside binds
plus evictions per second from the API; the victims (pods deleted: nothing else deletes a pod here; one
may go while its bind is in flight), and the ``Preempted``/``Reclaimed`` Events per victim by uid (each
evicted exactly once; checked for the victims gone once the run settled, ``victims_checked``: the
scheduler goes on deciding while the bench lists the Events and stops it); the
scheduler's peak RSS (VmHWM), its CPU per bound pod and its cores, the control plane's and the machine's
(what limited it). The bookings are audited throughout from the watch's copy of the namespace
(``gpufrac.scheduler.booking_audit``: no GPU over-committed, no mixed modes) every ``--audit-every``
seconds, and once at the end from a list.

    .venv/bin/python bench/mixed_load.py                       # 100 nodes x 8 GPUs, quick
    .venv/bin/python bench/mixed_load.py --nodes 5000 --burst 2000 --rate 200 --audit-every 60

With ``BENCH_VERBOSE=1`` a progress line goes to stderr every 30 s. The last line is a one-line JSON
summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from lightkube.resources.scheduling_v1 import PriorityClass

from gpufrac.contract import keys
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection
from gpufrac.local.cluster import install_queue_crd
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.scheduler.booking_audit import audit
from gpufrac.scheduler.queues import GpufracQueue
from kube_scheduler_e2e import grown
from preemption_e2e import HIGH, LOW, auditor, create_all, pod, wait_until
from scheduler_e2e import (
    ZONES,
    BindClock,
    cpu_seconds,
    machine_cpu,
    percentile,
    rss_mib,
    scheduler_process,
    scheduler_samples,
    wait_events_written,
    wait_leading,
)

NAMESPACE = "bench-mixed"
MID = "bench-mid"
PRIORITIES = {LOW: 5, MID: 100, HIGH: 1000}
#: Queue name: (parent, deserved share of the cluster's GPU memory and whole GPUs).
QUEUES: dict[str, tuple[str | None, float]] = {
    "mixed-research": (None, 0.6),
    "mixed-vision": ("mixed-research", 0.3),
    "mixed-nlp": ("mixed-research", 0.3),
    "mixed-prod": (None, 0.4),
}
LEAVES = ["mixed-vision", "mixed-nlp", "mixed-prod"]
ATTEMPTS = "gpufrac_scheduler_schedule_attempts_total"


@dataclass(frozen=True, slots=True)
class Kind:
    """A pod shape of the load: its annotations (or one whole GPU) and the GPUs it books, in GPUs."""

    name: str
    weight: int
    annotations: dict[str, str]
    whole: bool = False

    def gpus(self, gpu_mib: int) -> float:
        if self.whole:
            return 1.0
        if "gpu-fraction" in self.annotations:
            devices = int(self.annotations.get("gpu-fraction-num-devices", "1"))
            return devices * float(self.annotations["gpu-fraction"])
        return 12 * 1024 / gpu_mib  # the sm-sharing kind's 12Gi request


FILL_KINDS = [
    Kind("quarter", 5, {keys.GPU_FRACTION: "0.25"}),
    Kind("half", 6, {keys.GPU_FRACTION: "0.5"}),
    Kind(
        "sm-sharing",
        2,
        {
            keys.memory_request_key("app"): "12Gi",
            keys.memory_limit_key("app"): "24Gi",
            keys.compute_mode_key("app"): "sm-sharing",
        },
    ),
    Kind("whole", 3, {}, whole=True),
    Kind("two-halves", 4, {keys.GPU_FRACTION: "0.5", "gpu-fraction-num-devices": "2"}),
]
BURST_KINDS = [Kind("quarter", 1, {keys.GPU_FRACTION: "0.25"}), Kind("half", 1, {keys.GPU_FRACTION: "0.5"})]


@dataclass(frozen=True, slots=True)
class Planned:
    pod: Pod
    cls: str  # fill-low, fill-mid, burst
    gpus: float


def fill_mix(*, total_gpus: float, gpu_mib: int, seed: int = 39) -> list[Planned]:
    """The fill's stream, in creation order, until it asks for ``total_gpus`` GPUs: kinds by weight,
    priority low 60 % and mid 40 %, queues in proportion to what the leaves deserve (same seed, same
    stream)."""
    rng = random.Random(seed)
    weights = [QUEUES[q][1] for q in LEAVES]
    planned: list[Planned] = []
    asked = 0.0
    while asked < total_gpus:
        kind = rng.choices(FILL_KINDS, weights=[k.weight for k in FILL_KINDS])[0]
        priority = LOW if rng.random() < 0.6 else MID
        queue = rng.choices(LEAVES, weights=weights)[0]
        name = f"fill-{len(planned):06d}"
        body = pod(
            name,
            annotations=dict(kind.annotations),
            queue=queue,
            priority=priority,
            whole=kind.whole,
            namespace=NAMESPACE,
        )
        planned.append(Planned(body, "fill-low" if priority == LOW else "fill-mid", kind.gpus(gpu_mib)))
        asked += kind.gpus(gpu_mib)
    return planned


def burst_mix(count: int, *, gpu_mib: int, seed: int = 40) -> list[Planned]:
    """The burst: a quarter or half a GPU in turn, priority high, queues as the fill's."""
    rng = random.Random(seed)
    weights = [QUEUES[q][1] for q in LEAVES]
    planned = []
    for i in range(count):
        kind = BURST_KINDS[i % len(BURST_KINDS)]
        queue = rng.choices(LEAVES, weights=weights)[0]
        body = pod(
            f"burst-{i:05d}",
            annotations=dict(kind.annotations),
            queue=queue,
            priority=HIGH,
            namespace=NAMESPACE,
        )
        planned.append(Planned(body, "burst", kind.gpus(gpu_mib)))
    return planned


def queue_objects(*, gpus: int, gpu_mib: int) -> list[Any]:
    """The Queue tree, each deserving its share of the cluster's GPU memory (MiB) and whole GPUs."""
    out = []
    for name, (parent, share) in QUEUES.items():
        spec: dict[str, Any] = {
            "resources": {
                "gpuMemory": {"deserved": int(share * gpus * gpu_mib)},
                "gpus": {"deserved": int(share * gpus)},
            }
        }
        if parent:
            spec["parentQueue"] = parent
        out.append(GpufracQueue(metadata=ObjectMeta(name=name), spec=spec))
    return out


class Tracker(BindClock):
    """The watch's view: when each pod was first seen bound (``bound_at``), the GPUs the pods bound now
    book, the pods deleted (``gone``, by name, with uid: victims, as nothing else deletes a pod here; one
    may be evicted while the scheduler's bind of it is still in flight, never seen bound), and when a pod
    was last bound or deleted."""

    def __init__(self, gpus_of: dict[str, float]) -> None:
        super().__init__()
        self.gpus_of = gpus_of
        self.bound_now: set[str] = set()
        self.booked = 0.0
        self.gone: dict[str, str] = {}
        self.changed_at = time.monotonic()

    def _see(self, p: Pod) -> None:
        name = p.metadata.name
        if p.spec and p.spec.nodeName and name not in self.bound_now and name not in self.gone:
            super()._see(p)
            self.bound_now.add(name)
            self.booked += self.gpus_of.get(name, 0.0)
            self.changed_at = time.monotonic()

    def on_delete(self, p: Pod) -> None:
        name = p.metadata.name
        if name in self.bound_now:
            self.bound_now.discard(name)
            self.booked -= self.gpus_of.get(name, 0.0)
        self.gone[name] = p.metadata.uid
        self.changed_at = time.monotonic()


def latency(created: dict[str, float], bound_at: dict[str, float], names: list[str]) -> dict[str, Any]:
    seen = [bound_at[n] - created[n] for n in names if n in bound_at and n in created]
    return {
        "pods": len(names),
        "bound": len(seen),
        "p50_ms": round(1000 * statistics.median(seen), 1) if seen else None,
        "p99_ms": round(1000 * percentile(seen, 0.99), 1) if seen else None,
    }


async def prepare(client: Any, args: argparse.Namespace, shape: NodeShape) -> list[Node]:
    """Nodes, the Queue CRD and tree, the PriorityClasses, the namespace; the nodes as listed."""
    await create_sim_nodes(client, count=args.nodes, shape=shape, zones=ZONES, concurrency=32)
    await install_queue_crd(client)
    for queue in queue_objects(gpus=args.nodes * args.gpus, gpu_mib=shape.mib):
        await client.create(queue)
    for name, value in PRIORITIES.items():
        await client.create(PriorityClass(metadata=ObjectMeta(name=name), value=value))
    await client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
    return [n async for n in client.list(Node, chunk_size=1000)]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpufrac-bench-"))
    shape = NodeShape(gpus=args.gpus, model=args.model)
    gpus = args.nodes * args.gpus
    fill = fill_mix(total_gpus=args.fill * gpus, gpu_mib=shape.mib)
    burst = burst_mix(args.burst, gpu_mib=shape.mib)
    every = fill + burst
    cls_of = {p.pod.metadata.name: p.cls for p in every}
    result: dict[str, Any] = {
        "bench": "mixed_load",
        "nodes": args.nodes,
        "gpus": gpus,
        "policy": args.policy or "default",
        "fill_pods": len(fill),
        "fill_gpus_asked": round(sum(p.gpus for p in fill), 1),
        "burst_pods": len(burst),
        "burst_gpus_asked": round(sum(p.gpus for p in burst), 1),
        "rate": args.rate,
        "load_before": os.getloadavg()[0],
    }
    settings: dict[str, Any] = {"policy": args.policy} if args.policy else {}
    with ControlPlane(data_dir=workdir / "cp") as cp:
        client = cp.async_client(timeout=60)
        try:
            started = time.monotonic()
            nodes = await prepare(client, args, shape)
            result["setup_s"] = round(time.monotonic() - started, 1)
            tracker = Tracker({p.pod.metadata.name: p.gpus for p in every})
            informer: Informer[Pod] = Informer(
                client=client, resource=Pod, selection=Selection(namespace=NAMESPACE)
            )
            informer.add_handler(tracker)
            watching = asyncio.create_task(informer.run())
            with scheduler_process(
                cp, workdir=workdir, tag="mixed", settings=settings, profile=args.profile
            ) as (
                proc,
                port,
                ended,
            ):
                await wait_leading(port, proc, timeout=max(120.0, args.nodes / 10))
                await asyncio.wait_for(informer.synced.wait(), 30)
                result["scheduler_rss_idle_mib"] = round(rss_mib(proc.pid)[0], 1)
                samples_before = await scheduler_samples(port, ATTEMPTS)
                cpu_before = {
                    "scheduler": cpu_seconds(proc.pid),
                    "cp": cpu_seconds(cp.pid),
                    "bench": cpu_seconds(os.getpid()),
                }
                machine_before = machine_cpu()
                problems: list[str] = []
                audits = [0]
                auditing = asyncio.create_task(
                    auditor(
                        client,
                        args.audit_every,
                        problems,
                        audits,
                        snapshot=lambda: list(informer.store),
                        nodes=nodes,
                    )
                )
                fill_created_all = asyncio.Event()
                marks: dict[str, float] = {"first_create": time.monotonic()}

                async def stream() -> dict[str, float]:
                    created = await create_all(
                        client, [p.pod for p in fill], concurrency=args.concurrency, rate=args.rate
                    )
                    marks["fill_created"] = time.monotonic()
                    fill_created_all.set()
                    return created

                def near_full() -> bool:
                    quiet = time.monotonic() - tracker.changed_at > 2.0
                    return tracker.booked >= args.burst_at * gpus or (fill_created_all.is_set() and quiet)

                async def preemptors() -> dict[str, float]:
                    await wait_until(near_full, timeout=args.timeout, what="the cluster near full")
                    marks["burst_start"] = time.monotonic()
                    result["booked_at_burst"] = round(tracker.booked / gpus, 3)
                    created = await create_all(client, [p.pod for p in burst], concurrency=args.concurrency)
                    marks["burst_created"] = time.monotonic()
                    return created

                async def progress() -> None:
                    """With BENCH_VERBOSE, a line on stderr every 30 s: a long run can be watched."""
                    while True:
                        await asyncio.sleep(30)
                        line = {
                            "s": round(time.monotonic() - marks["first_create"]),
                            "seen": len(informer.store),
                            "bound": len(tracker.bound_at),
                            "gone": len(tracker.gone),
                            "booked": round(tracker.booked / gpus, 3),
                            # What a wait for the burst waits on: its pods bound, and taken by reclaim.
                            "burst_bound": sum(1 for p in burst if p.pod.metadata.name in tracker.bound_at),
                            "burst_gone": sum(1 for p in burst if p.pod.metadata.name in tracker.gone),
                            "audits": audits[0],
                        }
                        print(json.dumps(line), file=sys.stderr, flush=True)

                watching_progress = (
                    asyncio.create_task(progress()) if os.environ.get("BENCH_VERBOSE") else None
                )
                try:
                    fill_created, burst_created = await asyncio.gather(stream(), preemptors())
                    names = [p.pod.metadata.name for p in burst]
                    await wait_until(
                        lambda: all(n in tracker.bound_at or n in tracker.gone for n in names),
                        timeout=args.timeout,
                        what="the burst bound",
                    )
                    marks["burst_bound"] = time.monotonic()
                    await wait_until(
                        lambda: time.monotonic() - tracker.changed_at >= args.settle,
                        timeout=args.timeout,
                        what="settled",
                    )
                    marks["settled"] = time.monotonic()
                finally:
                    for task in (auditing, watching_progress):
                        if task is not None:
                            task.cancel()
                            await asyncio.gather(task, return_exceptions=True)
                machine_after = machine_cpu()
                window = marks["settled"] - marks["first_create"]
                cpu = {
                    "scheduler": cpu_seconds(proc.pid) - cpu_before["scheduler"],
                    "cp": cpu_seconds(cp.pid) - cpu_before["cp"],
                    "bench": cpu_seconds(os.getpid()) - cpu_before["bench"],
                }
                samples_after = await scheduler_samples(port, ATTEMPTS)
                rss, peak = rss_mib(proc.pid)
                # The victims whose Events are checked: those gone by now. The scheduler goes on deciding
                # (mid fill pods still preempt) while the bench waits for its Events, lists them and stops
                # it, and the watch below counts a pod evicted then too; its Event may come after the list.
                # An eviction's answer reaches the scheduler (which then emits the Event) after its watch
                # event reaches the bench: a second for those in flight.
                checked = dict(tracker.gone)
                await asyncio.sleep(1.0)
                (
                    result["events_written_s"],
                    result["events_dropped"],
                    result["events_failed"],
                ) = await wait_events_written(port, timeout=args.timeout)
                events = [e async for e in client.list(Event, namespace=NAMESPACE, chunk_size=2000)]
            result["scheduler_exit"] = ended["exit"]
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            created = {**fill_created, **burst_created}
            bound_at = tracker.bound_at
            last_bind = max(bound_at.values())
            span = last_bind - marks["first_create"]
            attempts = {
                r: int(grown(samples_before, samples_after, ATTEMPTS, result=r))
                for r in ("scheduled", "unschedulable", "error")
            }
            evictions = [e for e in events if e.reason in ("Preempted", "Reclaimed")]
            per_victim = Counter(e.involvedObject.uid for e in evictions)
            victims = tracker.gone
            checked_uids = set(checked.values())
            result.update(
                {
                    "fill_create_s": round(marks["fill_created"] - marks["first_create"], 1),
                    "fill_created_per_s": round(
                        len(fill) / (marks["fill_created"] - marks["first_create"]), 1
                    ),
                    "burst_start_s": round(marks["burst_start"] - marks["first_create"], 1),
                    "burst_create_s": round(marks["burst_created"] - marks["burst_start"], 1),
                    "burst_bound_s": round(marks["burst_bound"] - marks["burst_start"], 1),
                    "seconds": round(span, 1),
                    "settled_s": round(window, 1),
                    "pods_bound": len(bound_at),
                    "pods_per_s": round(len(bound_at) / span, 1),
                    "classes": {
                        c: latency(created, bound_at, [n for n, k in cls_of.items() if k == c])
                        for c in ("fill-low", "fill-mid", "burst")
                    },
                    "decisions": sum(attempts.values()),
                    "attempts": attempts,
                    "decisions_per_s": round(sum(attempts.values()) / window, 1),
                    "binds_plus_evictions_per_s": round((len(bound_at) + len(victims)) / span, 1),
                    "victims": len(victims),
                    "victims_by_class": dict(Counter(cls_of[n] for n in victims)),
                    "victims_never_seen_bound": sum(1 for n in victims if n not in bound_at),
                    "victim_events": len(evictions),
                    "victims_checked": len(checked),  # gone before the Events were waited for and listed
                    "victims_with_event": sum(1 for uid in checked_uids if uid in per_victim),
                    "victims_evicted_twice": sum(1 for n in per_victim.values() if n > 1),
                    # Which victims lack their Event (a few names, to look up in the scheduler's log).
                    "victims_without_event": sorted(n for n, uid in checked.items() if uid not in per_victim)[
                        :20
                    ],
                    # An eviction Event for a pod the watch did not see leave after being bound.
                    "evicted_not_gone": sorted(
                        {
                            e.involvedObject.name
                            for e in evictions
                            if e.involvedObject.uid not in set(victims.values())
                        }
                    )[:5],
                    "burst_preempting": len(
                        {
                            e.involvedObject.name
                            for e in events
                            if e.reason == "Preempting" and e.involvedObject.name.startswith("burst-")
                        }
                    ),
                    "events_by_reason": dict(Counter(e.reason for e in events).most_common()),
                    "scheduler_rss_mib": round(rss, 1),
                    "scheduler_peak_rss_mib": round(peak, 1),
                    "control_plane_peak_rss_mib": round(rss_mib(cp.pid)[1], 1),
                    "bench_peak_rss_mib": round(rss_mib(os.getpid())[1], 1),
                    "scheduler_cpu_ms_per_pod": round(1000 * cpu["scheduler"] / len(bound_at), 2),
                    "scheduler_cores": round(cpu["scheduler"] / window, 2),
                    "control_plane_cores": round(cpu["cp"] / window, 2),
                    "bench_client_cores": round(cpu["bench"] / window, 2),
                    "machine_cpu_busy": round(
                        (machine_after[0] - machine_before[0])
                        / max(1e-9, machine_after[1] - machine_before[1]),
                        2,
                    ),
                    "audits_during": audits[0],
                    "audit_problems_during": problems[:5],
                }
            )
            pods = [p async for p in client.list(Pod, namespace=NAMESPACE, chunk_size=2000)]
            report = audit(nodes=nodes, pods=pods)
            result["audit_ok"] = report.ok and not problems
            result["audit_problems"] = report.problems[:5]
            pending = [p for p in pods if not p.spec.nodeName]
            result["pending_by_class"] = dict(Counter(cls_of[p.metadata.name] for p in pending))
            result["booked_at_end"] = round(
                sum(b.request_mib for b in report.gpus.values())
                / sum(b.capacity_mib for b in report.gpus.values()),
                3,
            )
            result["burst_bound_at_end"] = sum(
                1 for p in pods if cls_of[p.metadata.name] == "burst" and p.spec.nodeName
            )
            result["burst_taken"] = sum(1 for n in tracker.gone if cls_of[n] == "burst")
            queues = {}
            for leaf in LEAVES:
                status = (await client.get(GpufracQueue, leaf)).status or {}
                queues[leaf] = {
                    "deserved_mib": status.get("deserved", {}).get("gpuMemory"),
                    "allocated_mib": status.get("allocated", {}).get("gpuMemory"),
                }
            result["queues"] = queues
        finally:
            await client.close()
    result["load_after"] = os.getloadavg()[0]
    # Every victim has its Event, unless the scheduler's Event queue overflowed (at most that many lack one).
    result["pass"] = bool(
        result["audit_ok"]
        and result["burst_bound_at_end"] + result["burst_taken"] == args.burst
        and result["victims_evicted_twice"] == 0
        and result["victims_checked"] - result["events_dropped"]
        <= result["victims_with_event"]
        <= result["victims_checked"]
    )
    result["workdir"] = str(workdir)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--model", default="H100-80GB")
    parser.add_argument(
        "--fill", type=float, default=1.05, help="GPUs the fill asks for, times the cluster's"
    )
    parser.add_argument(
        "--burst-at",
        type=float,
        default=0.985,
        help="share of the cluster's GPUs booked when the burst starts",
    )
    parser.add_argument("--burst", type=int, help="high-priority pods in the burst (default: GPUs / 10)")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="fill pods created a second (0: as fast as possible)"
    )
    parser.add_argument("--policy", help="placement policy (default: the scheduler's own default)")
    parser.add_argument("--concurrency", type=int, default=32, help="create requests in flight")
    parser.add_argument(
        "--audit-every", type=float, default=2.0, help="seconds between audits during the run"
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds without a bind or delete that end it"
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--profile", type=Path, help="run the scheduler under cProfile (CPU time), stats to this file"
    )
    args = parser.parse_args()
    if args.burst is None:
        args.burst = max(1, args.nodes * args.gpus // 10)
    for key in ("fill", "burst_at"):
        value = getattr(args, key)
        if not 0 < value <= 2:
            parser.error(
                f"--{key.replace('_', '-')} {value} must be above 0 and at most 2 (a share of the cluster)"
            )
    result = asyncio.run(run(args))
    if os.environ.get("BENCH_VERBOSE"):
        print(json.dumps(result, indent=2), file=sys.stderr)
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
