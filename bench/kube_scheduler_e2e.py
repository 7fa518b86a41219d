"""gpufrac-scheduler against the stock kube-scheduler, end to end through the same API server (issue #39).

One real control plane (testenv), ``--nodes`` simulated GPU nodes as ``bench/scheduler_e2e.py`` makes
them, each also advertising ``nvidia.com/gpu`` allocatable (what the NVIDIA device plugin publishes on a
GPU node, and all kube-scheduler can count). Each burst meets a cluster holding only the nodes, and one
scheduler runs at a time, as its own process, started for its burst:

- ours: ``gpufrac scheduler`` as deployed (leader election on), the default policy (``fgd-room``) unless
  ``--policy`` says otherwise; ``scheduler_e2e.scheduler_round`` runs it, audits its bindings from the API
  objects and deletes the pods;
- the peer: testenv's ``kube-scheduler`` binary (the Kubernetes release the API server is built from),
  its stock plugins and profile, leader election off and the client's QPS and burst raised to 5000, as
  upstream's scheduler_perf sets them (test/integration/scheduler_perf/util.go, ``mustSetupCluster``);
  without that, client-go's default 50 QPS caps it at about 50 binds/s on any machine.

Scenarios (``--scenarios``, both by default), the pods otherwise alike (100m CPU, 256Mi, the managed
taint tolerated, which kube-scheduler needs to reach the nodes at all):

- ``whole``: one whole GPU per pod (``resources.limits nvidia.com/gpu: 1``) on both sides;
- ``fraction``: ``gpu-fraction: "0.5"`` on gpufrac against one whole GPU per pod on kube-scheduler, what
  a cluster without fractions has to ask for the same workload;
- ``claims`` (not in the default list): DRA, the same ResourceClaim per pod on both sides, a share of one
  GPU's memory as consumable capacity (``dra_claims``: 10/20/40Gi of an 80Gi GPU in turn), every node
  publishing gpufrac's ResourceSlice, the chart's DeviceClasses; kube-scheduler's DRA allocator
  (DynamicResources, ``DRAConsumableCapacity``: kube-scheduler gets the API server's feature gates,
  ``gpufrac.local.featuregates``) against gpufrac's claim path (``gpufrac.scheduler.claims``). Each side
  also reports the allocation's quality from the claims' ``status.allocation``: GPUs and nodes used for
  the same claims, claims per used GPU, no device over its memory.

Per burst (``scheduler_e2e.burst``): pods/s from the first create to the last bind, each pod's latency
from the start of its create request to a watch seeing it bound (p50, p99), and the scheduler process's
CPU per pod (/proc/<pid>/stat utime + stime, before the first create and at the last bind). ``--rounds``
rounds per scenario, the order alternating (kube-scheduler first in odd rounds); the summary gives each
side's medians over the rounds, the ratios of those medians (ours / theirs) and every round.

``--mode backlog`` takes the create path out: each side's pods are all created while no scheduler runs,
then its scheduler is started on them; ``pods_per_s`` is then its drain rate from the first bind to the
last, ``first_bind_s`` how long after its process started the first pod was bound, CPU per pod counted
from the first bind, with the CPU before it apart (its start, and for gpufrac the first batch it placed
before binding any pod; no latency is measured). On a machine where the API server and the creating
client keep both schedulers waiting, this is the figure that tells the schedulers apart.

What limits each side is said per round (``limited_by``), from: how long after the last create the last
bind came (near 0: the creates, not the scheduler, set the pace), the machine's busy share of all its
cores (/proc/stat), each process's CPU in cores, and for kube-scheduler its own metrics endpoint
(``scheduler_scheduling_algorithm_duration_seconds``: how busy its one-pod-at-a-time scheduling loop was
with filters and scores; ``rest_client_rate_limiter_duration_seconds``: client-side throttling;
``rest_client_request_duration_seconds``: the API server's answer time for its POSTs, Bindings and
Events; ``scheduler_pod_scheduling_sli_duration_seconds``: a pod's time from its queue to bound).
``--profile DIR`` runs ours under cProfile (CPU time) and adds its top functions to each round (a
profile run is slower: take its shares, not its pods/s).

    .venv/bin/python bench/kube_scheduler_e2e.py        # 1000 nodes x 8 GPUs, 5000-pod bursts, 3 rounds
    .venv/bin/python bench/kube_scheduler_e2e.py --nodes 200 --pods 1000 --rounds 3     # a quick look
    .venv/bin/python bench/kube_scheduler_e2e.py --mode backlog    # the drain rates, no create path
    .venv/bin/python bench/kube_scheduler_e2e.py --rules 0.25      # a quarter anti-affine or spread
    .venv/bin/python bench/kube_scheduler_e2e.py --scenarios claims --nodes 500 --pods 2000   # DRA
    .venv/bin/python bench/kube_scheduler_e2e.py --scenarios whole --profile /tmp/prof  # what limits ours

Goals (issue #39): ours >= 2x kube-scheduler's pods/s and <= 0.25x its p99. The last line is a one-line
JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

import dra_claims
from gpufrac.contract import keys
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.featuregates import feature_gates_flag
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.placement.policies import DEFAULT_POLICY
from scheduler_e2e import (
    ZONES,
    BindClock,
    PodBuilder,
    audit_bindings,
    burst,
    cpu_ms_per_pod,
    cpu_seconds,
    create_pods,
    free_port,
    machine_cpu,
    pod_rules,
    remove_pods,
    rule_violations,
    scheduler_process,
    scheduler_round,
    wait_leading,
)

ROOT = Path(__file__).resolve().parents[1]
KUBE_SCHEDULER = ROOT / "testenv" / "bin" / "kube-scheduler"
KUBE_SCHEDULER_NAME = "default-scheduler"
#: upstream scheduler_perf's client for its scheduler (util.go, mustSetupCluster: QPS 5000, Burst 5000).
CLIENT_QPS = 5000
CLIENT_BURST = 5000
GOAL_PODS_PER_S_RATIO = 2.0
GOAL_P99_RATIO = 0.25
RULE_APPS = 200


# -- pods -------------------------------------------------------------------------------------------------


def _pod(
    i: int, *, namespace: str, scheduler: str, annotations: dict[str, str], limits: dict[str, str]
) -> Pod:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    if limits:
        resources["limits"] = limits
    return Pod.from_dict(
        {
            "metadata": {"name": f"p{i:05d}", "namespace": namespace, "annotations": annotations},
            "spec": {
                "schedulerName": scheduler,
                "tolerations": [keys.managed_toleration()],
                "containers": [{"name": "app", "image": "busybox", "resources": resources}],
            },
        }
    )


def whole_gpu_pod(i: int, *, namespace: str, scheduler: str) -> Pod:
    """One whole GPU, as the device plugin's resource: the only GPU request kube-scheduler understands."""
    return _pod(i, namespace=namespace, scheduler=scheduler, annotations={}, limits={keys.GPU_RESOURCE: "1"})


