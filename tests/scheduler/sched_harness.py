"""What the scheduler's tests against the real control plane share: pools of simulated nodes, pods, waiting.

Every test gets its own node pool (a label the scheduler's node selector requires), its own scheduler
name, namespace and Lease, so tests never see each other's nodes or pods on the shared control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape, create_sim_nodes
from gpufrac.placement.engine import Engine
from gpufrac.scheduler.booking_audit import AuditReport, audit
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.placement_engine import PlacementEngine
from gpufrac.scheduler.preemption import Preemptions
from gpufrac.scheduler.service import SchedulerService, build_service

POOL_LABEL = "gpufrac.io/test-pool"


@dataclass(frozen=True)
class Pool:
    """One test's world: its nodes, its scheduler name and Lease, its namespace."""

    id: str
    namespace: str

    @property
    def scheduler_name(self) -> str:
        return f"sched-{self.id}"

    @property
    def node_selector(self) -> str:
        return f"{keys.MANAGED_LABEL}=true,{POOL_LABEL}={self.id}"

    def config(self, **overrides: Any) -> SchedulerConfig:
        data: dict[str, Any] = {
            "scheduler_name": self.scheduler_name,
            "node_selector": self.node_selector,
            "http_host": "127.0.0.1",
            "http_port": 0,
            "batch_window_ms": 5,
            "backoff_initial_s": 0.1,
            "backoff_max_s": 2.0,
            "leader_election": {
                "lease_name": f"lease-{self.id}",
                "lease_namespace": "default",
                "lease_duration_s": 6.0,
                "renew_deadline_s": 4.0,
                "retry_period_s": 0.5,
            },
        }
        data.update(overrides)
        return SchedulerConfig.model_validate(data)


def new_pool() -> Pool:
    pid = uuid.uuid4().hex[:8]
    return Pool(id=pid, namespace=f"ns-{pid}")


async def add_nodes(
    client: AsyncClient, pool: Pool, *, count: int, shape: NodeShape = NodeShape(), prefix: str = "n"
) -> list[str]:
    """Simulated nodes of the pool. No node agent re-writes their heartbeat: it is the creation time,
    so they expire after the scheduler's ``node_heartbeat_expiry_s`` (180 s by default); a test that
    runs longer refreshes it (``set_agent_heartbeat``) or turns the expiry off in its config."""
    return await create_sim_nodes(
        client, count=count, shape=shape, prefix=f"{pool.id}-{prefix}-", labels={POOL_LABEL: pool.id}
    )


async def delete_nodes(client: AsyncClient, pool: Pool) -> None:
    async for node in client.list(Node, labels={POOL_LABEL: pool.id}):
        with contextlib.suppress(Exception):
            await client.delete(Node, node.metadata.name)


def gpu_pod(
    pool: Pool,
    name: str,
    annotations: dict[str, str] | None = None,
    *,
    namespace: str | None = None,
    containers: Iterable[str] = ("app",),
    labels: dict[str, str] | None = None,
    whole_gpus: int = 0,
) -> Pod:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace or pool.namespace,
            "annotations": annotations or {},
            "labels": labels or {},
        },
        "spec": {
            "schedulerName": pool.scheduler_name,
            "containers": [
                {
                    "name": c,
                    "image": "busybox",
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}
                    | ({"limits": {keys.GPU_RESOURCE: str(whole_gpus)}} if whole_gpus else {}),
                }
                for c in containers
            ],
        },
    }
    return Pod.from_dict(body)


async def pods_of(client: AsyncClient, namespace: str) -> list[Pod]:
    return [p async for p in client.list(Pod, namespace=namespace)]


async def nodes_of(client: AsyncClient, pool: Pool) -> list[Node]:
    return [n async for n in client.list(Node, labels={POOL_LABEL: pool.id})]


async def audit_pool(client: AsyncClient, pool: Pool, namespaces: Iterable[str] = ()) -> AuditReport:
    pods: list[Pod] = []
    for ns in {pool.namespace, *namespaces}:
        pods += await pods_of(client, ns)
    return audit(nodes=await nodes_of(client, pool), pods=pods)


