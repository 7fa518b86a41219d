"""The node agent's usage reporter: per-fraction GPU memory and compute on a Prometheus endpoint.

Every interval (default 5 s) the reporter takes one ``UsageSnapshot`` (see ``gpufrac.node.usage``) and
hands it to the exporter and to its listeners (the audit). The exporter is a custom prometheus-client
Collector that renders only the latest snapshot at scrape time, so the series of a container that is
gone disappear with the next collection instead of lingering as stale gauges, and every allocated
fraction has series (zeros) before its container first touches the GPU.

MIG slices (docs/mig.md) have series of their own, memory used and total per slice, labelled with the
parent GPU, the slice's UUID and profile and the container on it (empty labels for a free slice); a
container on a slice also has its fraction series, on the slice's UUID with mode ``mig``. The per-GPU
series leave slices out, so a sum over GPUs never counts a slice's memory twice. Without a GPU the
slices are the SIMULATED usage backend's (``gpufrac.node.usage.simulated``).

Counters (enforcement violations by kind, MPS restarts and wedges) live in ``EnforcementCounters``: the
audit and the MPS supervisor call its methods, the exporter renders them. All kinds start at zero so a
rate() over them is defined from the first scrape.

Every metric and an example scrape are documented in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from gpufrac.node.mps.events import REASON_RESTARTED, REASON_START_FAILED, REASON_WEDGED, EventSink
from gpufrac.node.usage.collect import UsageCollector, UsageSnapshot
from gpufrac.process.build_info import register_build_info

log = logging.getLogger(__name__)

MISSING_INJECTION = "missing_injection"
UNKNOWN_PROCESS = "unknown_process"
OVER_LIMIT = "over_limit"
#: A container the device plugin gave a GPU of this node to, outside gpufrac (counted at its creation).
FOREIGN_GPU = "foreign_gpu"
VIOLATION_KINDS = (MISSING_INJECTION, UNKNOWN_PROCESS, OVER_LIMIT, FOREIGN_GPU)

FRACTION_LABELS = ("node", "namespace", "pod", "container", "gpu_uuid", "gpu_index", "mode")
GPU_LABELS = ("node", "gpu_uuid", "gpu_index")
SLICE_LABELS = ("node", "gpu_uuid", "gpu_index", "slice_uuid", "profile", "namespace", "pod", "container")

# Metric names, declared once: ``gpufrac top`` reads the same series by these names.
FRACTION_MEMORY_USED = "gpufrac_fraction_memory_used_bytes"
FRACTION_MEMORY_REQUEST = "gpufrac_fraction_memory_request_bytes"
FRACTION_MEMORY_LIMIT = "gpufrac_fraction_memory_limit_bytes"
FRACTION_SM_UTILIZATION = "gpufrac_fraction_sm_utilization_ratio"
FRACTION_COMPUTE_ENTITLEMENT = "gpufrac_fraction_compute_entitlement_ratio"
FRACTION_COMPUTE_RECEIVED = "gpufrac_fraction_compute_received_ratio"
FRACTION_PROCESSES = "gpufrac_fraction_processes"
GPU_MEMORY_TOTAL = "gpufrac_gpu_memory_total_bytes"
GPU_MEMORY_ALLOCATED = "gpufrac_gpu_memory_allocated_bytes"
GPU_MEMORY_USED = "gpufrac_gpu_memory_used_bytes"
GPU_MEMORY_UNATTRIBUTED = "gpufrac_gpu_memory_unattributed_bytes"
GPU_BUSY_TENANTS = "gpufrac_gpu_busy_tenants"
MIG_SLICE_MEMORY_USED = "gpufrac_mig_slice_memory_used_bytes"
MIG_SLICE_MEMORY_TOTAL = "gpufrac_mig_slice_memory_total_bytes"
AGENT_INFO = "gpufrac_agent_info"
# The driver's per-cgroup memory limits (gpufrac.node.memlimit): what is in force, not what was injected.
FRACTION_LIMIT_VERIFIED = "gpufrac_fraction_memory_limit_verified"
FRACTION_CGROUP_USED = "gpufrac_fraction_memory_cgroup_used_bytes"
FRACTIONS_RUNNING = "gpufrac_fractions_running"
FRACTIONS_VERIFIED = "gpufrac_fractions_memory_limit_verified"
LIMITS_REAPPLIED = "gpufrac_memory_limit_reapplied"
LIMITS_REFUSED = "gpufrac_memory_limit_refused_starts"
LIMITS_CANARY = "gpufrac_memory_limit_canary_passed"
LIMITS_START_SECONDS = "gpufrac_memory_limit_start_seconds"
LIMIT_LABELS = ("node", "namespace", "pod", "container", "gpu_uuid")


@dataclass(frozen=True, slots=True)
class FractionLimit:
    """One fraction on one GPU: whether the driver's read-back equals its plan, and its ``currentUsed``."""

    namespace: str
    pod: str
    container: str
    gpu_uuid: str
    verified: bool
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class LimitReport:
    """The enforcer's state as the exporter renders it (``gpufrac.node.memlimit.enforcer.limit_report``)."""

    fractions: tuple[FractionLimit, ...]
    running: int
    verified: int
    reapplied: int
    refused: int
    canary_passed: bool | None
    #: (upper bound in seconds, cumulative count) of the time StartContainer spent on the limit.
    start_buckets: tuple[tuple[float, int], ...] = ()
    start_count: int = 0
    start_sum_s: float = 0.0


