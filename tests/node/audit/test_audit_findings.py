"""Each audit finding: its Event, its counter, and the stop through a CRI server."""

from __future__ import annotations

import pytest

from gpufrac.node.enforcement_audit import (
    REASON_MISSING_INJECTION,
    REASON_OVER_LIMIT,
    REASON_UNKNOWN_PROCESS,
    Auditor,
)
from gpufrac.node.inject import EnvPlanner
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.metrics import VIOLATION_KINDS, EnforcementCounters
from gpufrac.node.usage.collect import UsageCollector
from gpufrac.node.usage.simulated import SimulatedUsage

GIB = 1024**3
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
INFER, OTHER, PLAIN = "1" * 64, "2" * 64, "3" * 64

PLAN = {
    "NVIDIA_VISIBLE_DEVICES": GPU0,
    "NVIDIA_GPU_MEMORY_REQUEST": "8192",
    "NVIDIA_GPU_MEMORY_LIMIT": "8192",
    "CUDA_MPS_PIPE_DIRECTORY": "/run/nvidia/mps",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
}
ANNOTATIONS = {  # a placed pod: what the scheduler's binder wrote
    "nvidia.com/container.server.gpu-memory.request": "8Gi",
    "nvidia.com/container.server.gpus.devices": GPU0,
}


@pytest.fixture
def counters() -> EnforcementCounters:
    return EnforcementCounters()


@pytest.fixture
def gpus() -> SimulatedUsage:
    usage = SimulatedUsage()
    usage.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * GIB)
    return usage


@pytest.fixture
def node(runtime, cri, planner, events, counters, gpus, allocations, proc_root):
    """One node: the collector and an auditor wired to the CRI server, as the agent wires them."""

    class Node:
        collector = UsageCollector(backend=gpus, allocations=allocations, proc_root=proc_root)

        def auditor(self, **policy) -> Auditor:
            return Auditor(
                runtime=cri,
                planner=planner,
                events=events,
                counters=counters,
                node_name="gpu-node-1",
                **policy,
            )

    return Node()


def start_infer(runtime, *, env):
    sandbox = runtime.add_pod(namespace="ml", name="infer-0", annotations=ANNOTATIONS)
    runtime.add_container(id=INFER, sandbox_id=sandbox, name="server", env={"PATH": "/usr/bin", **env})


async def test_a_container_created_without_injection_gets_an_event_a_count_and_is_stopped(
    node, runtime, planner, events, counters
):
    start_infer(runtime, env={})
    audit = node.auditor()

    await audit(node.collector.collect())

    assert events.reasons() == [REASON_MISSING_INJECTION]
    kind, namespace, name, _, message = events.emitted[0]
    assert (kind, namespace, name) == ("Pod", "ml", "infer-0")
    assert "NVIDIA_GPU_MEMORY_LIMIT missing" in message
    assert counters.read().violations["missing_injection"] == 1
    assert runtime.stopped == [(INFER, 10)]
    assert not runtime.running(INFER)


async def test_injection_with_a_wrong_value_counts_as_missing(node, runtime, planner, events, counters):
    start_infer(runtime, env={**PLAN, "NVIDIA_GPU_MEMORY_LIMIT": "81920"})

    await node.auditor()(node.collector.collect())

    assert "NVIDIA_GPU_MEMORY_LIMIT='81920', want '8192'" in events.emitted[0][4]
    assert runtime.stopped == [(INFER, 10)]


async def test_a_user_set_enforcement_variable_the_plan_does_not_give_is_a_finding(
    node, runtime, planner, events
):
    start_infer(runtime, env={**PLAN, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})

    await node.auditor()(node.collector.collect())

    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='100' set, want it absent" in events.emitted[0][4]


async def test_correctly_injected_and_non_fractional_containers_are_left_alone(
    node, runtime, planner, events, counters
):
    start_infer(runtime, env=PLAN)
    runtime.add_container(
        id=PLAIN, sandbox_id=runtime.add_pod(namespace="web", name="nginx"), name="web", env={}
    )
    audit = node.auditor()

    await audit(node.collector.collect())
    await audit(node.collector.collect())

    assert events.emitted == []
    assert counters.read().violations == dict.fromkeys(VIOLATION_KINDS, 0)
    assert runtime.stopped == []


