"""The binding cycle's gate: at most ``bind_concurrency`` binds wait on the API server at once, the rest
queue behind them, and every pod of a burst is bound and reported once the server answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from gpufrac.scheduler.bind_cycle import BackgroundTasks, BindCycle
from gpufrac.scheduler.binder import BindResult, Outcome
from gpufrac.scheduler.config import SchedulerConfig
from gpufrac.scheduler.metrics import SchedulerMetrics


class SlowServer:
    """A binder whose every Binding waits until the test lets the API server answer."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()
        self.waiting = 0
        self.most_waiting = 0
        self.bound: list[str] = []

    async def bind(self, pod: Pod, *, request: Any, placement: Any) -> BindResult:
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            await self.answer.wait()
        finally:
            self.waiting -= 1
        self.bound.append(pod.metadata.name)
        return BindResult(Outcome.BOUND)


class Calls:
    """Stands in for the cache, queue and status reporter: records which pods each call named."""

    def __init__(self) -> None:
        self.finished: list[str] = []
        self.scheduled: list[str] = []

    def finish_binding(self, uid: str) -> None:
        self.finished.append(uid)

    def forget_failures(self, uid: str) -> None:
        pass

    def scheduled_pod(self, pod: Pod, placement: Any) -> None:
        self.scheduled.append(pod.metadata.name)


def cycle_with(server: SlowServer, calls: Calls, concurrency: int) -> BindCycle:
    report = type("Report", (), {"scheduled": staticmethod(calls.scheduled_pod)})()
    return BindCycle(
        binder=server,  # type: ignore[arg-type]
        write_claims=None,
        cache=calls,  # type: ignore[arg-type]
        queue=calls,  # type: ignore[arg-type]
        queue_of=lambda pod: "default",
        report=report,
        metrics=SchedulerMetrics(),
        latest=lambda pod: pod,
        arrived=lambda uid: None,
        chores=BackgroundTasks(),
        concurrency=concurrency,
    )


async def settle(server: SlowServer) -> None:
    for _ in range(50):  # let every spawned bind run up to the gate or the server
        await asyncio.sleep(0)


@pytest.mark.parametrize("concurrency", [1, 3, 7])
async def test_no_more_binds_wait_on_the_server_than_the_gate_allows(concurrency: int) -> None:
    server, calls = SlowServer(), Calls()
    cycle = cycle_with(server, calls, concurrency)
    names = [f"p{i}" for i in range(20)]
    for name in names:
        cycle.start(
            Pod(metadata=ObjectMeta(name=name, namespace="team", uid=f"uid-{name}")), None, None, None
        )  # type: ignore[arg-type]
    await settle(server)
    assert server.waiting == concurrency, "the gate lets exactly bind_concurrency binds reach the server"
    assert cycle.busy() and len(cycle.in_flight) == len(names)
    server.answer.set()
    await cycle.drain(grace=5)
    assert server.most_waiting == concurrency
    assert sorted(server.bound) == sorted(names) == sorted(calls.scheduled)
    assert cycle.bound_total == len(names) and not cycle.in_flight


def test_the_default_gate_is_wider_than_a_create_burst_client() -> None:
    """A bench client keeps 64 creates in flight; binds held to fewer fell behind them on a busy API
    server (p50 2.3 s at 32 against 0.45 s at 128, docs/benchmarks.md)."""
    assert SchedulerConfig().bind_concurrency >= 128
