"""End-to-end scheduling throughput and latency through the real API server.

A real control plane (testenv), N simulated GPU nodes (Node objects as the node agent publishes them),
then P fractional pods created as fast as a client can create them. ``gpufrac scheduler`` runs as its
own process, exactly as deployed (leader election on), with the default placement policy
(``gpufrac.placement.policies.DEFAULT_POLICY``, ``fgd-room``) unless ``--policy`` names another (runs
before issue #39 used ``fgd``). Measured from the API: pods/s from the creation
of the first pod to the binding of the last, per-pod latency from the start of its create request to
the moment a watch sees it bound, and the scheduler's RSS at the end. The bindings are then audited from
the API objects (no GPU over-committed, no mixed modes).

Baseline, in the same run on the same control plane: a minimal binder (a separate process too) that
binds the same kind of burst (as many pods by default) round-robin with one Binding per pod and no
placement, no annotations, no Events: the API server's own ceiling for create + bind on this machine.
The scheduler's throughput is reported against it. Each burst's pods are deleted after it, so every
burst meets a cluster holding only the nodes, and ``--rounds`` (3) rounds alternate which side goes
first; the summary is the median round's ratio, every round listed, judged against issue #39's goal
(>= 0.95 of the binder: ``goal_vs_baseline_met``) and, where short of it, with the reason the round's
figures give (``why``: the control plane's CPU per pod in each burst, and on shared cores the
scheduler's CPU beyond the binder's). The scheduler's ``Scheduled``
Events wait while its burst is being bound; before it is stopped the bench waits for them to be written
(``events_written_s``: seconds after the last bind, ``events_dropped``), so no deferred work is left
undone. (A single baseline run first, its
2,000 pods left in place, charged the scheduler's burst for a bigger API server: 0.66 instead of 0.87
at equal burst sizes, one run each.)

    .venv/bin/python bench/scheduler_e2e.py                 # 1000 nodes x 8 GPUs, 5000 pods
    .venv/bin/python bench/scheduler_e2e.py --large         # 5000 nodes x 8 GPUs, 40000 pods
    .venv/bin/python bench/scheduler_e2e.py --nodes 100 --pods 500 --baseline-pods 0   # quick look
    .venv/bin/python bench/scheduler_e2e.py --profile /tmp/sched.prof   # the scheduler under cProfile
    .venv/bin/python bench/scheduler_e2e.py --rules 0.25    # a quarter of the pods anti-affine or spread
    .venv/bin/python bench/scheduler_e2e.py --baseline-burn-ms 0.7   # the baseline spends 0.7 ms CPU a pod
    .venv/bin/python bench/scheduler_e2e.py --baseline-binds 128     # the binder's Bindings in flight (32)
    .venv/bin/python bench/scheduler_e2e.py --engine-only 1  # the placement alone, in process, 1 pod a batch

With ``--own-core`` the side being measured (the scheduler or the minimal binder, whichever runs)
gets the machine's last CPU to itself and the control plane and the bench's client the others (CPU
affinity, Linux): the layout of a deployment, where the scheduler does not run on the API server's
cores. Without it every process shares every core, and each millisecond a side spends per pod is taken
from the API server's creates.

With ``--rules`` the audit also checks the rules held: no two replicas of an anti-affine deployment on
one node, and every spread deployment within maxSkew 1 over the zones.

``bench/kube_scheduler_e2e.py`` runs this bench's bursts and scheduler rounds against the stock
kube-scheduler instead of the minimal binder (issue #39).

The last line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx2
import yaml
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.contract import keys
from gpufrac.kube.binding import bind_pod
from gpufrac.kube.client import connect
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection, create_object
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.placement.policies import DEFAULT_POLICY
from gpufrac.scheduler.booking_audit import audit

TARGET_PODS_PER_S = 100.0
#: Issue #39: the scheduler's pods/s at least this share of the minimal binder's, with the default policy.
GOAL_VS_BASELINE = 0.95

#: ``gpufrac <argv>`` under cProfile timed by the process's CPU clock: on a machine whose two cores the
#: API server shares, a wall-clock profile charges each function for the time the process sat preempted.
CPU_PROFILED = """
import cProfile, runpy, sys, time
out = sys.argv[1]
sys.argv = ["gpufrac", *sys.argv[2:]]
profiler = cProfile.Profile(time.process_time)
profiler.enable()
try:
    runpy.run_module("gpufrac", run_name="__main__")
finally:
    profiler.disable()
    profiler.dump_stats(out)
