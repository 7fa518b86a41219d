"""docs/queues.md's worked example on the real API server: the table's queues as Queue objects, pods whose
requests add up to each queue's demand, and the scheduler's Queue status must say the table's fair
shares (issue #36: one tree, one capacity, one share, and the docs' numbers are the system's).

Reclaim and preemption are off, so no pod leaves: placing a pod moves its request from waiting to held
and the demand stays what the table says whatever the scheduler places.
"""

from __future__ import annotations

from pathlib import Path

from lightkube import AsyncClient
from sched_harness import Pool, add_nodes, gpu_pod, running, wait_for
from test_queues import _create, queue_crds, queues  # noqa: F401  (fixtures)

from gpufrac.contract import keys
from gpufrac.local.simnodes import NodeShape
from gpufrac.scheduler.queues import GpufracQueue

DOC = Path(__file__).resolve().parents[2] / "docs" / "queues.md"
GPU_MIB = 81920


def worked_example() -> list[dict[str, str]]:
    """The table between the worked-example markers, a dict per row."""
    table = DOC.read_text().split("<!-- worked-example -->")[1].split("<!-- /worked-example -->")[0]
    lines = table.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]
    ]


def pod_sizes(demand: int) -> list[int]:
    """``demand`` MiB as the fewest pods that each fit one GPU (equal but for the last one's remainder)."""
    count = -(-demand // GPU_MIB)
    size = demand // count
    return [size] * (count - 1) + [demand - size * (count - 1)]


async def test_the_queue_status_says_the_worked_examples_fair_shares(
    client: AsyncClient,
    pool: Pool,
    queues: list[tuple[type, str]],  # noqa: F811
) -> None:
    rows = worked_example()
    await add_nodes(client, pool, count=4, shape=NodeShape(gpus=2, model="A100-80GB"))
    p = pool.id
    for row in rows:
        spec: dict = {"resources": {"gpuMemory": {"deserved": int(row["deserved"])}}}
        spec["resources"]["gpuMemory"]["overQuotaWeight"] = float(row["weight"])
        if row["limit"]:
            spec["resources"]["gpuMemory"]["limit"] = int(row["limit"])
        if row["parent"]:
            spec["parentQueue"] = f"{p}-{row['parent']}"
        await _create(client, queues, GpufracQueue, f"{p}-{row['queue']}", spec)
    config = pool.config(queue_status_interval_s=0.2, node_heartbeat_expiry_s=None, preemption=False)
    async with running(client, config):
        for row in rows:
            for i, size in enumerate(pod_sizes(int(row["demand"])) if row["demand"] else []):
                labels = {keys.QUEUE_LABEL: f"{p}-{row['queue']}"}
                await client.create(
                    gpu_pod(pool, f"{row['queue']}-{i}", {"gpu-memory": str(size)}, labels=labels)
                )
        expected = {row["queue"]: int(row["fair share"]) for row in rows}
        demand = {row["queue"]: int(row["demand"]) for row in rows if row["demand"]}
        seen: dict[str, object] = {}

        async def as_documented() -> bool:
            for row in rows:
                status = (await client.get(GpufracQueue, f"{p}-{row['queue']}")).status or {}
                seen[row["queue"]] = (
                    status.get("requested", {}).get("gpuMemory"),
                    status.get("fairShare", {}),
                )
            # Both: a queue's share can reach the table's before the last of its pods is counted (batch's
            # does after its first pod), so the demand is waited for too, not read at that moment.
            return all(
                seen[q][1].get("gpuMemory") == share  # type: ignore[union-attr]
                for q, share in expected.items()
            ) and all(seen[q][0] == asked for q, asked in demand.items())

        try:
            await wait_for(
                as_documented, timeout=30, what=f"the documented fair shares {expected} and demand {demand}"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the Queue status said (requested, fairShare): {seen}") from None
        # The demand the table states is the demand the scheduler counted (research: its children's).
        for row in rows:
            if row["demand"]:
                assert seen[row["queue"]][0] == int(row["demand"]), (row["queue"], seen)
        assert seen["research"][0] == sum(int(r["demand"]) for r in rows if r["parent"] == "research")
