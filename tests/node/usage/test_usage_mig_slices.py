"""MIG slices in usage reporting: memory per slice on /metrics, strays on a slice, and ``gpufrac top``.

The GPU and its slices are SIMULATED (``SimulatedUsage``), as the NVML backend reports a real MIG GPU: the
parent without processes, each slice a device of its own with its memory and processes.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gpufrac.cli import app
from gpufrac.node.inventory.backend import GpuInfo, MigSliceInfo
from gpufrac.node.metrics import (
    GPU_MEMORY_TOTAL,
    MIG_SLICE_MEMORY_TOTAL,
    MIG_SLICE_MEMORY_USED,
    EnforcementCounters,
    MetricsServer,
    UsageExporter,
    UsageReporter,
    registry_for,
)
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage, SimulatedUsageFile, inventory_devices

GIB = 1024**3
MIB = 1024**2
GPU0 = "GPU-a1000000-0000-4000-8000-000000000000"
SMALL = "MIG-1a000000-0000-4000-8000-000000000001"  # 1g.10gb at 6
LARGE = "MIG-3a000000-0000-4000-8000-000000000002"  # 3g.40gb at 0
C_MIG, C_OTHER = "c" * 64, "d" * 64


def simulated_mig_gpu() -> SimulatedUsage:
    usage = SimulatedUsage()
    usage.add_gpu(uuid=GPU0, index=0, memory_total_bytes=81559 * MIB)
    usage.add_gpu(uuid=SMALL, index=0, memory_total_bytes=9856 * MIB, parent_uuid=GPU0, mig_profile="1g.10gb")
    usage.add_gpu(
        uuid=LARGE, index=0, memory_total_bytes=40192 * MIB, parent_uuid=GPU0, mig_profile="3g.40gb"
    )
    return usage


@pytest.fixture
def on_slice(proc, record, allocations):
    """A container placed on the 1g.10gb slice (the record the NRI plugin writes) using 3 GiB there."""
    usage = simulated_mig_gpu()
    allocations.put(
        record(
            container_id=C_MIG,
            pod_name="isolated",
            devices=[SMALL],
            request_mib=9856,
            mode="mig",
            exclusive=True,
            mig_profiles=("1g.10gb",),
        )
    )
    proc.containerd_v2(pid=70, container_id=C_MIG)
    usage.set_process(gpu=SMALL, pid=70, used_bytes=3 * GIB, sm_ratio=0.5)
    return usage


def serve(usage, allocations, proc):
    counters = EnforcementCounters()
    exporter = UsageExporter(node="mig-node", counters=counters)
    UsageReporter(
        collector=UsageCollector(backend=usage, allocations=allocations, proc_root=proc.root),
        exporter=exporter,
        counters=counters,
    ).collect_once()
    return MetricsServer(registry=registry_for(exporter), host="127.0.0.1", port=0)


def samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def test_each_slice_has_its_memory_used_and_total_with_gpu_profile_and_the_container_on_it(
    on_slice, allocations, proc
):
    server = serve(on_slice, allocations, proc)
    try:
        scraped = samples(server.port)
    finally:
        server.close()

    slices = {
        (n, labels["slice_uuid"]): (labels, v) for n, labels, v in scraped if n.startswith("gpufrac_mig")
    }
    labels, used = slices[(MIG_SLICE_MEMORY_USED, SMALL)]
    assert labels == {
        "node": "mig-node",
        "gpu_uuid": GPU0,
        "gpu_index": "0",
        "slice_uuid": SMALL,
        "profile": "1g.10gb",
        "namespace": "team-a",
        "pod": "isolated",
        "container": "main",
    }
    assert used == 3 * GIB
    assert slices[(MIG_SLICE_MEMORY_TOTAL, SMALL)][1] == 9856 * MIB
    free, free_used = slices[(MIG_SLICE_MEMORY_USED, LARGE)]
    assert (free["profile"], free["pod"], free["container"], free_used) == ("3g.40gb", "", "", 0)
    # The per-GPU series count the GPU once, never its slices beside it.
    assert [labels["gpu_uuid"] for n, labels, _ in scraped if n == GPU_MEMORY_TOTAL] == [GPU0]


def test_a_process_on_a_slice_that_is_not_its_containers_is_a_stray_of_the_managed_gpu(
    on_slice, proc, record, allocations
):
    """The slice counts as managed because its parent GPU is; the MIG container's own slice has no stray."""
    proc.containerd_v2(pid=71, container_id=C_OTHER)
    on_slice.set_process(gpu=LARGE, pid=71, used_bytes=GIB)
    snapshot = UsageCollector(
        backend=on_slice, allocations=allocations, proc_root=proc.root, managed_gpus={GPU0}
    ).collect()

    assert [(s.gpu_uuid, s.pid, s.container_id) for s in snapshot.strays] == [(LARGE, 71, C_OTHER)]
    (mine,) = snapshot.fractions
    assert (mine.gpu_uuid, mine.used_bytes, mine.limit_bytes) == (SMALL, 3 * GIB, 9856 * MIB)