"""
ZONES = 8


def why_short(one: dict[str, Any], *, own_core: bool) -> str:
    """Why a round's scheduler burst fell short of the binder's, from what the round measured: the
    control plane's CPU per pod in each burst (what both rates are made of) and, where every process
    shares the cores, the CPU the scheduler spent per pod beyond the binder's."""
    cp_ours, cp_base = one["control_plane_cpu_ms_per_pod"], one["baseline"]["control_plane_cpu_ms_per_pod"]
    ours, base = one["scheduler_cpu_ms_per_pod"], one["baseline"]["binder_cpu_ms_per_pod"]
    control_plane = (
        f"the control plane spent {cp_ours} ms of CPU a pod in the scheduler's burst against {cp_base} in "
        f"the binder's ({cp_base / cp_ours:.2f} as many pods for the same CPU)"
    )
    if own_core:
        busy = ours * one["pods_per_s"] / 1000
        return f"{control_plane}, on cores of its own; the scheduler used {busy:.0%} of its core"
    return (
        f"every process shares the cores: the scheduler spent {ours} ms of CPU a pod against the "
        f"binder's {base}, {ours - base:.2f} ms a pod more taken from the API server's creates; "
        f"{control_plane} (--own-core: the deployed layout)"
    )


def split_cores() -> tuple[set[int], set[int]]:
    """``--own-core``'s layout: (the cores of the control plane and the bench, the measured side's own
    core). Refused with the reason on a machine of one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--own-core needs at least 2 CPUs to split; this process may use {cores}")
    return set(cores[:-1]), {cores[-1]}


def on_cores(cores: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that puts the child on ``cores`` before it execs (so every thread it starts
    inherits them), or None to leave it where its parent is."""
    if cores is None:
        return None
    return functools.partial(os.sched_setaffinity, 0, cores)


class PodBuilder(Protocol):
    """The i-th pod of a burst for ``scheduler`` in ``namespace`` (``burst``'s ``manifest``)."""

    def __call__(self, i: int, *, namespace: str, scheduler: str) -> Pod: ...


def pod_rules(i: int, *, share: float, apps: int) -> tuple[dict[str, str], dict[str, Any]]:
    """Labels and spec fields for the i-th pod when ``share`` of the pods carry pod rules (issue #19).

    Such a pod is a replica of one of ``apps`` deployments: half of the deployments have a required
    anti-affinity on the hostname against their own replicas, half a topology spread (maxSkew 1,
    DoNotSchedule) over the zones. The same mix bench/placement_speed.py times in the engine.
    """
    rng = random.Random(f"rules-{i}")
    if rng.random() >= share:
        return {}, {}
    app = rng.randrange(apps)
    labels = {"app": f"app-{app}"}
    selector = {"matchLabels": labels}
    if app % 2 == 0:
        term = {"labelSelector": selector, "topologyKey": keys.HOSTNAME_LABEL}
        anti = {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        return labels, {"affinity": {"podAntiAffinity": anti}}
    spread = {
        "maxSkew": 1,
        "topologyKey": keys.ZONE_LABEL,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": selector,
    }
    return labels, {"topologySpreadConstraints": [spread]}


def pod_manifest(i: int, *, namespace: str, scheduler: str, rules_share: float = 0.0, apps: int = 200) -> Pod:
    """The i-th pod of a burst: a mix of the contract's fractional forms (about 0.22 GPU each)."""
    kind = i % 10
    if kind < 4:
        annotations = {"gpu-fraction": random.Random(i).choice(["0.1", "0.25", "0.5"])}
    elif kind < 6:
        annotations = {"gpu-memory": "8192"}
    elif kind < 8:
        annotations = {
            keys.memory_request_key("app"): "12Gi",
            keys.memory_limit_key("app"): "24Gi",
            keys.compute_mode_key("app"): "sm-sharing",
        }
    elif kind < 9:
        annotations = {"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2"}
    else:
        annotations = {"gpu-fraction": "0.125", keys.compute_mode_key("app"): "sm-sharing"}
    labels, rules = pod_rules(i, share=rules_share, apps=apps) if rules_share else ({}, {})
    return Pod.from_dict(
        {
            "metadata": {
                "name": f"p{i:05d}",
                "namespace": namespace,
                "annotations": annotations,
                "labels": labels,
            },
            "spec": {
                **rules,
                "schedulerName": scheduler,
                "containers": [
                    {
                        "name": "app",
                        "image": "busybox",
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                    }
                ],
            },
        }
    )


def rule_violations(*, pods: list[Pod], nodes: list[Node]) -> list[str]:
    """The pod rules of ``pod_rules`` that the bindings broke, in words (empty when all held)."""
    zone_of = {n.metadata.name: (n.metadata.labels or {}).get(keys.ZONE_LABEL) for n in nodes}
    zones = sorted({z for z in zone_of.values() if z})
    replicas: dict[str, list[Pod]] = {}
    for pod in pods:
        app = (pod.metadata.labels or {}).get("app")
        if app and pod.spec.nodeName:
            replicas.setdefault(app, []).append(pod)
    problems = []
    for app, members in sorted(replicas.items()):
        if members[0].spec.affinity:
            hosts = [p.spec.nodeName for p in members]
            if len(set(hosts)) < len(hosts):
                problems.append(f"{app}: two anti-affine replicas share a node")
        else:
            counts = {z: 0 for z in zones}
            for p in members:
                counts[zone_of[p.spec.nodeName]] += 1
            if max(counts.values()) - min(counts.values()) > 1:
                problems.append(f"{app}: replicas per zone {counts} skew by more than 1")
    return problems


class BindClock:
    """Watches the namespace and notes when each pod is first seen bound."""

    def __init__(self) -> None:
        self.bound_at: dict[str, float] = {}

    def _see(self, pod: Pod) -> None:
        if pod.spec and pod.spec.nodeName and pod.metadata.name not in self.bound_at:
            self.bound_at[pod.metadata.name] = time.monotonic()

    def on_add(self, pod: Pod) -> None:
        self._see(pod)

    def on_update(self, old: Pod, pod: Pod) -> None:
        self._see(pod)

    def on_delete(self, pod: Pod) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ms_per_pod(pid: int, before: float, pods: int) -> float:
    """Milliseconds of CPU ``pid`` has used since ``before`` (its ``cpu_seconds``), per pod."""
    return round(1000 * (cpu_seconds(pid) - before) / pods, 2)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all the machine's cores so far, from /proc/stat (idle and iowait are not
    busy)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return float(sum(fields) - fields[3] - fields[4]), float(sum(fields))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def create_pods(
    client: AsyncClient, *, namespace: str, scheduler: str, count: int, concurrency: int, manifest: PodBuilder
) -> dict[str, float]:
    """Create ``count`` pods, ``concurrency`` requests in flight; when each create request started.

    Sent as the scheduler sends its Bindings (``kube.stream.create_object``: the answer is not decoded
    into a Pod): the creating client shares the machine's cores with the API server and the scheduler
    under test, and lightkube's decoding of each answer was CPU taken from both sides' creates."""
    created_at: dict[str, float] = {}
    gate = asyncio.Semaphore(concurrency)

    async def create(i: int) -> None:
        pod = manifest(i, namespace=namespace, scheduler=scheduler)
        async with gate:
            created_at[pod.metadata.name] = time.monotonic()
            await create_object(client, pod, namespace=namespace)

    await asyncio.gather(*(create(i) for i in range(count)))
    return created_at


