"""Where ``kubectl gpufrac report`` gets its history: Prometheus range queries, or one live scrape.

From Prometheus, the report reads the node agents' raw per-fraction series over the window (one range
query per metric, the same ``step`` for all) rather than the chart's recording rules: the figures are
then the same whether or not the rules are installed, and the rules (deploy/helm/gpufrac/rules/
report.yaml) record the same formulas for the dashboard. Used memory is the driver's ``currentUsed``
for the container's cgroup where the agent exports it, NVML's per-process sum otherwise (the rules
choose the same way). Samples of one tenant on one GPU are joined on their labels at each timestamp; a
tenant missing one series at an instant (a scrape that fell between two steps) is kept with that value
at 0 and counted in a note.

Without Prometheus, the history is one instant: what ``kubectl gpufrac top`` reads from the agents now
(used memory there is NVML's, as ``top`` shows it). It stands for one hour, so GPU-hours and cost read
"per hour at today's bookings", and the report says it is a snapshot.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from gpufrac.kubectl.report import FractionSample, History
from gpufrac.node import metrics
from gpufrac.node.top import AgentView
from gpufrac.placement.queue_access import chosen_queue

#: What each per-fraction metric fills in a ``FractionSample``.
FRACTION_FIELDS = {
    metrics.FRACTION_MEMORY_REQUEST: "request_bytes",
    metrics.FRACTION_MEMORY_LIMIT: "limit_bytes",
    metrics.FRACTION_MEMORY_USED: "used_bytes",
    metrics.FRACTION_SM_UTILIZATION: "sm_ratio",
    metrics.FRACTION_COMPUTE_RECEIVED: "received_ratio",
}
#: A snapshot stands for an hour: its GPU-hours are "per hour" at the bookings of the moment.
SNAPSHOT_STEP_S = 3600.0
#: The most points one range query asks for per series (Prometheus refuses more than 11,000).
MAX_POINTS = 1440
MIN_STEP_S = 60.0


def step_for(window_s: float) -> float:
    """A step that keeps a range query under ``MAX_POINTS`` per series, at least a minute."""
    return max(MIN_STEP_S, math.ceil(window_s / MAX_POINTS))


Matrix = Sequence[Mapping[str, Any]]  # Prometheus' "matrix" result: [{"metric": {...}, "values": [[t, v]]}]


def history_from_matrices(matrices: Mapping[str, Matrix], *, step_s: float) -> tuple[History, list[str]]:
    """Range-query results by metric name → a history (and notes on what was incomplete)."""
    rows: dict[tuple[float, tuple[str, ...]], dict[str, Any]] = defaultdict(dict)
    for name, field in FRACTION_FIELDS.items():
        for series in matrices.get(name, ()):
            m = series["metric"]
            key = (
                m.get("node", ""),
                m.get("namespace", ""),
                m.get("pod", ""),
                m.get("container", ""),
                m.get("gpu_uuid", ""),
                m.get("mode", ""),
            )
            for at, value in series["values"]:
                rows[(float(at), key)][field] = float(value)
    # The driver's count for the container's cgroup on the GPU (currentUsed), where it gives one, is the
    # used memory; NVML's per-process sum otherwise (the recording rules choose the same way).
    current: dict[tuple[float, str, str, str, str, str], float] = {}
    for series in matrices.get(metrics.FRACTION_CGROUP_USED, ()):
        m = series["metric"]
        who = tuple(m.get(k, "") for k in ("node", "namespace", "pod", "container", "gpu_uuid"))
        for at, value in series["values"]:
            current[(float(at), *who)] = float(value)
    capacity: dict[tuple[float, str, str], float] = {}
    for series in matrices.get(metrics.GPU_MEMORY_TOTAL, ()):
        m = series["metric"]
        for at, value in series["values"]:
            capacity[(float(at), m.get("node", ""), m.get("gpu_uuid", ""))] = float(value)
    by_time: dict[float, list[FractionSample]] = defaultdict(list)
    partial = 0
    for (at, (node, namespace, pod, container, uuid, mode)), values in rows.items():
        if "request_bytes" not in values:
            continue  # no booking at this instant: nothing to count it against
        partial += len(values) < len(FRACTION_FIELDS)
        driver = current.get((at, node, namespace, pod, container, uuid))
        if driver is not None:
            values["used_bytes"] = driver
        by_time[at].append(
            FractionSample(
                node=node,
                namespace=namespace,
                pod=pod,
                container=container,
                gpu_uuid=uuid,
                mode=mode,
                gpu_memory_bytes=capacity.get((at, node, uuid), 0.0),
                **{f: values.get(f, 0.0) for f in FRACTION_FIELDS.values()},
            )
        )
    notes = [f"{partial} sample(s) missed a series at their instant (read as 0)"] if partial else []
    return History(instants=sorted(by_time.items()), step_s=step_s), notes


def query_range(
    url: str, *, start: float, end: float, step_s: float, timeout_s: float = 30.0
) -> dict[str, Matrix]:
    """Each metric the report reads, over [start, end] every ``step_s``; raises ``PrometheusError``."""
    found: dict[str, Matrix] = {}
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        for name in (*FRACTION_FIELDS, metrics.FRACTION_CGROUP_USED, metrics.GPU_MEMORY_TOTAL):
            try:
                response = client.get(
                    "/api/v1/query_range",
                    params={"query": name, "start": start, "end": end, "step": step_s},
                )
                answer = response.json()
            except (httpx.HTTPError, ValueError) as error:
                raise PrometheusError(f"{url}: {type(error).__name__}: {error}") from error
            if answer.get("status") != "success":
                raise PrometheusError(f"{url} answered {name}: {answer.get('error') or response.status_code}")
            found[name] = answer["data"]["result"]
    return found


class PrometheusError(Exception):
    """Prometheus could not be reached or refused a query (the message says which and why)."""


_TOP_FIELDS = {
    "request": "request_bytes",
    "limit": "limit_bytes",
    "used": "used_bytes",
    "sm": "sm_ratio",
    "received": "received_ratio",
}


def history_from_agents(views: Iterable[AgentView], *, at: float) -> tuple[History, list[str]]:
    """One scrape of the agents (``kubectl gpufrac top``'s) → a one-instant history."""
    samples = []
    notes = []
    for view in views:
        if view.error is not None:
            notes.append(f"node agent {view.node} left out: {view.error}")
            continue
        for gpu in view.gpus.values():
            for (namespace, pod, container, mode), values in gpu.fractions.items():
                samples.append(
                    FractionSample(
                        node=view.node,
                        namespace=namespace,
                        pod=pod,
                        container=container,
                        gpu_uuid=gpu.uuid,
                        mode=mode,
                        gpu_memory_bytes=gpu.values.get("total", 0.0),
                        **{f: values.get(k, 0.0) for k, f in _TOP_FIELDS.items()},
                    )
                )
    return History(instants=[(at, samples)], step_s=SNAPSHOT_STEP_S), notes


def pod_queues(
    pods: Iterable[Any], *, namespace_labels: Mapping[str, Mapping[str, str]], fallback: str
) -> dict[tuple[str, str], str]:
    """``(namespace, pod) → queue`` by the scheduler's rule (``chosen_queue``) for pods that exist now;
    a pod gone since the window began has no entry (the report groups it under ``UNKNOWN_QUEUE``)."""
    found = {}
    for pod in pods:
        meta = pod.metadata
        choice = chosen_queue(
            pod_labels=meta.labels or {},
            namespace=meta.namespace,
            namespace_labels=namespace_labels.get(meta.namespace, {}),
            fallback=fallback,
        )
        found[(meta.namespace, meta.name)] = choice.queue
    return found
