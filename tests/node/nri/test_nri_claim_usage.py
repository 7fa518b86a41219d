"""A DRA claim's container is a fraction to the node's usage path: recorded at CreateContainer (and by
Synchronize) from the claim's prepared CDI spec, so its GPU processes count for it and ``gpufrac top``
shows its memory against the request and limit the claim's allocation gives -- not a stray process.

The claim is prepared by the DRA plugin's own code (``prepare_claim``, ``cdi_spec``, ``write_spec``); the
container reaches the agent through NRI's real runtime side with the CDI devices the kubelet gives it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nri_harness import GPU_A, GPU_B, Node
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.contract import keys
from gpufrac.contract.dra import class_config, device_name
from gpufrac.node.dra.prepare import cdi_spec, prepare_claim, write_spec
from gpufrac.node.memlimit.condition import pod_condition
from gpufrac.node.memlimit.enforcer import limit_report
from gpufrac.node.metrics import (
    EnforcementCounters,
    MetricsServer,
    UsageExporter,
    UsageReporter,
    registry_for,
)
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

GIB = 1024**3
UID = "3f1b9e0c-1111-2222-3333-444455556666"


def allocated_claim(*, memory: str, limit: str | None, devices: tuple[str, ...] = (GPU_A,)) -> dict[str, Any]:
    """A ResourceClaim as gpufrac-scheduler (or kube-scheduler) leaves it: shares of our driver's GPUs."""
    return {
        "metadata": {"name": "share", "namespace": "team-a", "uid": UID},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": keys.DRA_DRIVER_NAME,
                            "pool": "node-1",
                            "device": device_name(uuid, index),
                            "consumedCapacity": {keys.DRA_MEMORY_CAPACITY: memory},
                        }
                        for index, uuid in enumerate((GPU_A, GPU_B))
                        if uuid in devices
                    ],
                    "config": [class_config("time-slicing", memory_limit=limit)],
                }
            }
        },
    }


def prepare(claim: dict[str, Any], cdi_dir: Path, pipe_root: Path) -> list[str]:
    """The DRA plugin's prepare: the claim's CDI spec in ``cdi_dir``; the CDI devices a container gets."""
    uuids = {device_name(GPU_A, 0): GPU_A, device_name(GPU_B, 1): GPU_B}
    shares = prepare_claim(claim, uuids=uuids, pipe_root=str(pipe_root))
    write_spec(cdi_dir, UID, cdi_spec(UID, shares, claim="team-a/share"))
    return [name for share in shares for name in share.cdi_device_ids]


async def test_a_claim_container_is_recorded_with_its_claims_share_and_top_shows_its_usage(
    make_node: Callable[..., Awaitable[Node]], tmp_path: Path
) -> None:
    node = await make_node(agent=False, cgroups=True)
    cdi_dir = node.root / "cdi"
    agent = await node.start_agent(cdi_dir=cdi_dir, limits=True)
    cdi_devices = prepare(allocated_claim(memory="20Gi", limit="30Gi"), cdi_dir, node.pipe_root)
    pod = await node.pod(name="infer", namespace="team-a")
    created = await node.create(pod, "server", cdi_devices=cdi_devices, container_id="c1" * 32)
    assert not created.adjust.get("env")  # the claim's spec carries the injection, not NRI
    await node.runtime.start_container(created.id)

    (record,) = node.store.allocations()
    assert (record.container_id, record.pod_name, record.container_name) == (created.id, "infer", "server")
    assert (record.devices, record.request_mib, record.limit_mib) == ((GPU_A,), 20480, 30720)
    assert (record.mode, record.exclusive, record.claims) == ("time-slicing", False, ("team-a/share",))
    # The agent neither sets nor reads back a claim's limit (its CDI spec's variables do): no
    # GpuMemoryEnforced condition, not counted as an unverified fraction.
    assert agent.limits is not None and agent.limits.booked() == []
    assert pod_condition([record], {}) is None
    assert limit_report(agent.limits, [record]).running == 0

    # Its process on the GPU is its own (before: a process that belongs to no fraction).
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    scope = f"kubepods-podf00.slice/cri-containerd-{created.id}.scope"
    (proc / "cgroup").write_text(f"0::/kubepods.slice/{scope}\n")
    (proc / "comm").write_text("python3\n")
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU_A, index=0, memory_total_bytes=80 * GIB)
    gpus.set_process(gpu=GPU_A, pid=4242, used_bytes=12 * GIB, sm_ratio=0.5)
    counters = EnforcementCounters()
    exporter = UsageExporter(node="gpu-node-1", counters=counters)
    snapshot = UsageReporter(
        collector=UsageCollector(backend=gpus, allocations=node.store, proc_root=tmp_path / "proc"),
        exporter=exporter,
        counters=counters,
    ).collect_once()
    assert snapshot.strays == ()
    server = MetricsServer(registry=registry_for(exporter), host="127.0.0.1", port=0)
    try:
        result = CliRunner().invoke(app, ["top", "--once", f"127.0.0.1:{server.port}"])
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines() if "│" in line]
    (row,) = (r for r in rows if r[2] == "team-a/infer/server")
    assert row[3:8] == ["time-slicing", "20.0Gi", "30.0Gi", "12.0Gi", "50"]


async def test_synchronize_records_running_claim_containers_and_removal_forgets_them(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    """An agent that (re)connects finds claim containers that already run, as it finds annotation ones;
    a share on two GPUs is one record with both."""
    node = await make_node(agent=False)
    cdi_dir = node.root / "cdi"
    first = await node.start_agent(cdi_dir=cdi_dir)
    cdi_devices = prepare(
        allocated_claim(memory="10Gi", limit=None, devices=(GPU_A, GPU_B)), cdi_dir, node.pipe_root
    )
    pod = await node.pod(name="train", namespace="team-a")
    created = await node.create(pod, "trainer", cdi_devices=cdi_devices)
    await first.stop()

    second = await node.start_agent(cdi_dir=cdi_dir)
    await second.plugin.synchronized.wait()
    (record,) = second.store.allocations()
    assert (record.container_id, record.devices) == (created.id, (GPU_A, GPU_B))
    assert (record.request_mib, record.limit_mib, record.claims) == (10240, 10240, ("team-a/share",))

    await node.runtime.remove_container(created.id)
    assert second.store.allocations() == []