async def burst(
    client: AsyncClient,
    *,
    namespace: str,
    scheduler: str,
    count: int,
    concurrency: int,
    timeout: float,
    rules_share: float = 0.0,
    manifest: PodBuilder | None = None,
) -> dict[str, Any]:
    """Create ``count`` pods as fast as possible and wait until every one is bound.

    The i-th pod is ``manifest(i, namespace=..., scheduler=...)`` (default: ``pod_manifest``'s mix of
    fractional forms, with ``rules_share`` of them carrying pod rules). ``machine_cpu_busy`` is the share
    of all the machine's cores that were busy from the first create to the last bind (from /proc/stat):
    near 1, every process of the run, the API server's included, was waiting for a core."""
    clock = BindClock()
    informer: Informer[Pod] = Informer(client=client, resource=Pod, selection=Selection(namespace=namespace))
    informer.add_handler(clock)
    watching = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 30)
        machine_before = machine_cpu()
        client_before = cpu_seconds(os.getpid())
        created_at = await create_pods(
            client,
            namespace=namespace,
            scheduler=scheduler,
            count=count,
            concurrency=concurrency,
            manifest=manifest or functools.partial(pod_manifest, rules_share=rules_share),
        )
        created_all = time.monotonic()
        deadline = time.monotonic() + timeout
        while len(clock.bound_at) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        machine_after = machine_cpu()
        client_cpu_s = cpu_seconds(os.getpid()) - client_before
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    bound = len(clock.bound_at)
    first = min(created_at.values())
    last = max(clock.bound_at.values()) if clock.bound_at else time.monotonic()
    latencies = [clock.bound_at[n] - t for n, t in created_at.items() if n in clock.bound_at]
    return {
        "pods": count,
        "bound": bound,
        "seconds": round(last - first, 3),
        "create_seconds": round(created_all - first, 3),
        "pods_per_s": round(bound / (last - first), 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1) if latencies else None,
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1) if latencies else None,
        "machine_cpu_busy": round(
            (machine_after[0] - machine_before[0]) / max(1e-9, machine_after[1] - machine_before[1]), 2
        ),
        # The bench's own process (the creates and the watch that times the binds), on the same cores.
        "client_cpu_ms_per_pod": round(1000 * client_cpu_s / count, 2),
    }


