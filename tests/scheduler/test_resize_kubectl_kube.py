"""``kubectl gpufrac resize POD`` as a process against the real API server with the scheduler running:
the request written, the scheduler's answer waited for and printed (resized, or why not)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from sched_harness import Pool, add_nodes, gpu_pod, running, wait_bound

from gpufrac.contract import keys
from gpufrac.local.controlplane import ControlPlane
from gpufrac.local.simnodes import NodeShape

PLUGIN = (sys.executable, "-m", "gpufrac.kubectl")
REQ = keys.memory_request_key("app")


async def plugin(kubeconfig: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *PLUGIN,
        "--kubeconfig",
        str(kubeconfig),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_resize_waits_for_the_scheduler_and_prints_its_answer(
    client: AsyncClient, pool: Pool, controlplane: ControlPlane
) -> None:
    await add_nodes(client, pool, count=1, shape=NodeShape(gpus=1, gpu_mib=16384))
    async with running(client, pool.config()):
        for name in ("a", "b"):
            await client.create(gpu_pod(pool, name, {REQ: "4Gi"}))
        await wait_bound(client, pool.namespace, 2, timeout=30)
        config = controlplane.kubeconfig
        code, out, err = await plugin(config, "resize", "a", "-n", pool.namespace, "--memory-request", "8Gi")
        assert code == 0, err
        assert "Resized: container app: request 8192Mi, limit 8192Mi" in out
        pod = await client.get(Pod, "a", namespace=pool.namespace)
        assert (pod.metadata.annotations or {})[REQ] == "8192Mi"

        code, out, err = await plugin(config, "resize", "a", "-n", pool.namespace, "--fraction", "0.9")
        assert code == 0, out  # deferred: the request stays, resized when room frees
        assert "Deferred: GPU" in out and f"{pool.namespace}/b 4096 MiB" in out  # 14745 MiB beside b's 4096
        code, out, err = await plugin(config, "resize", "b", "-n", pool.namespace, "--memory-request", "20Gi")
        assert code == 1 and "Infeasible: GPU" in out and "16384 MiB in all" in out, (out, err)
        code, _, err = await plugin(
            config, "resize", "a", "-n", pool.namespace, "--fraction", "0.5", "--memory-limit", "1Gi"
        )
        assert code == 2 and "not both" in err
        code, out, err = await plugin(config, "resize", "b", "-n", pool.namespace, "--compute", "0.5")
        assert code == 1 and "Infeasible: container app runs time-slicing" in out, (out, err)