async def scheduled_events(client: AsyncClient, namespace: str) -> list[Event]:
    return [
        e
        async for e in client.list(Event, namespace=namespace)
        if e.reason == "Scheduled" and e.reportingComponent == "gpufrac-scheduler"
    ]


async def wait_for(
    check: Callable[[], Awaitable[bool]], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        await asyncio.sleep(interval)


async def wait_bound(client: AsyncClient, namespace: str, count: int, *, timeout: float) -> list[Pod]:
    pods: list[Pod] = []

    async def all_bound() -> bool:
        nonlocal pods
        pods = await pods_of(client, namespace)
        return sum(1 for p in pods if p.spec.nodeName) >= count

    await wait_for(all_bound, timeout=timeout, interval=0.25, what=f"{count} pods bound in {namespace}")
    return pods


async def set_agent_heartbeat(client: AsyncClient, node: str, when: datetime) -> None:
    """Write the node agent's Ready condition with heartbeat ``when``, as the agent's publisher does."""
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": keys.NODE_READY_CONDITION,
        "status": "True",
        "reason": "SimulatedNode",
        "message": "simulated node agent",
        "lastHeartbeatTime": stamp,
    }
    await client.patch(
        Node.Status, node, {"status": {"conditions": [condition]}}, patch_type=PatchType.STRATEGIC
    )


def condition(pod: Pod, kind: str = "PodScheduled") -> tuple[str | None, str | None, str | None]:
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == kind:
            return c.status, c.reason, c.message
    return None, None, None


@contextlib.asynccontextmanager
async def running(
    client: AsyncClient,
    config: SchedulerConfig,
    *,
    identity: str | None = None,
    wait: bool = True,
    engine: PlacementEngine | None = None,
) -> AsyncIterator[SchedulerService]:
    """An in-process scheduler service (with ``engine``, else the one ``config`` describes); stopped,
    and checked to stop, on exit."""
    if engine is None:
        service = build_service(client=client, config=config, identity=identity)
    else:
        service = SchedulerService(client=client, config=config, engine=engine, identity=identity)
    task = asyncio.create_task(service.run(), name=f"scheduler-{service.identity}")
    try:
        if wait:
            await service.wait_scheduling(timeout=30)
        yield service
    finally:
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError), f"scheduler ended with {results[0]!r}"


class SchedulerProcess:
    """``gpufrac scheduler`` as a real process, as a Deployment would run it."""

    def __init__(self, *, kubeconfig: Path, config: SchedulerConfig, workdir: Path, identity: str) -> None:
        self.identity = identity
        self.config_path = workdir / f"scheduler-{identity}.yaml"
        self.log_path = workdir / f"scheduler-{identity}.log"
        self.config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        self._argv = [
            sys.executable,
            "-m",
            "gpufrac",
            "scheduler",
            "--config",
            str(self.config_path),
            "--kubeconfig",
            str(kubeconfig),
            "--identity",
            identity,
            "--log-format",
            "text",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> SchedulerProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self._argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout: float = 20) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop_quietly(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


async def scrape(port: int) -> str:
    async with httpx2.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{port}/metrics")).text


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` whose labels include ``labels``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not in the metrics")


def preemptions_without_io(
    engine: Engine,
    *,
    victim_pod: Callable[[str], Pod | None],
    started: list[str] | None = None,
    release: Callable[[str], bool] = lambda uid: True,
    place_now: Callable[[Pod], None] = lambda pod: None,
    **options: Any,
) -> Preemptions:
    """Preemptions on ``engine`` whose evictions and Events are not run (the decision is what is
    tested); ``started`` collects the names of the tasks it starts."""

    def spawn(coro: Any) -> None:
        if started is not None:
            started.append(coro.cr_code.co_name)
        coro.close()

    return Preemptions(
        client=None,  # type: ignore[arg-type]
        engine=engine,
        events=None,  # type: ignore[arg-type]
        victim_pod=victim_pod,
        release=release,
        place_now=place_now,
        retry=lambda: None,
        spawn=spawn,
        **options,
    )
