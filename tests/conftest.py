"""Shared fixtures: one real control plane per test session, one per worker under `make test` (see
gpufrac.local.controlplane).

Starting kube-apiserver and etcd takes seconds, so the session shares one; tests isolate themselves
by namespace (the ``namespace`` fixture). A test that needs different server flags or a restart
starts its own ``ControlPlane``. Tests that use the control plane are marked ``kube`` automatically,
so ``pytest -m "not kube"`` runs everything that needs no Go build.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from lightkube import ApiError, AsyncClient, Client
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace

from gpufrac.local.controlplane import ControlPlane, ControlPlaneError, find_binary
from real_layers import ONE_WORKER_GROUP, RealLayerGuard, machine_lacks, required, runs_the_machines_runtime


def pytest_configure(config: pytest.Config) -> None:
    # CI must not go green with its real-node layers skipped (tests/real_layers.py says why and how).
    if required(os.environ):
        config.pluginmanager.register(
            RealLayerGuard(lacks=machine_lacks(euid=os.geteuid())), "gpufrac-real-layer-guard"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "controlplane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kube)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it (or with -p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadgroup`` (``make test``): every test of the machine's runtime stack in one work
    unit, so one worker runs them one after another, and every other test a unit of its own. The group
    is chosen here by path rather than with xdist's ``xdist_group`` marker, whose nodeid suffix pytest 9
    no longer lets a plugin set (``Item._nodeid``)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class RuntimeStackInOneWorker(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER_GROUP if runs_the_machines_runtime(nodeid) else nodeid

    return RuntimeStackInOneWorker(config, log)


@pytest.fixture(scope="session")
def controlplane() -> Iterator[ControlPlane]:
    try:
        find_binary()
    except ControlPlaneError as exc:
        pytest.fail(str(exc), pytrace=False)
    with ControlPlane() as cp:
        yield cp


@pytest.fixture(scope="session")
def kube(controlplane: ControlPlane) -> Iterator[Client]:
    """A synchronous admin client."""
    with controlplane.client() as client:
        yield client


@pytest.fixture
async def akube(controlplane: ControlPlane) -> AsyncIterator[AsyncClient]:
    """An asynchronous admin client, one per test so it belongs to the test's event loop."""
    client = controlplane.async_client()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube: Client) -> Iterator[str]:
    """A fresh namespace named after the test; deleted afterwards (it stays Terminating: no
    namespace controller runs, but nothing else will use it)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    kube.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    try:
        kube.delete(Namespace, name)
    except ApiError as exc:
        if exc.status.code != 404:
            raise


#: A test still running after this long is reported with every asyncio task's stack, so a hang in CI
#: shows where it waits instead of only running into CI's time limit.
HANG_REPORT_AFTER_S = float(os.environ.get("GPUFRAC_HANG_REPORT_S", "180"))


@pytest.fixture(autouse=True)
async def _report_hangs(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    import asyncio
    import sys

    def report() -> None:
        print(
            f"\n=== {request.node.nodeid} still running after {HANG_REPORT_AFTER_S:.0f}s; tasks:",
            file=sys.stderr,
        )
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    handle = asyncio.get_running_loop().call_later(HANG_REPORT_AFTER_S, report)
    try:
        yield
    finally:
        handle.cancel()