async def test_the_toolkits_cdi_spec_setting_the_device_variable_to_void_is_not_a_finding(
    node, runtime, planner, events, counters
):
    """The agent requests ``nvidia.com/gpu=<uuid>`` for the container; NVIDIA's generated CDI spec sets
    ``NVIDIA_VISIBLE_DEVICES=void`` after the plan's variables (NRI applies CDI devices after env), and
    ``void`` gives no GPU through the variable: a correctly injected container is left running."""
    start_infer(runtime, env={**PLAN, "NVIDIA_VISIBLE_DEVICES": "void"})

    await node.auditor()(node.collector.collect())

    assert events.emitted == [] and runtime.stopped == []


async def test_void_devices_without_the_memory_caps_are_still_a_missing_injection(
    node, runtime, planner, events, counters
):
    start_infer(runtime, env={"NVIDIA_VISIBLE_DEVICES": "void"})

    await node.auditor()(node.collector.collect())

    assert events.reasons() == [REASON_MISSING_INJECTION]
    assert "NVIDIA_GPU_MEMORY_LIMIT missing" in events.emitted[0][4]
    assert "NVIDIA_VISIBLE_DEVICES" not in events.emitted[0][4]
    assert runtime.stopped == [(INFER, 10)]


async def test_with_stopping_disabled_the_finding_is_reported_once_and_the_container_keeps_running(
    node, runtime, planner, events, counters
):
    start_infer(runtime, env={})
    audit = node.auditor(stop_missing_injection=False)

    for _ in range(3):
        await audit(node.collector.collect())

    assert events.reasons() == [REASON_MISSING_INJECTION]
    assert counters.read().violations["missing_injection"] == 1
    assert runtime.running(INFER) and runtime.stopped == []


async def test_a_failed_stop_is_retried_at_the_next_cycle_without_counting_again(
    node, runtime, planner, events, counters
):
    start_infer(runtime, env={})
    runtime.fail_stops = 1
    audit = node.auditor()

    await audit(node.collector.collect())
    assert runtime.running(INFER)
    await audit(node.collector.collect())

    assert not runtime.running(INFER)
    assert counters.read().violations["missing_injection"] == 1


async def test_gpu_processes_of_no_fraction_are_reported_against_their_pod_or_the_node(
    node, runtime, planner, events, counters, gpus, spawn
):
    runtime.add_container(
        id=OTHER, sandbox_id=runtime.add_pod(namespace="dev", name="rogue"), name="c", env={}
    )
    spawn(pid=41, container_id=OTHER)
    spawn(pid=42, container_id=None)
    gpus.set_process(gpu=GPU0, pid=41, used_bytes=2 * GIB)
    gpus.set_process(gpu=GPU0, pid=42, used_bytes=GIB)
    audit = node.auditor()

    await audit(node.collector.collect())
    await audit(node.collector.collect())  # still there: no second Event

    assert sorted((e[0], e[2], e[3]) for e in events.emitted) == [
        ("Node", "gpu-node-1", REASON_UNKNOWN_PROCESS),
        ("Pod", "rogue", REASON_UNKNOWN_PROCESS),
    ]
    rogue = next(e for e in events.emitted if e[0] == "Pod")
    assert "process 41" in rogue[4] and "2048 MiB on GPU 0" in rogue[4]
    assert counters.read().violations["unknown_process"] == 2
    assert runtime.stopped == []  # reported, never stopped: it is not ours to stop