class EnforcementCounters:
    """Monotonic counters bumped by the audit and the MPS supervisor (thread-safe, cheap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._violations = dict.fromkeys(VIOLATION_KINDS, 0)
        self._mps_restarts = 0
        self._mps_wedges = 0
        self._collection_errors = 0
        self._without_injection = 0

    def running_without_injection(self, count: int) -> None:
        """How many running GPU containers the last Synchronize found without their injection (a gauge)."""
        with self._lock:
            self._without_injection = count

    def violation(self, *, kind: str) -> None:
        """One enforcement violation found (one of ``VIOLATION_KINDS``)."""
        with self._lock:
            self._violations[kind] = self._violations.get(kind, 0) + 1

    def mps_restarted(self) -> None:
        """The MPS control daemon was (re)started after it exited or was recovered."""
        with self._lock:
            self._mps_restarts += 1

    def mps_wedged(self) -> None:
        """The MPS control daemon stopped answering and was declared wedged."""
        with self._lock:
            self._mps_wedges += 1

    def collection_failed(self) -> None:
        with self._lock:
            self._collection_errors += 1

    def read(self) -> CounterValues:
        with self._lock:
            return CounterValues(
                violations=dict(self._violations),
                mps_restarts=self._mps_restarts,
                mps_wedges=self._mps_wedges,
                collection_errors=self._collection_errors,
                without_injection=self._without_injection,
            )


class CountingMpsEvents:
    """The MPS supervisor's ``EventSink`` that also counts: wrap the Node sink with it at wiring time.

    Every restart the supervisor reports is an Event; counting at that seam keeps one source for both
    (a wedged server is recovered by a restart, so it counts as a wedge and a restart).
    """

    def __init__(self, *, sink: EventSink, counters: EnforcementCounters) -> None:
        self._sink = sink
        self._counters = counters

    def emit(self, *, type: str, reason: str, message: str) -> None:
        if reason == REASON_WEDGED:
            self._counters.mps_wedged()
        if reason in (REASON_RESTARTED, REASON_START_FAILED, REASON_WEDGED):
            self._counters.mps_restarted()
        self._sink.emit(type=type, reason=reason, message=message)


@dataclass(frozen=True, slots=True)
class CounterValues:
    violations: dict[str, int]
    mps_restarts: int
    mps_wedges: int
    collection_errors: int
    without_injection: int = 0


class UsageExporter(Collector):
    """Renders the latest snapshot and the counters as Prometheus metrics."""

    def __init__(
        self,
        *,
        node: str,
        counters: EnforcementCounters,
        limits: Callable[[], LimitReport] | None = None,
    ) -> None:
        self._node = node
        self._counters = counters
        self._limits = limits
        self._latest: UsageSnapshot | None = None
        self._duration = 0.0

    def update(self, snapshot: UsageSnapshot, *, duration_seconds: float) -> None:
        # One reference assignment: a concurrent scrape sees the old or the new snapshot, never a mix.
        self._latest, self._duration = snapshot, duration_seconds

    def collect(self) -> Iterator[Metric]:
        yield from self._fraction_metrics()
        yield from self._gpu_metrics()
        yield from self._slice_metrics()
        yield from self._counter_metrics()
        if self._limits is not None:
            yield from self._limit_metrics(self._limits())

    def _limit_metrics(self, report: LimitReport) -> Iterator[Metric]:
        verified = GaugeMetricFamily(
            FRACTION_LIMIT_VERIFIED,
            "1 when the driver's per-cgroup memory limit of the container on this GPU was read back equal to "
            "its request (soft) and limit (hard); 0 otherwise.",
            labels=LIMIT_LABELS,
        )
        used = GaugeMetricFamily(
            FRACTION_CGROUP_USED,
            "GPU memory the driver counts for the container's cgroup on this GPU (currentUsed).",
            labels=LIMIT_LABELS,
        )
        for f in report.fractions:
            labels = [self._node, f.namespace, f.pod, f.container, f.gpu_uuid]
            verified.add_metric(labels, 1 if f.verified else 0)
            if f.used_bytes is not None:
                used.add_metric(labels, f.used_bytes)
        yield from (verified, used)
        for name, doc, value in (
            (
                FRACTIONS_RUNNING,
                "Fractional containers created on this node (not whole GPUs).",
                report.running,
            ),
            (
                FRACTIONS_VERIFIED,
                "Fractional containers whose memory limits the driver read back equal to their plan.",
                report.verified,
            ),
            (
                LIMITS_CANARY,
                "1 when the driver's per-cgroup memory limit passed the agent's canary; 0 when it failed or "
                "has not run (the node is then not ready).",
                1 if report.canary_passed else 0,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["node"])
            gauge.add_metric([self._node], value)
            yield gauge
        for name, doc, value in (
            (
                LIMITS_REAPPLIED,
                "Limits found cleared or changed by the audit and set again.",
                report.reapplied,
            ),
            (LIMITS_REFUSED, "Container starts refused because the limit was not in force.", report.refused),
        ):
            counter = CounterMetricFamily(name, doc, labels=["node"])
            counter.add_metric([self._node], value)
            yield counter
        started = HistogramMetricFamily(
            LIMITS_START_SECONDS,
            "Time StartContainer spent setting and reading back a fraction's memory limit (the runtime "
            "waits for it; NRI's budget per plugin is 2 s).",
            labels=["node"],
        )
        started.add_metric(
            [self._node],
            [(str(bound), count) for bound, count in report.start_buckets] + [("+Inf", report.start_count)],
            sum_value=report.start_sum_s,
        )
        yield started

    def _fraction_metrics(self) -> Iterator[Metric]:
        families = {
            FRACTION_MEMORY_USED: "GPU memory used by the container's processes on this GPU.",
            FRACTION_MEMORY_REQUEST: "Guaranteed GPU memory of the container on this GPU.",
            FRACTION_MEMORY_LIMIT: "Most GPU memory the container may grow into on this GPU.",
            FRACTION_SM_UTILIZATION: "Share of the interval the container's processes ran kernels (NVML).",
            FRACTION_COMPUTE_ENTITLEMENT: (
                "Compute share the container is entitled to: its portion (sm-sharing) or 1/k of k busy "
                "tenants (time-slicing; an idle tenant shows the 1/(k+1) it would get)."
            ),
            FRACTION_COMPUTE_RECEIVED: "The container's share of all SM time measured on this GPU.",
            FRACTION_PROCESSES: "Host processes of the container on this GPU.",
        }
        metrics = {
            name: GaugeMetricFamily(name, doc, labels=FRACTION_LABELS) for name, doc in families.items()
        }
        snapshot = self._latest
        for f in snapshot.fractions if snapshot is not None else ():
            a = f.allocation
            labels = [
                self._node,
                a.pod_namespace,
                a.pod_name,
                a.container_name,
                f.gpu_uuid,
                str(f.gpu_index),
                a.mode,
            ]
            metrics[FRACTION_MEMORY_USED].add_metric(labels, f.used_bytes)
            metrics[FRACTION_MEMORY_REQUEST].add_metric(labels, f.request_bytes)
            metrics[FRACTION_MEMORY_LIMIT].add_metric(labels, f.limit_bytes)
            metrics[FRACTION_SM_UTILIZATION].add_metric(labels, f.sm_ratio)
            metrics[FRACTION_COMPUTE_ENTITLEMENT].add_metric(labels, f.entitlement_ratio)
            metrics[FRACTION_COMPUTE_RECEIVED].add_metric(labels, f.received_ratio)
            metrics[FRACTION_PROCESSES].add_metric(labels, len(f.pids))
        yield from metrics.values()

    def _gpu_metrics(self) -> Iterator[Metric]:
        total = GaugeMetricFamily(GPU_MEMORY_TOTAL, "GPU memory capacity.", labels=GPU_LABELS)
        allocated = GaugeMetricFamily(
            GPU_MEMORY_ALLOCATED,
            "Sum of the memory requests of the fractions placed on this GPU.",
            labels=GPU_LABELS,
        )
        used = GaugeMetricFamily(
            GPU_MEMORY_USED,
            "GPU memory used by all processes on this GPU.",
            labels=GPU_LABELS,
        )
        unattributed = GaugeMetricFamily(
            GPU_MEMORY_UNATTRIBUTED,
            "GPU memory used by processes that belong to no fraction on this GPU.",
            labels=GPU_LABELS,
        )
        busy = GaugeMetricFamily(
            GPU_BUSY_TENANTS,
            "Fractions that ran kernels on this GPU in the interval.",
            labels=GPU_LABELS,
        )
        snapshot = self._latest
        for g in snapshot.gpus if snapshot is not None else ():
            if g.parent_uuid is not None:  # a MIG slice: _slice_metrics
                continue
            labels = [self._node, g.uuid, str(g.index)]
            total.add_metric(labels, g.memory_total_bytes)
            allocated.add_metric(labels, g.allocated_bytes)
            used.add_metric(labels, g.used_bytes)
            unattributed.add_metric(labels, g.unattributed_bytes)
            busy.add_metric(labels, g.busy_tenants)
        yield from (total, allocated, used, unattributed, busy)
        info = GaugeMetricFamily(AGENT_INFO, "The node agent serving these metrics.", labels=["node"])
        info.add_metric([self._node], 1)
        yield info
        duration = GaugeMetricFamily(
            "gpufrac_usage_collection_duration_seconds", "Duration of the last collection.", labels=["node"]
        )
        duration.add_metric([self._node], self._duration)
        yield duration
        if snapshot is not None:
            at = GaugeMetricFamily(
                "gpufrac_usage_last_collection_timestamp_seconds",
                "Unix time of the last collection.",
                labels=["node"],
            )
            at.add_metric([self._node], snapshot.taken_at)
            yield at

    def _slice_metrics(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            MIG_SLICE_MEMORY_USED,
            "GPU memory used by all processes on this MIG slice.",
            labels=SLICE_LABELS,
        )
        total = GaugeMetricFamily(
            MIG_SLICE_MEMORY_TOTAL,
            "Memory of this MIG slice (its GPU instance's, as NVML reports it).",
            labels=SLICE_LABELS,
        )
        snapshot = self._latest
        if snapshot is not None:
            on_slice: dict[str, list[tuple[str, str, str]]] = {}
            for f in snapshot.fractions:
                a = f.allocation
                on_slice.setdefault(f.gpu_uuid, []).append((a.pod_namespace, a.pod_name, a.container_name))
            for g in snapshot.gpus:
                if g.parent_uuid is None:
                    continue
                for namespace, pod, container in on_slice.get(g.uuid) or [("", "", "")]:
                    labels = [
                        self._node,
                        g.parent_uuid,
                        str(g.index),
                        g.uuid,
                        g.mig_profile or "",
                        namespace,
                        pod,
                        container,
                    ]
                    used.add_metric(labels, g.used_bytes)
                    total.add_metric(labels, g.memory_total_bytes)
        yield from (used, total)

    def _counter_metrics(self) -> Iterator[Metric]:
        values = self._counters.read()
        violations = CounterMetricFamily(
            "gpufrac_enforcement_violations",
            "Enforcement violations found by the audit, by kind.",
            labels=["node", "kind"],
        )
        for kind, count in sorted(values.violations.items()):
            violations.add_metric([self._node, kind], count)
        yield violations
        for name, doc, value in (
            ("gpufrac_mps_restarts", "MPS control daemon (re)starts by the supervisor.", values.mps_restarts),
            ("gpufrac_mps_wedges", "Times the MPS control daemon was found wedged.", values.mps_wedges),
            (
                "gpufrac_usage_collection_errors",
                "Cycles whose collection or audit failed.",
                values.collection_errors,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["node"])
            counter.add_metric([self._node], value)
            yield counter
        unenforced = GaugeMetricFamily(
            "gpufrac_containers_without_injection",
            "Running GPU containers that NRI's Synchronize showed without their injection (created while "
            "the agent was away); not recorded as enforced.",
            labels=["node"],
        )
        unenforced.add_metric([self._node], values.without_injection)
        yield unenforced


Listener = Callable[[UsageSnapshot], Awaitable[None] | None]


class UsageReporter:
    """Collects every ``interval`` seconds, publishes to the exporter, then notifies the listeners."""

    def __init__(
        self,
        *,
        collector: UsageCollector,
        exporter: UsageExporter,
        counters: EnforcementCounters,
        interval: float = 5.0,
        listeners: Sequence[Listener] = (),
    ) -> None:
        self._collector = collector
        self._exporter = exporter
        self._counters = counters
        self._interval = interval
        self._listeners = list(listeners)

    def collect_once(self) -> UsageSnapshot:
        start = time.perf_counter()
        snapshot = self._collector.collect()
        self._exporter.update(snapshot, duration_seconds=time.perf_counter() - start)
        return snapshot

    async def run(self) -> None:
        """Collect until cancelled. A failed cycle is logged and counted; the next one runs on time."""
        next_at = time.monotonic()
        while True:
            try:
                snapshot = await asyncio.to_thread(self.collect_once)
                for listener in self._listeners:
                    result = listener(snapshot)
                    if inspect.isawaitable(result):
                        await result
            except asyncio.CancelledError:
                raise
            except Exception:
                self._counters.collection_failed()
                log.exception("usage collection failed")
            next_at += self._interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def registry_for(exporter: UsageExporter) -> CollectorRegistry:
    """A registry holding only the agent's metrics (no process/platform collectors of the default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    register_build_info(registry, component="node-agent")
    return registry


class MetricsServer:
    """The /metrics HTTP endpoint on its own thread; ``close()`` stops it and frees the port."""

    def __init__(self, *, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 9400) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        # shutdown() stops serve_forever; server_close() then releases the socket.
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
