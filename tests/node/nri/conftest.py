"""Fixtures for the NRI tests; the node harness itself is in ``nri_harness``."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from nri_harness import ROOT, Node

from gpufrac.local.nriruntime import NriRuntime, binary_path
from gpufrac.node.memlimit.simulated import SimulatedToolkitHook


@pytest.fixture(scope="session")
def nriruntime_binary() -> Path:
    """The runtime program, built on first use (cached: a no-op when up to date)."""
    subprocess.run(["bash", str(ROOT / "testenv" / "nriruntime" / "build.sh")], check=True)
    return binary_path()


@pytest.fixture
async def make_node(nriruntime_binary: Path) -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    nodes: list[Node] = []

    async def make(
        *,
        fail_open: bool = False,
        agent: bool = True,
        default_validator: bool = False,
        cgroups: bool = False,
        toolkit_hook: bool = False,
    ) -> Node:
        # Short path: a unix socket path must fit in 108 bytes.
        root = Path(tempfile.mkdtemp(prefix="nri", dir="/tmp"))
        runtime = NriRuntime(
            socket_path=root / "nri.sock",
            binary=nriruntime_binary,
            default_validator=default_validator,
            cgroup_root=root / "cgroupfs" if cgroups else None,
            # SIMULATED: the toolkit's memory-limit hook, writing to the node's simulated driver.
            toolkit_hook=SimulatedToolkitHook(path=root / "driver-limits.json") if toolkit_hook else None,
        )
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
