"""The scheduler's Prometheus metrics, in a registry of their own.

A registry per service (not the global one) lets two schedulers run in one process, which the tests
and the embedded cluster do. Values that are state rather than events (pending pods per queue, GPU
memory allocated per GPU, leadership) are read from the service when scraped, so the hot path only
increments counters and observes one histogram per pod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpufrac.placement.state import MIG
from gpufrac.process.build_info import register_build_info
from gpufrac.scheduler.placement_engine import PlacementEngine


@dataclass(frozen=True, slots=True)
class GpuAllocation:
    node: str
    gpu: str
    index: int
    capacity_mib: int
    request_mib: int
    limit_mib: int


def gpu_allocations(engine: PlacementEngine) -> Iterable[GpuAllocation]:
    """Every GPU the engine knows, with what its tenants request and may grow into."""
    for node in engine.node_names:
        for ledger in engine.ledger(node):
            yield GpuAllocation(
                node=node,
                gpu=ledger.uuid,
                index=ledger.index,
                capacity_mib=ledger.capacity_mib,
                # A MIG GPU has no fraction room: what it has booked is its taken slices' memory.
                request_mib=ledger.slice_mib if ledger.mode == MIG else ledger.capacity_mib - ledger.free_mib,
                limit_mib=ledger.slice_mib if ledger.mode == MIG else ledger.limit_sum_mib,
            )


@dataclass(frozen=True, slots=True)
class StateReaders:
    """Callbacks the collector calls on each scrape."""

    pending_by_queue: Callable[[], dict[str, int]]
    gpu_allocations: Callable[[], Iterable[GpuAllocation]]
    is_leader: Callable[[], bool]
    informer_relists: Callable[[], dict[str, int]]
    heartbeat_expired_nodes: Callable[[], int]
    events_pending: Callable[[], int]
    events_dropped: Callable[[], int]
    events_failed: Callable[[], int]


def _single(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    """A gauge of one unlabelled value."""
    gauge = GaugeMetricFamily(name, documentation)
    gauge.add_metric([], value)
    return gauge


class _StateCollector(Collector):
    def __init__(self, readers: StateReaders) -> None:
        self._readers = readers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        r = self._readers
        pending = GaugeMetricFamily(
            "gpufrac_scheduler_pending_pods", "Pods waiting for a placement, by queue.", labels=["queue"]
        )
        for queue, count in sorted(r.pending_by_queue().items()):
            pending.add_metric([queue], count)
        yield pending
        yield _single("gpufrac_scheduler_leader", "1 while this replica holds the lease.", int(r.is_leader()))
        relists = GaugeMetricFamily(
            "gpufrac_scheduler_informer_relists",
            "Relists after the watch expired (410 Gone), by informer.",
            labels=["informer"],
        )
        for name, count in sorted(r.informer_relists().items()):
            relists.add_metric([name], count)
        yield relists
        yield _single(
            "gpufrac_scheduler_nodes_heartbeat_expired",
            "Managed nodes whose node agent's heartbeat expired (they take no new pods).",
            r.heartbeat_expired_nodes(),
        )
        yield _single(
            "gpufrac_scheduler_events_pending",
            "Events emitted and not yet written (they wait while a burst is being bound).",
            r.events_pending(),
        )
        yield _single(
            "gpufrac_scheduler_events_dropped",
            "Events dropped because the queue was full (a burst longer than the queue).",
            r.events_dropped(),
        )
        yield _single(
            "gpufrac_scheduler_events_failed",
            "Events not written: refused by the API server, or failing every try (a timeout, 429, 5xx).",
            r.events_failed(),
        )


class _GpuCollector(Collector):
    """The per-GPU families, apart: three series per GPU are most of a large cluster's exposition, and a
    scrape that asks for other families by name (``?name[]=``) does not collect them."""

    def __init__(self, readers: StateReaders) -> None:
        self._readers = readers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        r = self._readers
        requested = GaugeMetricFamily(
            "gpufrac_scheduler_gpu_memory_allocated_mib",
            "Guaranteed GPU memory placed on each GPU (sum of requests).",
            labels=["node", "gpu", "index"],
        )
        limits = GaugeMetricFamily(
            "gpufrac_scheduler_gpu_memory_limit_mib",
            "Sum of the memory limits of the fractions placed on each GPU.",
            labels=["node", "gpu", "index"],
        )
        capacity = GaugeMetricFamily(
            "gpufrac_scheduler_gpu_memory_capacity_mib",
            "Memory of each GPU of the managed nodes.",
            labels=["node", "gpu", "index"],
        )
        for a in r.gpu_allocations():
            labels = [a.node, a.gpu, str(a.index)]
            requested.add_metric(labels, a.request_mib)
            limits.add_metric(labels, a.limit_mib)
            capacity.add_metric(labels, a.capacity_mib)
        yield requested
        yield limits
        yield capacity


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        register_build_info(self.registry, component="scheduler")
        GCCollector(registry=self.registry)  # python_gc_*: the collector's passes (gpufrac.process.heap)
        self.attempts = Counter(
            "gpufrac_scheduler_schedule_attempts",
            "Scheduling attempts by result (scheduled, unschedulable, error).",
            ["result"],
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "gpufrac_scheduler_e2e_scheduling_duration_seconds",
            "From the pod's first sighting to its successful binding.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.bind_errors = Counter(
            "gpufrac_scheduler_bind_errors",
            "Failed annotate-or-bind attempts, by reason (conflict, not_found, invalid, other).",
            ["reason"],
            registry=self.registry,
        )
        self.batches = Histogram(
            "gpufrac_scheduler_batch_size",
            "Pods placed per engine call.",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=self.registry,
        )

        self.resizes = Counter(
            "gpufrac_scheduler_resizes",
            "Answers to resize requests, by outcome (resized, deferred, infeasible).",
            ["outcome"],
            registry=self.registry,
        )
        self.resize_latency = Histogram(
            "gpufrac_scheduler_resize_decision_duration_seconds",
            "From the scheduler's first sighting of a resize request to its first answer.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )

    def resize_answered(self, outcome: str, seconds: float | None) -> None:
        """A resize request answered (``Resizes``): ``seconds`` since it was first seen, None when this
        is not its first answer (a deferred one carried out later)."""
        self.resizes.labels(outcome).inc()
        if seconds is not None:
            self.resize_latency.observe(seconds)

    def watch_state(self, readers: StateReaders) -> None:
        self.registry.register(_StateCollector(readers))
        self.registry.register(_GpuCollector(readers))
