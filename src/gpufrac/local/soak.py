"""Soak the embedded cluster: steady pod churn, injected faults, and a verdict read from the API objects.

The short soak test (tests/local/test_soak.py) and the long benchmark (bench/soak.py) run this same
code, so what the benchmark measures over half an hour is what the suite checks in three minutes.

``Churn`` creates GPU pods of several shapes (time-slicing fractions, memory requests, sm-sharing on one
and two GPUs, and one that fits no GPU so it must be explained) at a steady rate and deletes the oldest
once ``live`` exist; every API error is counted by kind and retried with the next pod, never fatal, since
faults make some calls fail on purpose. ``Faults`` injects one fault at a time: SIGKILL of the
scheduler, of a node agent or of the webhook (the supervisor must restart it), or SIGSTOP of the control
plane for a few seconds then SIGCONT (every client sees a server that hangs, then answers again). Every
``audit_every_s`` the bookings in the API objects are audited (``gpufrac.scheduler.booking_audit``): any
over-committed GPU or mixed modes is a double-booking. ``RssSampler`` reads every process's resident
memory from /proc, so growth per hour can be estimated per component.

``verdict`` says what must hold at the end: each component alive and restarted exactly as often as it
was killed (an exit nobody caused is a failure even though the supervisor recovered it), the simulated
kubelet never failed, every remaining pod placed or explained (``PodScheduled=False`` with a reason),
the audit clean, and the scheduler's ledger (its per-GPU metrics) equal to the bookings in the API
objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx2
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.contract import keys
from gpufrac.kube.errors import Conflict, KubeError, api_errors
from gpufrac.local.cluster import LocalCluster, Timings
from gpufrac.local.supervisor import Backoff, Component
from gpufrac.scheduler.booking_audit import audit

log = logging.getLogger(__name__)

NAMESPACE = "soak"
CONTAINER = "app"
#: The scheduler's per-GPU ledger as it exports it (gpufrac.scheduler.metrics).
ALLOCATED_METRIC = "gpufrac_scheduler_gpu_memory_allocated_mib"


def soak_timings() -> Timings:
    """Short periods, so a soak of minutes sees many of each (tests/local/test_soak.py says which).

    The lease: renewed every second, and a renew deadline (8 s) longer than the control-plane pause the
    soak injects (4 s), so pausing the API server is survived as in a cluster whose etcd hiccups.
    """
    return Timings(
        lease_duration_s=10.0,
        lease_renew_deadline_s=8.0,
        lease_retry_period_s=1.0,
        unschedulable_resync_s=5.0,
        node_heartbeat_s=10.0,
        node_publish_interval_s=2.0,
        kubelet_watch_timeout_s=60,
        kubelet_resync_s=10.0,
        restart=Backoff(initial_s=1.0, max_s=30.0, reset_after_s=60.0),
    )


@dataclass(frozen=True, slots=True)
class PodShape:
    name: str
    annotations: dict[str, str]


#: Several shapes, so the ledgers see both modes, fractions, memory requests and a multi-GPU pod; the
#: last fits no GPU of the embedded cluster's models, so it must always be explained.
SHAPES: tuple[PodShape, ...] = (
    PodShape("quarter", {keys.GPU_FRACTION: "0.25"}),
    PodShape("half", {keys.GPU_FRACTION: "0.5", keys.GPU_FRACTION_LIMIT: "0.75"}),
    PodShape("mem16", {keys.memory_request_key(CONTAINER): "16Gi"}),
    PodShape(
        "sm20",
        {keys.memory_request_key(CONTAINER): "20Gi", keys.compute_mode_key(CONTAINER): "sm-sharing"},
    ),
    PodShape(
        "sm2x10",
        {
            keys.memory_request_key(CONTAINER): "10Gi",
            keys.compute_mode_key(CONTAINER): "sm-sharing",
            keys.GPU_FRACTION_NUM_DEVICES: "2",
        },
    ),
    PodShape("toobig", {keys.memory_request_key(CONTAINER): "1000Gi"}),
)


def soak_pod(name: str, shape: PodShape) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=NAMESPACE, annotations=dict(shape.annotations)),
        spec=PodSpec(
            schedulerName=keys.DEFAULT_SCHEDULER_NAME,
            containers=[Container(name=CONTAINER, image="soak", command=["sleep", "infinity"])],
        ),
    )


def _error_kind(error: Exception) -> str:
    code = getattr(error, "code", None)
    return f"{type(error).__name__}{f' {code}' if code else ''}"


class Outcome(StrEnum):
    PLACED = "placed"
    EXPLAINED = "explained"
    UNDECIDED = "undecided"


def outcome(pod: Pod) -> Outcome:
    """Placed (bound to a node), explained (PodScheduled=False with a reason), or neither yet."""
    if pod.spec is not None and pod.spec.nodeName:
        return Outcome.PLACED
    conditions = (pod.status.conditions or []) if pod.status else []
    if any(c.type == "PodScheduled" and c.status == "False" and (c.reason or c.message) for c in conditions):
        return Outcome.EXPLAINED
    return Outcome.UNDECIDED


@dataclass(slots=True)
class ChurnCounts:
    created: int = 0
    deleted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    """How each deleted pod had ended (placed / explained / undecided) when it was deleted."""
    errors: Counter[str] = field(default_factory=Counter)


class Churn:
    """Create a pod every ``interval_s``, cycling through ``shapes``; keep at most ``live`` of them."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        interval_s: float = 1.0,
        live: int = 12,
        shapes: Sequence[PodShape] = SHAPES,
    ) -> None:
        assert cluster.client is not None
        self._client = cluster.client
        self._interval_s = interval_s
        self._live = live
        self._shapes = shapes
        self._names: deque[str] = deque()
        self.counts = ChurnCounts()

    async def prepare(self) -> None:
        try:
            with api_errors():
                await self._client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
        except Conflict as error:
            if not error.already_exists:
                raise

    async def run(self) -> None:
        for n in itertools.count():
            shape = self._shapes[n % len(self._shapes)]
            name = f"{shape.name}-{n}"
            try:
                with api_errors():
                    await self._client.create(soak_pod(name, shape))
                self._names.append(name)
                self.counts.created += 1
            except (KubeError, httpx2.HTTPError) as error:
                self.counts.errors[f"create: {_error_kind(error)}"] += 1
            while len(self._names) > self._live:
                await self._delete(self._names[0])
            await asyncio.sleep(self._interval_s)

    async def _delete(self, name: str) -> None:
        try:
            with api_errors():
                pod = await self._client.get(Pod, name, namespace=NAMESPACE)
                self.counts.outcomes[outcome(pod)] += 1
                # No kubelet confirms a graceful deletion here: remove the object at once.
                await self._client.delete(Pod, name, namespace=NAMESPACE, grace_period=0)
            self._names.popleft()
            self.counts.deleted += 1
        except (KubeError, httpx2.HTTPError) as error:
            if getattr(error, "code", None) == 404:
                self._names.popleft()
                return
            self.counts.errors[f"delete: {_error_kind(error)}"] += 1
            await asyncio.sleep(self._interval_s)