async def baseline_binder(
    kubeconfig: Path,
    namespace: str,
    scheduler: str,
    nodes: list[str],
    *,
    burn_ms: float = 0.0,
    in_flight: int = 32,
) -> None:
    """The baseline's binder process: round-robin Binding per pending pod, ``in_flight`` at a time,
    nothing else (but ``burn_ms`` of CPU spent before each Binding, when ``--baseline-burn-ms`` asks)."""
    client = connect(kubeconfig=kubeconfig)
    queue: asyncio.Queue[Pod] = asyncio.Queue()

    class Pending:
        def on_add(self, pod: Pod) -> None:
            if not (pod.spec and pod.spec.nodeName):
                queue.put_nowait(pod)

        def on_update(self, old: Pod, pod: Pod) -> None:
            pass

        def on_delete(self, pod: Pod) -> None:
            pass

    informer: Informer[Pod] = Informer(
        client=client,
        resource=Pod,
        selection=Selection(namespace=namespace, fields=f"spec.schedulerName={scheduler}"),
    )
    informer.add_handler(Pending())
    turn = 0

    async def worker() -> None:
        nonlocal turn
        while True:
            pod = await queue.get()
            turn += 1
            if burn_ms:
                until = time.process_time() + burn_ms / 1000
                while time.process_time() < until:
                    pass
            await bind_pod(client, name=pod.metadata.name, namespace=namespace, node=nodes[turn % len(nodes)])

    tasks = [asyncio.create_task(informer.run())] + [asyncio.create_task(worker()) for _ in range(in_flight)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()


async def remove_pods(client: AsyncClient, *, namespace: str, timeout: float = 1200.0) -> float:
    """Delete every pod of ``namespace`` at once (no kubelet runs them) and wait until the list is empty.

    The scheduler's burst then meets the API server and etcd with the objects the baseline's burst met:
    the nodes, not the baseline's thousands of bound pods on top (which cost the API server about 40 %
    more CPU per pod and the scheduler a listing of pods it does not schedule). Returns the seconds taken.
    """
    started = time.monotonic()
    while True:
        # Tens of thousands of pods outlast the client's timeout; the server stops with the request, so
        # the collection is deleted again until the list is empty.
        with contextlib.suppress(httpx2.TimeoutException):
            await client.deletecollection(Pod, namespace=namespace, grace_period=0)
        if not [p async for p in client.list(Pod, namespace=namespace, chunk_size=500)]:
            return round(time.monotonic() - started, 1)
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"pods of namespace {namespace} still listed after {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def wait_leading(port: int, proc: subprocess.Popen[bytes], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx2.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler exited with {proc.returncode}")
            with contextlib.suppress(httpx2.HTTPError):
                answer = await http.get(f"http://127.0.0.1:{port}/readyz")
                if answer.status_code == 200 and "leading" in answer.text:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError("scheduler did not start leading in time")


#: Only these families (a full scrape formats three series per GPU on the scheduler's loop).
EVENT_METRICS = [
    ("name[]", "gpufrac_scheduler_events_pending"),
    ("name[]", "gpufrac_scheduler_events_dropped"),
    ("name[]", "gpufrac_scheduler_events_failed"),
]


async def scheduler_samples(port: int, *names: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The scheduler's metric samples of the families ``names`` (a filtered scrape: the per-GPU families,
    three series per GPU, are not formatted), keyed by sample name and sorted labels."""
    async with httpx2.AsyncClient(timeout=60) as http:
        answer = await http.get(f"http://127.0.0.1:{port}/metrics", params=[("name[]", n) for n in names])
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


async def gc_passes(port: int) -> dict[str, int]:
    """The scheduler's garbage-collector passes so far, per generation (``python_gc_collections_total``)."""
    samples = await scheduler_samples(port, "python_gc_collections_total")
    return {
        dict(labels)["generation"]: int(value)
        for (name, labels), value in samples.items()
        if name == "python_gc_collections_total"
    }


LOOP_LAG = "gpufrac_event_loop_lag_seconds"


