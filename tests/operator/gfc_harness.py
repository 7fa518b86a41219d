"""Operator test helpers: wait for the cluster to show something; run an operator in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from lightkube import AsyncClient

from gpufrac.kube.lease import LeaseTiming
from gpufrac.operator.reconciler import Operator, OperatorSettings

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T | None]], *, timeout: float = 15.0, what: str = "") -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what or check}; last: {last!r}")


class Running:
    """An operator on its own task; ``stop()`` cancels it the way SIGTERM does (the lease is released)."""

    def __init__(self, operator: Operator) -> None:
        self.operator = operator
        self.task = asyncio.create_task(operator.run())

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def running(
    client: AsyncClient,
    *,
    leader_elect: bool = False,
    lease_namespace: str = "default",
    identity: str = "op",
    node_heartbeat_expiry_s: float = 180.0,
) -> AsyncIterator[Running]:
    """An operator run in-process for the length of the block."""
    settings = OperatorSettings(
        http_host="127.0.0.1",
        http_port=0,
        leader_elect=leader_elect,
        lease_namespace=lease_namespace,
        lease_timing=LeaseTiming(lease_duration=3.0, renew_deadline=2.0, retry_period=0.3),
        retry_initial_s=0.1,
        retry_max_s=1.0,
        node_heartbeat_expiry_s=node_heartbeat_expiry_s,
    )
    run = Running(Operator(client=client, settings=settings, identity=identity))
    try:
        yield run
    finally:
        await run.stop()