def test_top_shows_each_slice_under_its_gpu_with_the_container_or_free(on_slice, allocations, proc):
    server = serve(on_slice, allocations, proc)
    try:
        result = CliRunner().invoke(app, ["top", "--once", f"127.0.0.1:{server.port}"])
    finally:
        server.close()

    assert result.exit_code == 0, result.output
    table = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines() if "│" in line]
    gpu = next(r for r in table if r[0] == "mig-node")
    assert gpu[1].startswith("0 GPU-a1000000") and "2 MIG slice(s)" in gpu[2]
    small = next(r for r in table if "1g.10gb" in r[1])
    assert small[2:8] == ["team-a/isolated/main", "mig", "9.6Gi", "9.6Gi", "3.0Gi", "50"]
    large = next(r for r in table if "3g.40gb" in r[1])
    assert large[2:7] == ["free", "mig", "39.2Gi", "39.2Gi", "0Mi"]
    assert not [r for r in table if r[1].startswith("0 MIG-")]  # a slice is never shown as a GPU of its own


def test_the_simulated_usage_file_describes_slices_of_an_inventory_gpu(tmp_path):
    path = tmp_path / "usage.json"
    path.write_text(
        json.dumps(
            {
                "gpus": [
                    {
                        "uuid": SMALL,
                        "index": 0,
                        "memory_total_bytes": 9856 * MIB,
                        "parent_uuid": GPU0,
                        "mig_profile": "1g.10gb",
                        "processes": [{"pid": 5, "used_bytes": MIB}],
                    }
                ]
            }
        )
    )
    (sampled,) = SimulatedUsageFile(path=path).sample()
    assert (sampled.parent_uuid, sampled.mig_profile, sampled.processes[0].used_bytes) == (
        GPU0,
        "1g.10gb",
        MIB,
    )


def test_the_simulated_table_has_each_slice_of_an_inventory_gpu_in_mode_mig_beside_the_gpus(tmp_path):
    """What the agent's simulated usage lays the file over: the same devices NVML would report."""
    mig = GpuInfo(
        uuid=GPU0,
        index=0,
        minor=0,
        model="NVIDIA H100 80GB HBM3",
        mib=81559,
        mig=True,
        mig_slices=(MigSliceInfo(profile="1g.10gb", start=6, uuid=SMALL, mib=9856),),
    )
    plain = GpuInfo(uuid="GPU-b", index=1, minor=1, model="NVIDIA H100 80GB HBM3", mib=81559)
    table = SimulatedUsageFile(path=tmp_path / "absent.json", gpus=lambda: inventory_devices([mig, plain]))
    assert [
        (d.uuid, d.index, d.memory_total_bytes // MIB, d.parent_uuid, d.mig_profile) for d in table.sample()
    ] == [
        (GPU0, 0, 81559, None, None),
        (SMALL, 0, 9856, GPU0, "1g.10gb"),
        ("GPU-b", 1, 81559, None, None),
    ]
