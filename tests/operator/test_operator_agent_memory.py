"""The operator sizes the node agent's memory from the GPU count of the nodes it selects (real API
server): NVIDIA measured about 50 MiB per GPU for an MPS server, and a 256Mi limit failed on more than 5
GPUs, so a fixed limit is wrong for every node but one size."""

from __future__ import annotations

from typing import Any

import pytest
from gfc_harness import eventually, running
from lightkube import AsyncClient
from test_operator_kube import MakeConfig, MakeNode, agent, get_ds

pytestmark = pytest.mark.usefixtures("crd")


async def test_the_agent_memory_follows_the_largest_selected_node(
    akube: AsyncClient, namespace: str, tag: str, make_config: MakeConfig, make_node: MakeNode
) -> None:
    pool = {"test.gpufrac.io/pool": tag}
    await make_node(f"small-{tag}", {**pool, "nvidia.com/gpu.count": "4"})
    name = f"mem-{tag}"
    await make_config(name, {"namespace": namespace, "nodeAgent": agent(tag, mps={"enabled": True})})

    async def memory(expected: str) -> Any:
        ds = await get_ds(akube, namespace, name)
        resources = ds.spec.template.spec.containers[0].resources if ds else None
        return resources if resources and resources.limits.get("memory") == expected else None

    async with running(akube):
        # 4 GPUs: sized for one step of 8 (256 MiB + 8 x (16 + 50 for the MPS server)).
        eight = await eventually(lambda: memory("784Mi"), what="an agent sized for 8 GPUs")
        assert eight.requests["memory"] == "784Mi"
        # A 10-GPU node joins (GPU feature discovery's count): the next step, 16 GPUs.
        await make_node(f"big-{tag}", {**pool, "nvidia.com/gpu.count": "10"})
        await eventually(lambda: memory(f"{256 + 16 * 66}Mi"), what="an agent sized for 16 GPUs")