async def loop_lag_samples(port: int) -> dict[str, float]:
    """The scheduler's event-loop lag histogram (``gpufrac.process.loop_lag``): ``count``, ``sum`` and
    ``le=<bound>`` cumulative counts."""
    # A scrape by name filters samples by their own names: a histogram's are _bucket, _count and _sum.
    samples = await scheduler_samples(port, *(f"{LOOP_LAG}_{part}" for part in ("bucket", "count", "sum")))
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == f"{LOOP_LAG}_bucket":
            out[f"le={dict(labels)['le']}"] = value
        elif name in (f"{LOOP_LAG}_count", f"{LOOP_LAG}_sum"):
            out[name.rsplit("_", 1)[1]] = value
    return out


def loop_lag_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """How late the scheduler's loop ran its 0.1-s timer between two scrapes: the mean, and the share of
    samples later than 50 ms and 100 ms. Near 0: an answer from the API server was read as it came; tens
    of milliseconds: each answer also waited that long for the loop."""
    count = after.get("count", 0) - before.get("count", 0)
    if count <= 0:
        return {"samples": 0, "mean_ms": None, "over_50ms": None, "over_100ms": None}

    def later_than(bound: str) -> float:
        within = after.get(f"le={bound}", 0) - before.get(f"le={bound}", 0)
        return round((count - within) / count, 3)

    return {
        "samples": int(count),
        "mean_ms": round(1000 * (after.get("sum", 0) - before.get("sum", 0)) / count, 1),
        "over_50ms": later_than("0.05"),
        "over_100ms": later_than("0.1"),
    }


async def wait_events_written(port: int, *, timeout: float) -> tuple[float, int, int]:
    """Seconds until the scheduler has written every Event its burst left waiting (they yield to binds),
    how many it dropped and how many it could not write: the bench does not stop the scheduler on work
    it deferred."""
    start = time.monotonic()
    pending, dropped, failed = -1.0, 0.0, 0.0
    async with httpx2.AsyncClient() as http:
        while time.monotonic() - start < timeout:
            with contextlib.suppress(httpx2.HTTPError):
                text = (await http.get(f"http://127.0.0.1:{port}/metrics", params=EVENT_METRICS)).text
                for line in text.splitlines():
                    if line.startswith("gpufrac_scheduler_events_pending "):
                        pending = float(line.split()[1])
                    elif line.startswith("gpufrac_scheduler_events_dropped "):
                        dropped = float(line.split()[1])
                    elif line.startswith("gpufrac_scheduler_events_failed "):
                        failed = float(line.split()[1])
                if pending == 0:
                    break
            await asyncio.sleep(0.2)
    return round(time.monotonic() - start, 1), int(dropped), int(failed)


async def baseline_round(
    cp: ControlPlane,
    client: AsyncClient,
    args: argparse.Namespace,
    *,
    names: list[str],
    workdir: Path,
    tag: str,
) -> dict[str, Any]:
    """One burst bound by the minimal binder (its own process), its pods deleted afterwards."""
    namespace = f"baseline-{tag}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    binder = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--as-baseline-binder",
            str(cp.kubeconfig),
            namespace,
            str(args.baseline_burn_ms),
            str(args.baseline_binds),
            *names[:64],
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"baseline-{tag}.log", "wb"),  # noqa: SIM115 - lives as long as the child
        preexec_fn=on_cores(args.measured_cores),
    )
    try:
        await asyncio.sleep(2.0)  # let it list and start watching
        cp_before, binder_before = cpu_seconds(cp.pid), cpu_seconds(binder.pid)
        result = await burst(
            client,
            namespace=namespace,
            scheduler="bench-baseline",
            count=args.baseline_pods,
            concurrency=args.concurrency,
            timeout=args.timeout,
            rules_share=args.rules,
        )
        result["binder_cpu_ms_per_pod"] = cpu_ms_per_pod(binder.pid, binder_before, args.baseline_pods)
        result["control_plane_cpu_ms_per_pod"] = cpu_ms_per_pod(cp.pid, cp_before, args.baseline_pods)
    finally:
        binder.send_signal(signal.SIGTERM)
        binder.wait(timeout=30)
    result["removed_s"] = await remove_pods(client, namespace=namespace)
    return result