def half_gpu_pod(i: int, *, namespace: str, scheduler: str) -> Pod:
    """Half a GPU in the contract's pod-level form (KAI's ``gpu-fraction``)."""
    return _pod(i, namespace=namespace, scheduler=scheduler, annotations={"gpu-fraction": "0.5"}, limits={})


def with_rules(build: PodBuilder, *, share: float) -> PodBuilder:
    """``build``'s pods, ``share`` of them replicas with a required anti-affinity or a zone spread
    (``scheduler_e2e.pod_rules``, the mix of issue #19), the same pods on both sides."""

    def rules(i: int, *, namespace: str, scheduler: str) -> Pod:
        body = build(i, namespace=namespace, scheduler=scheduler).to_dict()
        labels, spec = pod_rules(i, share=share, apps=RULE_APPS)
        body["metadata"]["labels"] = labels
        body["spec"] |= spec
        return Pod.from_dict(body)

    return rules


@dataclass(frozen=True)
class Scenario:
    name: str
    ours: PodBuilder
    theirs: PodBuilder
    about: str
    #: Pods that use DRA claims (``dra_claims``): the claims are created before each burst and audited
    #: and released after it, the ResourceSlices and DeviceClasses published with the nodes.
    claims: bool = False


SCENARIOS = {
    "whole": Scenario("whole", whole_gpu_pod, whole_gpu_pod, "nvidia.com/gpu: 1 on both"),
    "fraction": Scenario(
        "fraction",
        half_gpu_pod,
        whole_gpu_pod,
        'gpu-fraction "0.5" on gpufrac, nvidia.com/gpu: 1 on kube-scheduler',
    ),
    "claims": Scenario(
        "claims",
        dra_claims.claim_pod,
        dra_claims.claim_pod,
        "the same ResourceClaim per pod on both (one device of time-slicing.gpu.gpufrac.io, "
        f"capacity.requests.memory {'/'.join(dra_claims.CLAIM_MEMORY)} in turn)",
        claims=True,
    ),
}