async def test_a_container_over_its_limit_in_total_is_reported_and_stopped(
    node, runtime, planner, events, counters, gpus, allocations, spawn, record_infer
):
    start_infer(runtime, env=PLAN)
    allocations.put(record_infer)
    for pid in (51, 52):
        spawn(pid=pid, container_id=INFER)
        gpus.set_process(gpu=GPU0, pid=pid, used_bytes=5 * GIB)  # each under 8 GiB, together over
    audit = node.auditor()

    await audit(node.collector.collect())
    assert events.emitted == []  # one sample may race an allocation and its free
    await audit(node.collector.collect())

    assert events.reasons() == [REASON_OVER_LIMIT]
    assert "uses 10240 MiB on GPU 0" in events.emitted[0][4] and "limit of 8192 MiB" in events.emitted[0][4]
    assert counters.read().violations["over_limit"] == 1
    assert runtime.stopped == [(INFER, 10)]


async def test_over_limit_without_stopping_only_reports(
    node, runtime, planner, events, counters, gpus, allocations, spawn, record_infer
):
    start_infer(runtime, env=PLAN)
    allocations.put(record_infer)
    spawn(pid=51, container_id=INFER)
    gpus.set_process(gpu=GPU0, pid=51, used_bytes=9 * GIB)
    audit = node.auditor(stop_over_limit=False, over_limit_cycles=1)

    await audit(node.collector.collect())

    assert events.reasons() == [REASON_OVER_LIMIT]
    assert runtime.stopped == []


@pytest.fixture
def record_infer():
    return AllocationRecord(
        container_id=INFER,
        pod_namespace="ml",
        pod_name="infer-0",
        container_name="server",
        pod_uid="uid-infer-0",
        devices=(GPU0,),
        request_mib=8192,
        limit_mib=8192,
        mode="time-slicing",
        portion=None,
    )


async def test_a_spec_the_runtime_could_not_give_is_checked_at_the_next_cycle(node, runtime, events):
    start_infer(runtime, env={})
    runtime.fail_status = 1
    audit = node.auditor()

    assert await audit(node.collector.collect()) == []
    await audit(node.collector.collect())

    assert events.reasons() == [REASON_MISSING_INJECTION]


async def test_a_runtime_that_cannot_list_containers_skips_the_cycle(node, runtime, events):
    start_infer(runtime, env={})
    runtime.fail_lists = 1
    audit = node.auditor()

    assert await audit(node.collector.collect()) == []
    await audit(node.collector.collect())

    assert events.reasons() == [REASON_MISSING_INJECTION]


async def test_a_resized_container_the_agent_recorded_keeps_its_created_amounts_without_a_finding(
    node, runtime, cri, events, counters, allocations
):
    """A live resize changed the pod's amounts after the container was created with the old ones: the
    audit restarted with the agent must not call it unenforced -- when the agent recorded it. The same
    environment on a container the agent never recorded (created while it was away) still is a finding."""
    resized = {**ANNOTATIONS, "nvidia.com/container.server.gpu-memory.request": "16Gi"}
    sandbox = runtime.add_pod(namespace="ml", name="infer-0", annotations=resized)
    runtime.add_container(id=INFER, sandbox_id=sandbox, name="server", env={"PATH": "/usr/bin", **PLAN})
    other = runtime.add_pod(namespace="ml", name="infer-1", annotations=resized)
    runtime.add_container(id=OTHER, sandbox_id=other, name="server", env={"PATH": "/usr/bin", **PLAN})
    allocations.put(
        AllocationRecord(
            container_id=INFER,
            pod_namespace="ml",
            pod_name="infer-0",
            pod_uid="u0",
            container_name="server",
            devices=(GPU0,),
            request_mib=16384,
            limit_mib=16384,
            mode="time-slicing",
            portion=None,
        )
    )
    planner = EnvPlanner(recorded=lambda container_id: allocations.get(container_id) is not None)
    audit = Auditor(runtime=cri, planner=planner, events=events, counters=counters, node_name="gpu-node-1")

    raised = await audit(node.collector.collect())

    assert [(f.reason, f.regarding.name) for f in raised] == [(REASON_MISSING_INJECTION, "infer-1")]
    assert "NVIDIA_GPU_MEMORY_REQUEST='8192', want '16384'" in raised[0].message