@contextlib.contextmanager
def scheduler_process(
    cp: ControlPlane,
    *,
    workdir: Path,
    tag: str,
    settings: dict[str, Any],
    profile: Path | None = None,
    cores: set[int] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], int, dict[str, Any]]]:
    """``gpufrac scheduler`` as deployed (its own process, leader election on) with ``settings`` on top
    of the bench's: its process, its probe port, and (filled when it is stopped, by SIGTERM on leaving)
    ``{"exit": its exit code, or "killed"}``. Its log is ``scheduler-<tag>.log`` in ``workdir``;
    ``cores``, when given, the CPUs it runs on."""
    port = free_port()
    config = workdir / f"scheduler-{tag}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **settings,
                "http_host": "127.0.0.1",
                "http_port": port,
                # Generous lease timing: on a shared machine a replica starved of CPU for 10 s
                # loses the default lease and the run ends without a figure.
                "leader_election": {
                    "lease_namespace": "default",
                    "lease_duration_s": 60,
                    "renew_deadline_s": 45,
                    "retry_period_s": 5,
                },
                # The simulated nodes have no node agent re-writing their heartbeat, and node
                # setup plus the baseline can outlast its expiry.
                "node_heartbeat_expiry_s": None,
            }
        )
    )
    command = ["scheduler", "--config", str(config), "--kubeconfig", str(cp.kubeconfig)]
    start = (
        [sys.executable, "-c", CPU_PROFILED, str(profile), *command]
        if profile
        else [sys.executable, "-m", "gpufrac", *command]
    )
    ended: dict[str, Any] = {}
    with open(workdir / f"scheduler-{tag}.log", "wb") as log:
        proc = subprocess.Popen(start, stdout=log, stderr=subprocess.STDOUT, preexec_fn=on_cores(cores))
        try:
            yield proc, port, ended
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                ended["exit"] = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                ended["exit"] = "killed"