# -- kube-scheduler ---------------------------------------------------------------------------------------


def kube_scheduler_config(kubeconfig: Path) -> dict[str, Any]:
    """The stock configuration with scheduler_perf's client limits and no leader election."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": CLIENT_QPS, "burst": CLIENT_BURST},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": KUBE_SCHEDULER_NAME}],
    }


def kube_scheduler_version() -> str:
    answer = subprocess.run([str(KUBE_SCHEDULER), "--version"], capture_output=True, text=True, check=True)
    return answer.stdout.strip().removeprefix("Kubernetes ")


@contextlib.contextmanager
def kube_scheduler_process(
    cp: ControlPlane, *, workdir: Path, tag: str
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """kube-scheduler serving its probes and metrics on a free local port (to anyone: those paths skip
    authorization, and the bench has no token to show), stopped by SIGTERM on leaving."""
    port = free_port()
    config = workdir / f"kube-scheduler-{tag}.yaml"
    config.write_text(yaml.safe_dump(kube_scheduler_config(cp.kubeconfig)))
    command = [
        str(KUBE_SCHEDULER),
        f"--config={config}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--authentication-kubeconfig={cp.kubeconfig}",
        f"--authorization-kubeconfig={cp.kubeconfig}",
        "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
        "-v=1",
    ]
    command += [gates] if (gates := feature_gates_flag()) else []  # the API server's own gates
    with open(workdir / f"kube-scheduler-{tag}.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc, port
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


async def wait_kube_ready(port: int, proc: subprocess.Popen[bytes], *, timeout: float) -> None:
    """Until kube-scheduler's /readyz answers 200 (its informers synced and its handlers registered)."""
    deadline = time.monotonic() + timeout
    async with httpx2.AsyncClient(verify=False) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kube-scheduler exited with {proc.returncode}")
            with contextlib.suppress(httpx2.HTTPError):
                if (await http.get(f"https://127.0.0.1:{port}/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError("kube-scheduler was not ready in time")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(port: int) -> Samples:
    async with httpx2.AsyncClient(verify=False, timeout=30) as http:
        text = (await http.get(f"https://127.0.0.1:{port}/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def grown(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much the samples named ``name`` (with ``labels`` among theirs) grew, summed."""
    wanted = set(labels.items())
    return sum(
        value - before.get(key, 0.0)
        for key, value in after.items()
        if key[0] == name and wanted <= set(key[1])
    )


def peer_metrics(before: Samples, after: Samples, *, seconds: float) -> dict[str, Any]:
    """What kube-scheduler's own metrics say about the burst: its scheduling algorithm's time per pod
    (filters and scores, in its one scheduling loop) and how busy that loop was, an attempt's mean time
    with the asynchronous binding, the mean time a pod spent in the scheduler from entering its queue to
    bound (the SLI), client-side throttling, and the API server's answer time for its POSTs."""

    def mean_ms(name: str, **labels: str) -> float | None:
        count = grown(before, after, f"{name}_count", **labels)
        return round(1000 * grown(before, after, f"{name}_sum", **labels) / count, 2) if count else None

    algorithm_s = grown(before, after, "scheduler_scheduling_algorithm_duration_seconds_sum")
    return {
        "scheduled": int(grown(before, after, "scheduler_schedule_attempts_total", result="scheduled")),
        "algorithm_ms_per_pod": mean_ms("scheduler_scheduling_algorithm_duration_seconds"),
        "algorithm_busy": round(algorithm_s / seconds, 2) if seconds else None,
        "attempt_ms_mean": mean_ms("scheduler_scheduling_attempt_duration_seconds"),
        "in_scheduler_ms_mean": mean_ms("scheduler_pod_scheduling_sli_duration_seconds"),
        "client_throttle_s": round(grown(before, after, "rest_client_rate_limiter_duration_seconds_sum"), 2),
        "posts": int(grown(before, after, "rest_client_request_duration_seconds_count", verb="POST")),
        "post_ms_mean": mean_ms("rest_client_request_duration_seconds", verb="POST"),
    }


def gpus_overbooked(*, pods: list[Pod], nodes: list[Node]) -> list[str]:
    """Nodes whose bound pods ask for more ``nvidia.com/gpu`` than they advertise, in words."""
    asked: Counter[str] = Counter()
    for pod in pods:
        if pod.spec.nodeName:
            for c in pod.spec.containers:
                asked[pod.spec.nodeName] += int(
                    ((c.resources and c.resources.limits) or {}).get(keys.GPU_RESOURCE, 0)
                )
    have = {n.metadata.name: int((n.status.allocatable or {}).get(keys.GPU_RESOURCE, 0)) for n in nodes}
    return [
        f"{node}: {n} GPUs asked, {have.get(node, 0)} allocatable"
        for node, n in asked.items()
        if n > have.get(node, 0)
    ]


async def kube_round(
    cp: ControlPlane,
    client: AsyncClient,
    args: argparse.Namespace,
    *,
    scenario: Scenario,
    workdir: Path,
    tag: str,
) -> dict[str, Any]:
    """One burst placed and bound by kube-scheduler (started for it), checked, its pods deleted."""
    namespace = f"kube-{tag}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    if scenario.claims:
        await dra_claims.create_claims(client, namespace=namespace, count=args.pods)
    result: dict[str, Any] = {}
    with kube_scheduler_process(cp, workdir=workdir, tag=tag) as (proc, port):
        await wait_kube_ready(port, proc, timeout=max(120.0, args.nodes / 10))
        before = await scrape(port)
        cp_before, sched_before = cpu_seconds(cp.pid), cpu_seconds(proc.pid)
        result.update(
            await burst(
                client,
                namespace=namespace,
                scheduler=KUBE_SCHEDULER_NAME,
                count=args.pods,
                concurrency=args.concurrency,
                timeout=args.timeout,
                manifest=scenario.theirs,
            )
        )
        result["scheduler_cpu_ms_per_pod"] = cpu_ms_per_pod(proc.pid, sched_before, args.pods)
        result["control_plane_cpu_ms_per_pod"] = cpu_ms_per_pod(cp.pid, cp_before, args.pods)
        result["metrics"] = peer_metrics(before, await scrape(port), seconds=result["seconds"])
        result["scheduler_exit"] = "running" if proc.poll() is None else proc.returncode
    pods = [p async for p in client.list(Pod, namespace=namespace)]
    nodes = [n async for n in client.list(Node)]
    problems = gpus_overbooked(pods=pods, nodes=nodes) + (
        rule_violations(pods=pods, nodes=nodes) if args.rules else []
    )
    result["audit_ok"] = not problems
    result["audit_problems"] = problems[:5]
    result["removed_s"] = await remove_pods(client, namespace=namespace)
    return result


async def backlog_round(
    cp: ControlPlane,
    client: AsyncClient,
    args: argparse.Namespace,
    *,
    side: str,
    scenario: Scenario,
    workdir: Path,
    tag: str,
) -> dict[str, Any]:
    """``--mode backlog``: the burst's pods are all created while no scheduler runs, then ``side``'s
    scheduler is started on them. ``pods_per_s`` is its drain rate, from the first bind to the last seen
    by a watch (neither its start nor the create path counts); ``first_bind_s`` is how long after its
    process started the first pod was bound; CPU per pod from the first bind to the last, and apart the
    CPU it spent before its first bind (its start, and the decisions it made before binding any pod)."""
    kube = side == "kube_scheduler"
    namespace = f"{'kube' if kube else 'bench'}-{tag}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    if scenario.claims:
        await dra_claims.create_claims(client, namespace=namespace, count=args.pods)
    await create_pods(
        client,
        namespace=namespace,
        scheduler=KUBE_SCHEDULER_NAME if kube else keys.DEFAULT_SCHEDULER_NAME,
        count=args.pods,
        concurrency=args.concurrency,
        manifest=scenario.theirs if kube else scenario.ours,
    )
    clock = BindClock()
    informer: Informer[Pod] = Informer(client=client, resource=Pod, selection=Selection(namespace=namespace))
    informer.add_handler(clock)
    watching = asyncio.create_task(informer.run())
    result: dict[str, Any] = {"pods": args.pods}
    try:
        await asyncio.wait_for(informer.synced.wait(), 30)
        with contextlib.ExitStack() as stack:
            if kube:
                proc, port = stack.enter_context(kube_scheduler_process(cp, workdir=workdir, tag=tag))
            else:
                settings = {"policy": args.policy, "bind_mode": args.bind_mode}
                if args.bind_concurrency:
                    settings["bind_concurrency"] = args.bind_concurrency
                proc, port, _ = stack.enter_context(
                    scheduler_process(cp, workdir=workdir, tag=tag, settings=settings, profile=args.profile)
                )
            started = time.monotonic()
            while not clock.bound_at and time.monotonic() - started < args.timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"{side} exited with {proc.returncode}")
                await asyncio.sleep(0.01)
            cp_before, sched_before, machine_before = (
                cpu_seconds(cp.pid),
                cpu_seconds(proc.pid),
                machine_cpu(),
            )
            before = await scrape(port) if kube else {}
            deadline = time.monotonic() + args.timeout
            while len(clock.bound_at) < args.pods and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            machine_after = machine_cpu()
            after = await scrape(port) if kube else {}
            result["scheduler_cpu_ms_per_pod"] = cpu_ms_per_pod(proc.pid, sched_before, args.pods)
            result["control_plane_cpu_ms_per_pod"] = cpu_ms_per_pod(cp.pid, cp_before, args.pods)
            # Its start and what it decided before its first bind (gpufrac places a batch first).
            result["scheduler_cpu_s_to_first_bind"] = round(sched_before, 2)
            if not kube:
                await wait_leading(port, proc, timeout=10)  # it was: it bound pods; and it still is
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
    first, last = min(clock.bound_at.values()), max(clock.bound_at.values())
    result |= {
        "bound": len(clock.bound_at),
        "seconds": round(last - first, 3),
        "pods_per_s": round((len(clock.bound_at) - 1) / max(1e-9, last - first), 1),
        "first_bind_s": round(first - started, 2),
        "p50_ms": None,
        "p99_ms": None,
        "machine_cpu_busy": round(
            (machine_after[0] - machine_before[0]) / max(1e-9, machine_after[1] - machine_before[1]), 2
        ),
    }
    if kube:
        result["metrics"] = peer_metrics(before, after, seconds=result["seconds"])
        pods = [p async for p in client.list(Pod, namespace=namespace)]
        nodes = [n async for n in client.list(Node)]
        problems = gpus_overbooked(pods=pods, nodes=nodes)
        problems += rule_violations(pods=pods, nodes=nodes) if args.rules else []
        result["audit_ok"], result["audit_problems"] = not problems, problems[:5]
    else:
        result.update(await audit_bindings(client, namespace=namespace, rules=bool(args.rules)))
    result["removed_s"] = await remove_pods(client, namespace=namespace)
    return result


# -- what limits a side -----------------------------------------------------------------------------------


#: A loop whose 0.1-s timer ran this late on average, or this share of the time later than 50 ms, held
#: the answers to its writes back itself (``scheduler_e2e.loop_lag_between``).
LOOP_BUSY_MS = 20.0
LOOP_BUSY_SHARE = 0.2


def limited_by(side: dict[str, Any]) -> str:
    """One sentence on what set a burst's pace, from the figures of its round (see the module's doc)."""
    seconds, pods = side["seconds"], side["pods"]
    tail = max(0.0, seconds - side["create_seconds"]) if "create_seconds" in side else None
    cores = side["scheduler_cpu_ms_per_pod"] * pods / 1000 / seconds
    api = side["control_plane_cpu_ms_per_pod"] * pods / 1000 / seconds
    busy = side["machine_cpu_busy"]
    usage = f"scheduler {cores:.2f} cores, API server {api:.2f}, machine {busy:.0%} busy"
    metrics = side.get("metrics") or {}
    if metrics.get("client_throttle_s", 0) > 0.05 * seconds:
        return f"client-side rate limiting ({metrics['client_throttle_s']} s waited; {usage})"
    if tail is not None and tail < 0.1 * seconds:
        return f"the creates: last bind {tail:.1f} s after the last create, the scheduler kept up ({usage})"
    if (metrics.get("algorithm_busy") or 0) >= 0.8:
        return (
            f"its scheduling loop, one pod at a time: the algorithm busy {metrics['algorithm_busy']:.0%} of "
            f"the burst, {metrics['algorithm_ms_per_pod']} ms a pod ({usage})"
        )
    if busy >= 0.9:
        return f"the machine's CPU ({usage})"
    if cores >= 0.9:
        return f"its own CPU, one core ({usage})"
    lag = side.get("scheduler_loop_lag") or {}
    if lag.get("mean_ms") is not None:
        loop = f"loop lag {lag['mean_ms']} ms mean, {lag['over_50ms']:.0%} of samples over 50 ms"
        if lag["mean_ms"] >= LOOP_BUSY_MS or lag["over_50ms"] >= LOOP_BUSY_SHARE:
            return f"its own event loop: each answer also waited for the loop ({loop}; {usage})"
        usage = f"{usage}; {loop}: answers read as they came"
    return f"waiting on the API server ({usage})"


IMPORTING = frozenset(
    f"<built-in method {m}>"
    for m in ("builtins.exec", "builtins.compile", "marshal.loads", "_imp.create_dynamic")
)


def profile_area(file: str, name: str) -> str:
    """Where a profiled function lives: a gpufrac package, asyncio, ssl, msgspec, another library or
    the rest of the standard library; C built-ins by the module their name gives. Importing modules at
    start is ``imports``."""
    if file.startswith("<frozen") or name in IMPORTING:
        return "imports"
    if file == "~":
        for area in ("_ssl", "msgspec", "select", "socket", "_asyncio"):
            if area in name:
                return area.strip("_")
        return "builtins"
    if "/gpufrac/" in file:
        return "gpufrac/" + file.split("/gpufrac/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    for area in ("asyncio", "ssl"):
        if f"/{area}/" in file or file.endswith(f"/{area}.py"):
            return area
    return "stdlib"


def profile_summary(path: Path, *, n: int = 8) -> dict[str, Any]:
    """A cProfile dump of gpufrac's process (its whole life, start included): the share of its CPU time
    spent importing modules (at its start: all of it, code run at import included), the share of its own
    CPU time per area (``profile_area``) and the ``n`` gpufrac functions with the most own time."""
    # {(file, line, name): (primitive calls, calls, own time, cumulative time, callers)}
    rows = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in rows.values()) or 1.0
    areas: Counter[str] = Counter()
    for (file, _, name), row in rows.items():
        areas[profile_area(file, name)] += row[2]
    ours = sorted(
        ((k, r) for k, r in rows.items() if "/gpufrac/" in k[0]), key=lambda kr: kr[1][2], reverse=True
    )
    importing = max(
        (row[3] for (file, _, name), row in rows.items() if name == "_find_and_load" and "importlib" in file),
        default=0.0,
    )
    return {
        "cpu_s": round(total, 2),
        "imports_share": round(importing / total, 3),  # its start, under the profiler, not its serving
        "areas": {a: round(t / total, 3) for a, t in areas.most_common(10)},
        "top": [
            [f"{file.split('/gpufrac/', 1)[1]}:{line}({name})", round(row[2] / total, 3)]
            for (file, line, name), row in ours[:n]
        ],
    }


# -- rounds and summary -----------------------------------------------------------------------------------

#: Each side's figures whose medians the summary gives, per ``--mode``.
SIDE_FIELDS = {
    "burst": ("pods_per_s", "p50_ms", "p99_ms", "scheduler_cpu_ms_per_pod"),
    "backlog": ("pods_per_s", "first_bind_s", "scheduler_cpu_ms_per_pod"),
}


#: The allocation's quality, with claims (``dra_claims.audit_claims``).
CLAIM_FIELDS = ("gpus_used", "nodes_used", "claims_per_gpu", "gpu_memory_allocated_pct")


def brief(side: dict[str, Any]) -> dict[str, Any]:
    keep = (
        *SIDE_FIELDS["burst"],
        *CLAIM_FIELDS,
        "first_bind_s",
        "scheduler_cpu_s_to_first_bind",
        "bound",
        "seconds",
        "create_seconds",
        "machine_cpu_busy",
        "client_cpu_ms_per_pod",
        "audit_ok",
        "limited_by",
        "scheduler_loop_lag",
    )
    return {k: side[k] for k in keep if k in side} | {k: side[k] for k in ("metrics", "profile") if k in side}


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if ours is not None and theirs else None


def summarize(scenario: Scenario, rounds: list[dict[str, Any]], *, pods: int, mode: str) -> dict[str, Any]:
    """Each side's medians over the rounds, the ratios of the medians, the goals, and every round (in
    ``backlog`` mode no latency is measured, and only the pods/s goal is judged). With claims, also the
    allocation's quality: GPUs and nodes used for the same claims, claims per used GPU."""
    fields = SIDE_FIELDS[mode] + (CLAIM_FIELDS if scenario.claims else ())
    medians = {
        side: {f: statistics.median(r[side][f] for r in rounds) for f in fields}
        for side in ("gpufrac", "kube_scheduler")
    }
    ours, theirs = medians["gpufrac"], medians["kube_scheduler"]
    speed = ratio(ours["pods_per_s"], theirs["pods_per_s"])
    tail = ratio(ours.get("p99_ms"), theirs.get("p99_ms"))
    middle = sorted(rounds, key=lambda r: r["pods_per_s_ratio"] or 0)[len(rounds) // 2]
    complete = all(r[side]["bound"] == pods for r in rounds for side in ("gpufrac", "kube_scheduler"))
    audit_ok = all(r[side]["audit_ok"] for r in rounds for side in ("gpufrac", "kube_scheduler"))
    goals = {
        f"pods_per_s_ratio >= {GOAL_PODS_PER_S_RATIO}": speed is not None and speed >= GOAL_PODS_PER_S_RATIO,
    }
    if mode == "burst":
        goals[f"p99_ratio <= {GOAL_P99_RATIO}"] = tail is not None and tail <= GOAL_P99_RATIO
    return {
        "about": scenario.about,
        "gpufrac": ours | {"limited_by": middle["gpufrac"]["limited_by"]},
        "kube_scheduler": theirs | {"limited_by": middle["kube_scheduler"]["limited_by"]},
        "pods_per_s_ratio": speed,
        "p50_ratio": ratio(ours.get("p50_ms"), theirs.get("p50_ms")),
        "p99_ratio": tail,
        "cpu_per_pod_ratio": ratio(ours["scheduler_cpu_ms_per_pod"], theirs["scheduler_cpu_ms_per_pod"]),
        "goals": goals,
        "goals_met": all(goals.values()) and complete and audit_ok,
        "all_bound": complete,
        "audit_ok": audit_ok,
        "rounds": rounds,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="gpufrac-bench-peer-"))
    result: dict[str, Any] = {
        "bench": "kube_scheduler_e2e",
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "model": args.model,
        "pods": args.pods,
        "mode": args.mode,
        "rounds_per_scenario": args.rounds,
        "policy": args.policy,
        "bind_concurrency": args.bind_concurrency,  # None: the scheduler's default
        "rules_share": args.rules,
        "kube_scheduler": kube_scheduler_version(),
        "kube_scheduler_client": {"qps": CLIENT_QPS, "burst": CLIENT_BURST},
        "profiled": bool(args.profile),
        "load_before": Path("/proc/loadavg").read_text().split()[:3],
    }
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
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
            await advertise_gpus(client, names, gpus=args.gpus)
            if any(SCENARIOS[name].claims for name in args.scenarios):
                await dra_claims.publish_world(client, names, workdir=workdir)
            result["node_setup_s"] = round(time.monotonic() - started, 1)
            scenarios: dict[str, Any] = {}
            for name in args.scenarios:
                scenario = SCENARIOS[name]
                if args.rules:
                    scenario = dataclasses.replace(
                        scenario,
                        ours=with_rules(scenario.ours, share=args.rules),
                        theirs=with_rules(scenario.theirs, share=args.rules),
                    )
                rounds = [
                    await one_round(cp, client, args, scenario=scenario, number=n, workdir=workdir)
                    for n in range(1, args.rounds + 1)
                ]
                scenarios[name] = summarize(scenario, rounds, pods=args.pods, mode=args.mode)
            result["scenarios"] = scenarios
        finally:
            await client.close()
    result["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    result["goals_met"] = all(s["goals_met"] for s in result["scenarios"].values())
    result["workdir"] = str(workdir)
    return result


async def advertise_gpus(client: AsyncClient, names: list[str], *, gpus: int) -> None:
    """``nvidia.com/gpu`` in every node's capacity and allocatable, as the device plugin publishes it."""
    gate = asyncio.Semaphore(32)
    amount = {keys.GPU_RESOURCE: str(gpus)}

    async def one(name: str) -> None:
        async with gate:
            await client.patch(
                Node.Status,
                name,
                {"status": {"capacity": amount, "allocatable": amount}},
                patch_type=PatchType.MERGE,
            )

    await asyncio.gather(*(one(n) for n in names))


async def one_round(
    cp: ControlPlane,
    client: AsyncClient,
    args: argparse.Namespace,
    *,
    scenario: Scenario,
    number: int,
    workdir: Path,
) -> dict[str, Any]:
    """Both sides' bursts of one round, kube-scheduler first in odd rounds."""
    tag = f"{scenario.name}-{number}"
    one: dict[str, Any] = {"round": number}
    sides = ["kube_scheduler", "gpufrac"] if number % 2 else ["gpufrac", "kube_scheduler"]

    async def create_claims(namespace: str) -> None:
        await dra_claims.create_claims(client, namespace=namespace, count=args.pods)

    claims: Callable[[str], Awaitable[None]] | None = create_claims if scenario.claims else None
    one["first"] = sides[0]
    for side in sides:
        profile = args.profile / f"gpufrac-{tag}.prof" if args.profile and side == "gpufrac" else None
        ours = argparse.Namespace(**{**vars(args), "profile": profile})
        if args.mode == "backlog":
            measured = await backlog_round(
                cp, client, ours, side=side, scenario=scenario, workdir=workdir, tag=tag
            )
        elif side == "kube_scheduler":
            measured = await kube_round(cp, client, args, scenario=scenario, workdir=workdir, tag=tag)
        else:
            measured = await scheduler_round(
                cp, client, ours, workdir=workdir, tag=tag, manifest=scenario.ours, before_burst=claims
            )
        if scenario.claims:
            namespace = f"{'kube' if side == 'kube_scheduler' else 'bench'}-{tag}"
            report = await dra_claims.audit_and_release(client, namespace=namespace)
            measured |= report | {"audit_ok": measured["audit_ok"] and report["audit_ok"]}
            measured["audit_problems"] = measured.get("audit_problems", []) + report["audit_problems"]
        if profile:
            measured["profile"] = profile_summary(profile)
        measured["limited_by"] = limited_by(measured)
        one[side] = brief(measured)
    one["pods_per_s_ratio"] = ratio(one["gpufrac"]["pods_per_s"], one["kube_scheduler"]["pods_per_s"])
    one["p99_ratio"] = ratio(one["gpufrac"]["p99_ms"], one["kube_scheduler"]["p99_ms"])
    print(json.dumps({"scenario": scenario.name} | one, separators=(",", ":")), file=sys.stderr, flush=True)
    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--model", default="H100-80GB")
    parser.add_argument("--pods", type=int, default=5000, help="pods in every burst, on either side")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario, the order alternating")
    parser.add_argument(
        "--scenarios",
        default="whole,fraction",
        type=lambda s: [x for x in s.split(",") if x],
        help=f"comma list of {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="gpufrac's placement policy")
    parser.add_argument(
        "--mode",
        default="burst",
        choices=sorted(SIDE_FIELDS),
        help="burst: pods created while the scheduler runs (pods/s from the first create to the last bind, "
        "latency); backlog: pods created first, then the scheduler started (its drain rate alone)",
    )
    parser.add_argument(
        "--rules",
        type=float,
        default=0.0,
        help="share of the pods, on both sides, that are replicas with a required anti-affinity or a zone "
        "spread (scheduler_e2e's mix); the audits then check the rules held",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="create requests in flight")
    parser.add_argument(
        "--bind-concurrency",
        type=int,
        help="gpufrac's bind_concurrency, binds (a claim pod's claim writes included) in flight at once "
        "(default: the scheduler's own, 128)",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--profile",
        type=Path,
        help="run gpufrac under cProfile (CPU time), one dump per round in this folder",
    )
    args = parser.parse_args()
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    if args.pods > args.nodes * args.gpus:
        # kube-scheduler's side always asks one whole GPU a pod: the rest would wait out --timeout.
        parser.error(f"--pods {args.pods} whole-GPU pods do not fit {args.nodes} nodes x {args.gpus} GPUs")
    # What scheduler_e2e.scheduler_round reads besides the above: ours as that bench runs it by default.
    args.bind_mode = "atomic"
    print(json.dumps(asyncio.run(run(args)), separators=(",", ":")))


if __name__ == "__main__":
    main()
