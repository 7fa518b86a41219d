"""Every metric name and label the gpufrac exporters really expose, collected from their own registries.

Nothing here is typed by hand: each component's registry is built as the component builds it (the
scheduler's ``SchedulerMetrics`` with its state collector, the operator's metrics, the node agent's
``registry_for`` with one fraction's usage and one driver read-back of its GPU memory limit, the admission
webhook's ``AdmissionMetrics`` following its served certificate), every labelled metric is given one
child and one value, and the exposition text Prometheus would scrape is parsed back. The dashboard and
alert tests check their queries against this.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.admission.metrics import AdmissionMetrics
from gpufrac.node.metrics import (
    EnforcementCounters,
    FractionLimit,
    LimitReport,
    UsageExporter,
    registry_for,
)
from gpufrac.node.usage.collect import FractionUsage, GpuUsage, UsageSnapshot
from gpufrac.operator.reconciler import _Metrics as OperatorMetrics
from gpufrac.scheduler.metrics import GpuAllocation, SchedulerMetrics, StateReaders

#: Labels Prometheus adds to every scraped series (target labels), usable in any query.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}


def _touch(holder: object) -> None:
    """One child with one value for every prometheus-client metric attribute (labelled ones render none)."""
    for metric in vars(holder).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        labelnames = metric._labelnames  # prometheus-client keeps them only here
        child = metric.labels(*["x"] * len(labelnames)) if labelnames else metric
        if isinstance(metric, Histogram):
            child.observe(1)
        elif isinstance(metric, Counter):
            child.inc()
        elif isinstance(metric, Gauge):
            child.set(1)


def _scheduler() -> CollectorRegistry:
    metrics = SchedulerMetrics()
    _touch(metrics)
    metrics.watch_state(
        StateReaders(
            pending_by_queue=lambda: {"default": 1},
            gpu_allocations=lambda: [GpuAllocation("n", "GPU-0", 0, 80000, 1000, 2000)],
            is_leader=lambda: True,
            informer_relists=lambda: {"pods": 0},
            heartbeat_expired_nodes=lambda: 0,
            events_pending=lambda: 0,
            events_dropped=lambda: 0,
            events_failed=lambda: 0,
        )
    )
    return metrics.registry


def _operator() -> CollectorRegistry:
    metrics = OperatorMetrics()
    _touch(metrics)
    return metrics.registry


def _node_agent() -> CollectorRegistry:
    limits = LimitReport(
        fractions=(FractionLimit("ns", "p", "app", "GPU-0", verified=True, used_bytes=1),),
        running=1,
        verified=1,
        reapplied=0,
        refused=0,
        canary_passed=True,
    )
    exporter = UsageExporter(node="n", counters=EnforcementCounters(), limits=lambda: limits)
    allocation = SimpleNamespace(
        container_id="c",
        pod_namespace="ns",
        pod_name="p",
        pod_uid="u",
        container_name="app",
        devices=("GPU-0",),
        request_mib=1024,
        limit_mib=2048,
        mode="time-slicing",
        portion=None,
    )
    fraction = FractionUsage(
        allocation=allocation,
        gpu_uuid="GPU-0",
        gpu_index=0,
        request_bytes=1,
        limit_bytes=2,
        used_bytes=1,
        sm_ratio=0.5,
        pids=(1,),
        entitlement_ratio=1.0,
        received_ratio=1.0,
    )
    gpu = GpuUsage("GPU-0", 0, 10, 1, 1, 0, 1, True)
    exporter.update(
        UsageSnapshot(taken_at=time.time(), gpus=(gpu,), fractions=(fraction,), strays=()),
        duration_seconds=0.1,
    )
    return registry_for(exporter)


def _admission() -> CollectorRegistry:
    metrics = AdmissionMetrics()
    _touch(metrics)
    metrics.follow(expiry=lambda: 2e9, open_connections=lambda: 1)
    return metrics.registry


REGISTRIES = {
    "scheduler": _scheduler,
    "operator": _operator,
    "node-agent": _node_agent,
    "admission": _admission,
}


def exposed() -> dict[str, set[str]]:
    """Series name (as scraped: ``_total``, ``_bucket``, ...) → the label names it carries."""
    names: dict[str, set[str]] = {}
    for build in REGISTRIES.values():
        for family in text_string_to_metric_families(generate_latest(build()).decode()):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names
