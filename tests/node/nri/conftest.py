"""A node in a test: NRI's real runtime-side adaptation (testenv/nriruntime) with gpufrac's plugin on it.

The plugin is reached only the way containerd reaches it: the test asks the runtime program to run pods
and create containers, the adaptation calls every registered plugin over the NRI socket, merges their
adjustments and answers with the container as adjusted -- or with the error a plugin failed it with.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
if importlib.util.find_spec("gpufrac._generated.nri") is None:  # `make testenv` not run yet
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-nri-protos")], check=True)

from gpufrac.local.nriruntime import CreatedContainer, NriRuntime, binary_path  # noqa: E402
from gpufrac.node.mapping import MappingStore  # noqa: E402
from gpufrac.node.nri.handler import GpuInjector  # noqa: E402
from gpufrac.node.nri.plugin import NriPlugin  # noqa: E402

_ids = itertools.count(1)


@pytest.fixture(scope="session")
def nriruntime_binary() -> Path:
    """The runtime program, built on first use (cached: a no-op when up to date)."""
    subprocess.run(["bash", str(ROOT / "testenv" / "nriruntime" / "build.sh")], check=True)
    return binary_path()


@dataclass
class Agent:
    """The node agent's NRI half: plugin, handler and mapping store, running as a task."""

    store: MappingStore
    injector: GpuInjector
    plugin: NriPlugin
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@dataclass
class Node:
    root: Path
    runtime: NriRuntime
    agents: list[Agent] = field(default_factory=list)

    @property
    def socket(self) -> Path:
        return self.root / "nri.sock"

    @property
    def pipe_root(self) -> Path:
        return self.root / "mps-pipes"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def agent(self) -> Agent:
        return self.agents[-1]

    @property
    def store(self) -> MappingStore:
        return self.agent.store

    async def start_agent(self, *, fail_open: bool = False, wait: bool = True) -> Agent:
        store = MappingStore(directory=self.state_dir)
        injector = GpuInjector(store=store, pipe_root=self.pipe_root, fail_open=fail_open)
        plugin = NriPlugin(
            handler=injector, socket_path=str(self.socket), backoff_initial_s=0.02, backoff_max_s=0.2
        )
        agent = Agent(store=store, injector=injector, plugin=plugin, task=asyncio.create_task(plugin.run()))
        self.agents.append(agent)
        if wait:
            await self.runtime.wait_plugins(1, timeout_s=10)
        return agent

    async def pod(
        self, annotations: Mapping[str, str] | None = None, *, name: str | None = None, namespace: str = "ml"
    ) -> str:
        n = next(_ids)
        pod_id = f"pod{n:04d}"
        await self.runtime.run_pod(
            id=pod_id,
            name=name or f"p{n}",
            namespace=namespace,
            uid=f"uid-{n:04d}",
            annotations=annotations or {},
        )
        return pod_id

    async def create(
        self,
        pod_id: str,
        name: str,
        *,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[Mapping[str, Any]] = (),
    ) -> CreatedContainer:
        container_id = f"{pod_id}-{name}-{next(_ids):04d}"
        return await self.runtime.create_container(
            id=container_id, pod_id=pod_id, name=name, env=env or {"PATH": "/usr/bin"}, mounts=mounts
        )


@pytest.fixture
async def make_node(nriruntime_binary: Path) -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    nodes: list[Node] = []

    async def make(*, fail_open: bool = False, agent: bool = True) -> Node:
        # Short path: a unix socket path must fit in 108 bytes.
        root = Path(tempfile.mkdtemp(prefix="nri", dir="/tmp"))
        runtime = NriRuntime(socket_path=root / "nri.sock", binary=nriruntime_binary)
        await runtime.start()
        node = Node(root=root, runtime=runtime)
        nodes.append(node)
        if agent:
            await node.start_agent(fail_open=fail_open)
        return node

    yield make
    for node in nodes:
        for agent in node.agents:
            await agent.stop()
        await node.runtime.stop()
        shutil.rmtree(node.root, ignore_errors=True)


@pytest.fixture
async def node(make_node: Callable[..., Awaitable[Node]]) -> Node:
    return await make_node()