class Fault(StrEnum):
    KILL_SCHEDULER = "kill-scheduler"
    KILL_NODE_AGENT = "kill-node-agent"
    KILL_WEBHOOK = "kill-webhook"
    PAUSE_APISERVER = "pause-apiserver"


@dataclass(frozen=True, slots=True)
class Injected:
    fault: Fault
    target: str
    at_s: float


class Faults:
    """Inject faults into a running cluster and remember whom each one hit."""

    def __init__(self, cluster: LocalCluster, *, pause_s: float = 4.0) -> None:
        self._cluster = cluster
        self._pause_s = pause_s
        self._started = time.monotonic()
        self._agents = itertools.cycle(cluster.shape.node_names)
        self.injected: list[Injected] = []

    def kills(self) -> Counter[str]:
        """How often each component was SIGKILLed on purpose."""
        return Counter(i.target for i in self.injected if i.fault is not Fault.PAUSE_APISERVER)

    async def inject(self, fault: Fault) -> None:
        at = time.monotonic() - self._started
        if fault is Fault.PAUSE_APISERVER:
            pid = self._cluster.controlplane.pid
            self.injected.append(Injected(fault=fault, target="controlplane", at_s=at))
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(self._pause_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            return
        target = {
            Fault.KILL_SCHEDULER: "scheduler",
            Fault.KILL_WEBHOOK: "admission",
            Fault.KILL_NODE_AGENT: f"node-agent-{next(self._agents)}",
        }[fault]
        component = self._cluster.components[target]
        self.injected.append(Injected(fault=fault, target=target, at_s=at))
        os.kill(component.pid, signal.SIGKILL)


def rss_kib(pid: int) -> int | None:
    """A process's resident memory (VmRSS) in KiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass(slots=True)
class RssSeries:
    """RSS samples of one component, one list per process (a restart starts a new life)."""

    pid: int = 0
    lives: list[list[tuple[float, int]]] = field(default_factory=list)

    def add(self, *, pid: int, at: float, kib: int) -> None:
        if pid != self.pid or not self.lives:
            self.pid = pid
            self.lives.append([])
        self.lives[-1].append((at, kib))

    @property
    def last_kib(self) -> int | None:
        return self.lives[-1][-1][1] if self.lives and self.lives[-1] else None

    @property
    def sampled_s(self) -> float:
        """Seconds covered by samples, over every life."""
        return sum(life[-1][0] - life[0][0] for life in self.lives if life)

    def growth_mib_per_hour(self, *, skip_s: float) -> float | None:
        """Least-squares slope of RSS over time, pooled over the lives (each its own intercept: a
        restart's drop is not growth), each without its first ``skip_s`` (start-up, imports)."""
        covariance = variance = 0.0
        points = 0
        for life in self.lives:
            if not life:
                continue
            kept = [(t, kib) for t, kib in life if t - life[0][0] >= skip_s]
            if len(kept) < 2:
                continue
            mean_t = sum(t for t, _ in kept) / len(kept)
            mean_m = sum(m for _, m in kept) / len(kept)
            covariance += sum((t - mean_t) * (m - mean_m) for t, m in kept)
            variance += sum((t - mean_t) ** 2 for t, _ in kept)
            points += len(kept)
        if points < 3 or variance == 0:
            return None
        return covariance / variance * 3600 / 1024


class RssSampler:
    """Samples every process of the cluster (and this one, which runs the kubelet) every ``every_s``."""

    def __init__(self, cluster: LocalCluster, *, every_s: float = 5.0) -> None:
        self._cluster = cluster
        self._every_s = every_s
        self.series: dict[str, RssSeries] = {}

    def _pids(self) -> dict[str, int]:
        pids = {name: c.pid for name, c in self._cluster.components.items()}
        pids["controlplane"] = self._cluster.controlplane.pid
        pids["gpufrac-up (kubelet)"] = os.getpid()
        for node, pid in self._cluster.runtime_pids().items():
            pids[f"nri-runtime-{node}"] = pid
        return pids

    def sample(self) -> None:
        now = time.monotonic()
        for name, pid in self._pids().items():
            kib = rss_kib(pid)
            if kib is None:
                continue
            self.series.setdefault(name, RssSeries()).add(pid=pid, at=now, kib=kib)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self._every_s)

    def summary(self, *, skip_s: float) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        for name, series in sorted(self.series.items()):
            growth = series.growth_mib_per_hour(skip_s=skip_s)
            last = series.last_kib
            out[name] = {
                "rss_mib": None if last is None else round(last / 1024, 1),
                "growth_mib_per_hour": None if growth is None else round(growth, 1),
                "sampled_s": round(series.sampled_s, 1),
                "processes": len(series.lives),
            }
        return out


async def audit_problems(cluster: LocalCluster) -> tuple[list[str], dict[str, int]]:
    """The audit's problems over the API objects, and the guaranteed MiB it finds on each GPU."""
    client = cluster.client
    assert client is not None
    nodes = [n async for n in client.list(Node)]
    pods = [p async for p in client.list(Pod, namespace="*")]
    report = audit(nodes=nodes, pods=pods)
    return report.problems, {uuid: b.request_mib for uuid, b in report.gpus.items()}


async def scheduler_ledger(cluster: LocalCluster) -> dict[str, int]:
    """The scheduler's guaranteed MiB per GPU, from its /metrics."""
    assert cluster.scheduler_url is not None
    async with httpx2.AsyncClient(trust_env=False, timeout=5.0) as http:
        text = (await http.get(f"{cluster.scheduler_url}/metrics")).text
    ledger: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == ALLOCATED_METRIC:
            for sample in family.samples:
                ledger[sample.labels["gpu"]] = int(sample.value)
    return ledger


class Auditor:
    """Audits the API objects every ``every_s``; a problem seen once is a double-booking."""

    def __init__(self, cluster: LocalCluster, *, every_s: float = 15.0) -> None:
        self._cluster = cluster
        self._every_s = every_s
        self.audits = 0
        self.problems: list[str] = []
        self.errors: Counter[str] = Counter()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            try:
                problems, _ = await audit_problems(self._cluster)
            except (KubeError, httpx2.HTTPError) as error:
                self.errors[_error_kind(error)] += 1
                continue
            self.audits += 1
            self.problems.extend(problems)


def judge_exits(
    components: Mapping[str, Component], kills: Mapping[str, int]
) -> tuple[dict[str, list[str]], list[str]]:
    """Exits nobody caused, by component (each described), and kills that left no exit behind.

    A component killed n times may show n SIGKILL exits; any other exit, or a SIGKILL beyond n, is
    unexpected even though the supervisor restarted it.
    """
    unexpected: dict[str, list[str]] = {}
    missing: list[str] = []
    for name, component in components.items():
        expected = kills.get(name, 0)
        sigkills = [e for e in component.exits if e.code == -signal.SIGKILL]
        others = [e.described for e in component.exits if e.code != -signal.SIGKILL]
        others += ["killed by SIGKILL"] * max(0, len(sigkills) - expected)
        if others:
            unexpected[name] = others
        if len(sigkills) < expected:
            missing.append(f"{name} was killed {expected} times but exited only {len(sigkills)} times")
    return unexpected, missing


@dataclass(slots=True)
class Verdict:
    failures: list[str]
    pods: Counter[str]
    unexpected_exits: dict[str, list[str]]

    @property
    def ok(self) -> bool:
        return not self.failures


async def verdict(cluster: LocalCluster, *, faults: Faults, settle_timeout_s: float = 120.0) -> Verdict:
    """Wait for the cluster to settle after the churn stopped, then judge it (see the module docstring)."""
    client = cluster.client
    assert client is not None
    failures: list[str] = []

    unexpected, missing = judge_exits(cluster.components, faults.kills())
    failures.extend(missing)
    for name, described in sorted(unexpected.items()):
        failures.append(f"{name} exited without being killed: {described} (see {cluster.logs})")
    for failure in cluster.kubelet_failures:
        failures.append(f"the simulated kubelet failed: {failure.error}")

    pods: Counter[str] = Counter()
    deadline = time.monotonic() + settle_timeout_s
    undecided: list[str] = []
    while True:
        down = [n for n, c in cluster.components.items() if not c.alive]
        listed = [p async for p in client.list(Pod, namespace=NAMESPACE)]
        pods = Counter(outcome(p).value for p in listed)
        undecided = [p.metadata.name for p in listed if outcome(p) is Outcome.UNDECIDED]
        problems, booked = await audit_problems(cluster)
        ledger = await scheduler_ledger(cluster)
        ledger_diff = {
            uuid: (ledger.get(uuid, 0), booked.get(uuid, 0))
            for uuid in booked.keys() | ledger.keys()
            if ledger.get(uuid, 0) != booked.get(uuid, 0)
        }
        if not (down or undecided or ledger_diff) or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    if down:
        failures.append(f"not running at the end: {down}")
    if undecided:
        failures.append(f"{len(undecided)} pods neither placed nor explained: {sorted(undecided)[:10]}")
    failures.extend(f"audit: {p}" for p in problems)
    for uuid, (theirs, ours) in sorted(ledger_diff.items()):
        failures.append(f"scheduler ledger of GPU {uuid}: {theirs} MiB; the API objects book {ours} MiB")
    return Verdict(failures=failures, pods=pods, unexpected_exits=unexpected)


@dataclass(frozen=True, slots=True)
class Step:
    """A fault at ``at_s`` seconds into the churn."""

    at_s: float
    fault: Fault


async def run_schedule(
    faults: Faults, schedule: Sequence[Step], *, on_fault: Callable[[Injected], None] = lambda _i: None
) -> None:
    started = time.monotonic()
    for step in sorted(schedule, key=lambda s: s.at_s):
        await asyncio.sleep(max(0.0, started + step.at_s - time.monotonic()))
        await faults.inject(step.fault)
        on_fault(faults.injected[-1])


@contextlib.asynccontextmanager
async def background(*coroutines: Any):  # type: ignore[no-untyped-def]
    """Run ``coroutines`` as tasks for the block; cancel them after, re-raising any that failed."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            raise result
