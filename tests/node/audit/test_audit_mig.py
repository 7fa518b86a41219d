"""The audit of a container on a MIG slice: exactly its slice, nothing of a fraction, nothing else.

The container's spec comes over real CRI from the fake runtime; its GPU processes from the SIMULATED usage
backend, which reports a MIG GPU as NVML does: each slice a device with its own processes.
"""

from __future__ import annotations

import pytest

from gpufrac.contract import keys
from gpufrac.node.enforcement_audit import REASON_MISSING_INJECTION, REASON_UNKNOWN_PROCESS, Auditor
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.metrics import MISSING_INJECTION, UNKNOWN_PROCESS, EnforcementCounters
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

MIB = 1024**2
GPU0 = "GPU-00000000-0000-4000-8000-0000000000a0"
SLICE_S = "MIG-00000000-0000-4000-8000-0000000000a1"  # 1g.10gb, the container's
SLICE_L = "MIG-00000000-0000-4000-8000-0000000000a2"  # 3g.40gb, free
ISOLATED = "9" * 64
ANNOTATIONS = {  # placed on the 1g.10gb slice: what the scheduler's binder wrote
    keys.mig_key("job", keys.MIG_PROFILE): "1g.10gb",
    keys.devices_key("job"): SLICE_S,
}


@pytest.fixture
def counters() -> EnforcementCounters:
    return EnforcementCounters()


@pytest.fixture
def usage() -> SimulatedUsage:
    gpus = SimulatedUsage()
    gpus.add_gpu(uuid=GPU0, index=0, memory_total_bytes=81559 * MIB)
    gpus.add_gpu(
        uuid=SLICE_S, index=0, memory_total_bytes=9856 * MIB, parent_uuid=GPU0, mig_profile="1g.10gb"
    )
    gpus.add_gpu(
        uuid=SLICE_L, index=0, memory_total_bytes=40192 * MIB, parent_uuid=GPU0, mig_profile="3g.40gb"
    )
    return gpus


@pytest.fixture
def audit(cri, planner, events, counters) -> Auditor:
    return Auditor(runtime=cri, planner=planner, events=events, counters=counters, node_name="mig-node")


def start(runtime, *, env: dict[str, str]) -> None:
    sandbox = runtime.add_pod(namespace="secure", name="isolated", annotations=ANNOTATIONS)
    runtime.add_container(id=ISOLATED, sandbox_id=sandbox, name="job", env={"PATH": "/usr/bin", **env})


def collector(usage, allocations, proc_root) -> UsageCollector:
    return UsageCollector(backend=usage, allocations=allocations, proc_root=proc_root, managed_gpus={GPU0})


@pytest.mark.parametrize("visible", [SLICE_S, "void"])  # void: the toolkit's CDI spec for the slice set it
async def test_a_container_on_exactly_its_slice_and_nothing_else_is_no_finding(
    runtime, audit, events, usage, allocations, proc_root, visible
):
    start(runtime, env={"NVIDIA_VISIBLE_DEVICES": visible})
    assert await audit(collector(usage, allocations, proc_root).collect()) == []
    assert events.emitted == [] and runtime.stopped == []


async def test_fraction_or_mps_variables_or_another_slice_in_a_mig_container_are_found_and_it_is_stopped(
    runtime, audit, events, counters, usage, allocations, proc_root
):
    start(
        runtime,
        env={
            "NVIDIA_VISIBLE_DEVICES": f"{SLICE_S},{SLICE_L}",
            "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
            "NVIDIA_GPU_MEMORY_LIMIT": "40192",
        },
    )
    (finding,) = await audit(collector(usage, allocations, proc_root).collect())

    assert (finding.kind, finding.reason) == (MISSING_INJECTION, REASON_MISSING_INJECTION)
    assert finding.message == (
        f"secure/isolated container job does not run on exactly its MIG slices {SLICE_S} "
        f"(NVIDIA_VISIBLE_DEVICES='{SLICE_S},{SLICE_L}', want '{SLICE_S}'; "
        "CUDA_MPS_PIPE_DIRECTORY='/run/nvidia/mps' set, want it absent; "
        "NVIDIA_GPU_MEMORY_LIMIT='40192' set, want it absent); stopping it so the kubelet recreates it"
    )
    assert [s[0] for s in runtime.stopped] == [ISOLATED]
    assert counters.read().violations[MISSING_INJECTION] == 1


async def test_a_process_of_the_mig_container_on_a_slice_not_its_own_is_an_unknown_process_naming_both(
    runtime, audit, events, counters, usage, allocations, proc_root
):
    start(runtime, env={"NVIDIA_VISIBLE_DEVICES": SLICE_S})
    allocations.put(
        AllocationRecord(
            container_id=ISOLATED,
            pod_namespace="secure",
            pod_name="isolated",
            pod_uid="uid-isolated",
            container_name="job",
            devices=(SLICE_S,),
            request_mib=9856,
            limit_mib=9856,
            mode="mig",
            portion=None,
            exclusive=True,
            mig_profiles=("1g.10gb",),
        )
    )
    cgroup = f"0::/kubepods.slice/kubepods-poduid.slice/cri-containerd-{ISOLATED}.scope\n"
    for pid in (500, 501):
        (proc_root / str(pid)).mkdir(parents=True)
        (proc_root / str(pid) / "cgroup").write_text(cgroup)
        (proc_root / str(pid) / "comm").write_text("python3\n")
    usage.set_process(gpu=SLICE_S, pid=500, used_bytes=2048 * MIB)  # its own slice: fine
    usage.set_process(gpu=SLICE_L, pid=501, used_bytes=1024 * MIB)  # the other slice: found

    (finding,) = await audit(collector(usage, allocations, proc_root).collect())
    assert (finding.kind, finding.reason) == (UNKNOWN_PROCESS, REASON_UNKNOWN_PROCESS)
    assert finding.message == (
        "process 501 (container job of pod secure/isolated) uses 1024 MiB on MIG slice 3g.40gb "
        f"({SLICE_L}) of GPU 0 but is not the container placed on that slice; its container is placed on "
        f"{SLICE_S}"
    )
    assert (finding.regarding.namespace, finding.regarding.name) == ("secure", "isolated")
