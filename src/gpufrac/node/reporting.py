"""The node agent's usage duty as one long-running task: metrics endpoint, reporter loop, audit.

``gpufrac node-agent`` starts this next to the NRI plugin and the MPS supervisor. Everything it owns
is opened here and closed in ``finally`` when the task is cancelled (SIGTERM), in the reverse order of
opening: the reporter stops first so no audit is half-way through a CRI call, then the CRI channel
closes, and the HTTP endpoint goes last so a scrape during shutdown still answers.

The GPU backend, the mapping store, the injection planner, the Event sink and the counters are passed
in, because the agent shares them with its other duties (the NRI plugin writes the store, the MPS
supervisor bumps the counters through ``CountingMpsEvents``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gpufrac.node.enforcement_audit import Auditor, EventSink, InjectionPlanner
from gpufrac.node.metrics import (
    EnforcementCounters,
    LimitReport,
    MetricsServer,
    UsageExporter,
    UsageReporter,
    registry_for,
)
from gpufrac.node.usage.backend import ProcessUsageBackend
from gpufrac.node.usage.collect import AllocationLookup, UsageCollector

log = logging.getLogger(__name__)


class UsageSettings(BaseModel):
    """Settings of usage reporting and the audit (part of the node agent's configuration)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interval_s: float = Field(5.0, gt=0, description="seconds between collections")
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9400, ge=0, le=65535, description="0 picks a free port (tests)")
    proc_root: Path = Field(Path("/proc"), description="the host's /proc (the agent runs with hostPID)")
    audit: bool = True
    cri_endpoint: str = "unix:///run/containerd/containerd.sock"
    stop_missing_injection: bool = Field(True, description="stop a container created without injection")
    stop_over_limit: bool = Field(True, description="stop a container over its memory limit")
    over_limit_cycles: int = Field(2, ge=1, description="collections in a row over the limit before acting")


async def run_reporting(
    *,
    settings: UsageSettings,
    node_name: str,
    backend: ProcessUsageBackend,
    allocations: AllocationLookup,
    managed_gpus: Collection[str] | None,
    planner: InjectionPlanner,
    events: EventSink,
    counters: EnforcementCounters,
    started: asyncio.Future[int] | None = None,
    limits: Callable[[], LimitReport] | None = None,
) -> None:
    """Serve /metrics and collect (and audit) every interval until cancelled.

    ``started`` is resolved with the metrics port once the endpoint listens; ``limits`` reports the
    driver's per-cgroup memory limits (``gpufrac.node.memlimit``) at every scrape.
    """
    exporter = UsageExporter(node=node_name, counters=counters, limits=limits)
    collector = UsageCollector(
        backend=backend, allocations=allocations, proc_root=settings.proc_root, managed_gpus=managed_gpus
    )
    server = MetricsServer(
        registry=registry_for(exporter), host=settings.metrics_host, port=settings.metrics_port
    )
    cri = None
    try:
        listeners = []
        if settings.audit:
            from gpufrac.node.cri.client import CriClient  # generated messages: only when auditing

            cri = CriClient(endpoint=settings.cri_endpoint)
            listeners.append(
                Auditor(
                    runtime=cri,
                    planner=planner,
                    events=events,
                    counters=counters,
                    node_name=node_name,
                    stop_missing_injection=settings.stop_missing_injection,
                    stop_over_limit=settings.stop_over_limit,
                    over_limit_cycles=settings.over_limit_cycles,
                )
            )
        reporter = UsageReporter(
            collector=collector,
            exporter=exporter,
            counters=counters,
            interval=settings.interval_s,
            listeners=listeners,
        )
        log.info(
            "usage: metrics on %s:%d, every %.1fs", settings.metrics_host, server.port, settings.interval_s
        )
        if started is not None:
            started.set_result(server.port)
        await reporter.run()
    finally:
        # Order matters: the reporter (this coroutine) has stopped; close CRI, then the endpoint.
        try:
            if cri is not None:
                await cri.close()
        finally:
            server.close()