async def scheduler_round(
    cp: ControlPlane,
    client: AsyncClient,
    args: argparse.Namespace,
    *,
    workdir: Path,
    tag: str,
    manifest: PodBuilder | None = None,
    before_burst: Callable[[str], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """One burst placed and bound by ``gpufrac scheduler`` (started for it, as deployed), audited from the
    API objects, its pods deleted afterwards. ``manifest`` builds the pods (``burst``'s default: the
    fractional mix); ``before_burst`` prepares the namespace (the claims the pods use), untimed."""
    namespace = f"bench-{tag}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    if before_burst is not None:
        await before_burst(namespace)
    settings = {
        "policy": args.policy,
        "bind_mode": args.bind_mode,
        **({"bind_concurrency": args.bind_concurrency} if args.bind_concurrency else {}),
    }
    result: dict[str, Any] = {}
    with scheduler_process(
        cp,
        workdir=workdir,
        tag=tag,
        settings=settings,
        profile=args.profile,
        cores=getattr(args, "measured_cores", None),
    ) as (proc, port, ended):
        await wait_leading(port, proc, timeout=max(120.0, args.nodes / 10))
        result["scheduler_rss_idle_mib"] = round(rss_mib(proc.pid)[0], 1)
        gc_before = await gc_passes(port)
        lag_before = await loop_lag_samples(port)
        cp_before, scheduler_before = cpu_seconds(cp.pid), cpu_seconds(proc.pid)
        measured = await burst(
            client,
            namespace=namespace,
            scheduler=keys.DEFAULT_SCHEDULER_NAME,
            count=args.pods,
            concurrency=args.concurrency,
            timeout=args.timeout,
            rules_share=args.rules,
            manifest=manifest,
        )
        result.update(measured)
        # CPU per pod holds still when the machine is shared; pods/s does not.
        result["scheduler_cpu_ms_per_pod"] = cpu_ms_per_pod(proc.pid, scheduler_before, args.pods)
        result["control_plane_cpu_ms_per_pod"] = cpu_ms_per_pod(cp.pid, cp_before, args.pods)
        gc_after = await gc_passes(port)
        result["scheduler_loop_lag"] = loop_lag_between(lag_before, await loop_lag_samples(port))
        result["scheduler_gc_passes"] = {g: n - gc_before.get(g, 0) for g, n in sorted(gc_after.items())}
        rss, peak = rss_mib(proc.pid)
        result["scheduler_rss_mib"] = round(rss, 1)
        result["scheduler_peak_rss_mib"] = round(peak, 1)
        (
            result["events_written_s"],
            result["events_dropped"],
            result["events_failed"],
        ) = await wait_events_written(port, timeout=args.timeout)
        # What the deferred Events cost once written, charged to the same pods.
        result["scheduler_cpu_ms_per_pod_with_events"] = cpu_ms_per_pod(proc.pid, scheduler_before, args.pods)
        result["control_plane_cpu_ms_per_pod_with_events"] = cpu_ms_per_pod(cp.pid, cp_before, args.pods)
    result["scheduler_exit"] = ended["exit"]
    result.update(await audit_bindings(client, namespace=namespace, rules=bool(args.rules)))
    result["removed_s"] = await remove_pods(client, namespace=namespace)
    return result


async def audit_bindings(client: AsyncClient, *, namespace: str, rules: bool = False) -> dict[str, Any]:
    """The scheduler's bindings in ``namespace`` audited from the API objects (with ``rules``, the pod
    rules of ``pod_rules`` too), and how full the GPUs it used are."""
    pods = [p async for p in client.list(Pod, namespace=namespace)]
    nodes = [n async for n in client.list(Node)]
    report = audit(nodes=nodes, pods=pods)
    broken = rule_violations(pods=pods, nodes=nodes) if rules else []
    used = [b for b in report.gpus.values() if b.pods]
    return {
        "audit_ok": report.ok and not broken,
        "audit_problems": (report.problems + broken)[:5],
        "gpus_used": len(used),
        "gpu_memory_allocated_pct": round(
            100 * sum(b.request_mib for b in used) / max(1, sum(b.capacity_mib for b in used)), 1
        ),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds of one baseline burst and one scheduler burst, the order alternating (baseline
    first in odd rounds), each burst on a cluster holding only the nodes; the summary is the median
    round's, with every round listed."""
    args.measured_cores = None
    if args.own_core:
        # Set before the control plane starts, so that it and every thread of it inherit the split.
        shared, args.measured_cores = split_cores()
        os.sched_setaffinity(0, shared)
    workdir = Path(tempfile.mkdtemp(prefix="gpufrac-bench-"))
    result: dict[str, Any] = {
        "bench": "scheduler_e2e",
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "model": args.model,
        "policy": args.policy,
        "bind_mode": args.bind_mode,
        "rules_share": args.rules,
        "baseline_burn_ms": args.baseline_burn_ms,
        "baseline_binds": args.baseline_binds,
        "measured_side_cores": sorted(args.measured_cores) if args.measured_cores else "shared",
    }
    rounds: list[dict[str, Any]] = []
    with ControlPlane(data_dir=workdir / "cp") as cp:
        client = cp.async_client(timeout=30)
        try:
            started = time.monotonic()
            names = await create_sim_nodes(
                client,
                count=args.nodes,
                shape=NodeShape(gpus=args.gpus, model=args.model),
                zones=ZONES,
                concurrency=32,
            )
            result["node_setup_s"] = round(time.monotonic() - started, 1)
            for number in range(1, args.rounds + 1):
                one: dict[str, Any] = {"round": number}
                sides = ["baseline", "scheduler"] if number % 2 else ["scheduler", "baseline"]
                for side in sides:
                    if side == "baseline" and args.baseline_pods:
                        one["baseline"] = await baseline_round(
                            cp, client, args, names=names, workdir=workdir, tag=str(number)
                        )
                    elif side == "scheduler":
                        one.update(await scheduler_round(cp, client, args, workdir=workdir, tag=str(number)))
                if "baseline" in one and one["baseline"]["pods_per_s"]:
                    one["vs_baseline"] = round(one["pods_per_s"] / one["baseline"]["pods_per_s"], 2)
                print(json.dumps(one, separators=(",", ":")), file=sys.stderr, flush=True)
                rounds.append(one)
        finally:
            await client.close()
    ranked = sorted(rounds, key=lambda r: r.get("vs_baseline", r["pods_per_s"]))
    result.update(ranked[len(ranked) // 2])  # the median round (the upper one of an even count)
    result.pop("round")
    if len(rounds) > 1:
        result["rounds"] = [
            {
                k: r.get(k)
                for k in ("round", "vs_baseline", "pods_per_s", "p99_ms", "scheduler_cpu_ms_per_pod")
            }
            | ({"baseline_pods_per_s": r["baseline"]["pods_per_s"]} if "baseline" in r else {})
            for r in rounds
        ]
    result["audit_ok"] = all(r["audit_ok"] for r in rounds)
    if "vs_baseline" in result:
        result["goal_vs_baseline"] = GOAL_VS_BASELINE
        result["goal_vs_baseline_met"] = result["vs_baseline"] >= GOAL_VS_BASELINE
        if not result["goal_vs_baseline_met"]:
            result["why"] = why_short(result, own_core=bool(args.measured_cores))
    result["target_pods_per_s"] = TARGET_PODS_PER_S
    result["pass"] = bool(
        all(r.get("bound") == args.pods for r in rounds)
        and result["pods_per_s"] >= TARGET_PODS_PER_S
        and result["audit_ok"]
    )
    result["workdir"] = str(workdir)
    return result


def engine_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-only BATCH``: the scheduler burst's pods through the scheduler's placement engine in this
    process, ``BATCH`` pods per ``Engine.schedule`` call, with no API server: the CPU the placement itself
    takes per pod (process CPU time), apart from the reads, binds and Events around it, and a digest of
    every decision, so a change meant only to be faster can show it placed every pod alike. The nodes
    and pods are the bench's own (``sim_node``, ``pod_manifest``), read as the scheduler reads them."""
    from gpufrac.local.simnodes import node_names, sim_node
    from gpufrac.placement.decision import Placement
    from gpufrac.placement.model import ModePolicy
    from gpufrac.scheduler.config import SchedulerConfig
    from gpufrac.scheduler.objects import gpu_request, node_spec, pending_pod
    from gpufrac.scheduler.placement_engine import build_engine

    engine = build_engine(SchedulerConfig(policy=args.policy))
    shape = NodeShape(gpus=args.gpus, model=args.model)
    for i, name in enumerate(node_names(args.nodes)):
        engine.add_node(
            node_spec(sim_node(name=name, shape=shape, labels={keys.ZONE_LABEL: f"zone-{i % ZONES}"}))
        )
    pending = []
    for i in range(args.pods):
        pod = pod_manifest(i, namespace="bench", scheduler="gpufrac", rules_share=args.rules)
        pod.metadata.uid = f"uid-{i:05d}"
        pending.append(
            pending_pod(
                pod, gpu=gpu_request(pod), arrival=i, default_queue="default", mode_policy=ModePolicy.REQUIRED
            )
        )
    digest = hashlib.sha256()
    placed = 0
    started = time.process_time()
    for first in range(0, len(pending), args.engine_only):
        for decision in engine.schedule(pending[first : first + args.engine_only]):
            placed += isinstance(decision, Placement)
            digest.update(repr(decision).encode())
    cpu = time.process_time() - started
    return {
        "bench": "scheduler_e2e",
        "engine_only": True,
        "policy": args.policy,
        "nodes": args.nodes,
        "pods": args.pods,
        "batch": args.engine_only,
        "placed": placed,
        "engine_cpu_ms_per_pod": round(1000 * cpu / max(args.pods, 1), 3),
        "decisions_sha256": digest.hexdigest()[:16],
        "load": os.getloadavg()[0],
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--as-baseline-binder":
        kubeconfig, namespace, burn, binds, *nodes = sys.argv[2:]
        binder = baseline_binder(
            Path(kubeconfig), namespace, "bench-baseline", nodes, burn_ms=float(burn), in_flight=int(binds)
        )
        asyncio.run(binder)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--model", default="H100-80GB")
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument(
        "--baseline-pods", type=int, help="pods in the baseline's burst (default: as many as --pods; 0: none)"
    )
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"the scheduler's placement policy ({DEFAULT_POLICY})"
    )
    parser.add_argument("--bind-mode", default="atomic", choices=["atomic", "patch-then-bind"])
    parser.add_argument(
        "--rules",
        type=float,
        default=0.0,
        help="share of pods that are replicas with a required anti-affinity or a zone spread (issue #19)",
    )
    parser.add_argument(
        "--baseline-burn-ms",
        type=float,
        default=0.0,
        help="CPU the baseline binder spends per pod before binding it (a calibration: the baseline's rate "
        "with as much CPU per pod as the scheduler spends)",
    )
    parser.add_argument(
        "--baseline-binds",
        type=int,
        default=32,
        help="Bindings the minimal binder keeps in flight (default 32; the scheduler binds 128 at a time)",
    )
    parser.add_argument(
        "--own-core",
        action="store_true",
        help="the scheduler or binder on the machine's last CPU, the control plane and the bench on the "
        "others (the deployed layout; default: every process on every core)",
    )
    parser.add_argument("--bind-concurrency", type=int, help="scheduler bind_concurrency")
    parser.add_argument("--concurrency", type=int, default=64, help="create requests in flight")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--large",
        action="store_true",
        help="5000 nodes x 8 GPUs, 40000 pods in both bursts (overrides those three options)",
    )
    parser.add_argument(
        "--profile", type=Path, help="run the scheduler under cProfile (CPU time), stats to this file"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of both bursts, their order alternating; the summary is the median round (default 3)",
    )
    parser.add_argument(
        "--engine-only",
        type=int,
        metavar="BATCH",
        help="no API server: the scheduler's pods through its engine in this process, BATCH per batch; "
        "prints the placement CPU per pod and a digest of the decisions",
    )
    args = parser.parse_args()
    if args.engine_only:
        print(json.dumps(engine_only(args), separators=(",", ":")))
        return
    if args.baseline_pods is None:
        args.baseline_pods = args.pods
    if args.large:
        args.nodes, args.pods, args.baseline_pods = 5000, 40000, 40000
        args.timeout = max(args.timeout, 1800.0)
    result = asyncio.run(run(args))
    if os.environ.get("BENCH_VERBOSE"):
        print(json.dumps(result, indent=2), file=sys.stderr)
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
