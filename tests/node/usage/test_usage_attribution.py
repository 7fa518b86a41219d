"""Attribution of GPU processes to fractions, aggregation, idle fractions, entitlement."""

from __future__ import annotations

import pytest

from gpufrac.node.usage.cgroup import container_id_in
from gpufrac.node.usage.collect import UsageCollector, UsageSnapshot
from gpufrac.node.usage.simulated import SimulatedUsage

GIB = 1024**3
MIB = 1024**2
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


@pytest.fixture
def gpus() -> SimulatedUsage:
    usage = SimulatedUsage()
    usage.add_gpu(uuid=GPU0, index=0, memory_total_bytes=80 * GIB)
    usage.add_gpu(uuid=GPU1, index=1, memory_total_bytes=80 * GIB)
    return usage


def collector(gpus, allocations, proc) -> UsageCollector:
    return UsageCollector(backend=gpus, allocations=allocations, proc_root=proc.root, clock=lambda: 1000.0)


def fraction(snapshot: UsageSnapshot, container_id: str, gpu: str = GPU0):
    (found,) = [
        f for f in snapshot.fractions if f.allocation.container_id == container_id and f.gpu_uuid == gpu
    ]
    return found


def test_two_containers_on_one_gpu_are_attributed_to_their_own_pods(gpus, proc, record, allocations):
    for placed in [
        record(
            container_id=A, pod_name="infer-0", container_name="server", devices=[GPU0], request_mib=10240
        ),
        record(container_id=B, pod_name="notebook", container_name="lab", devices=[GPU0], request_mib=20480),
    ]:
        allocations.put(placed)
    proc.containerd_v2(pid=101, container_id=A)
    proc.crio_v1(pid=202, container_id=B)
    gpus.set_process(gpu=GPU0, pid=101, used_bytes=3 * GIB, sm_ratio=0.4)
    gpus.set_process(gpu=GPU0, pid=202, used_bytes=5 * GIB, sm_ratio=0.1)

    snapshot = collector(gpus, allocations, proc).collect()

    infer, notebook = fraction(snapshot, A), fraction(snapshot, B)
    assert (infer.allocation.pod_name, infer.used_bytes, infer.pids) == ("infer-0", 3 * GIB, (101,))
    assert (notebook.allocation.pod_name, notebook.used_bytes, notebook.pids) == ("notebook", 5 * GIB, (202,))
    assert (infer.request_bytes, notebook.request_bytes) == (10 * GIB, 20 * GIB)
    gpu0 = next(g for g in snapshot.gpus if g.uuid == GPU0)
    assert (gpu0.used_bytes, gpu0.allocated_bytes, gpu0.unattributed_bytes) == (8 * GIB, 30 * GIB, 0)
    assert snapshot.strays == ()


def test_processes_of_one_container_are_summed_per_gpu(gpus, proc, record, allocations):
    allocations.put(
        record(container_id=A, pod_name="trainer", devices=[GPU0, GPU1], request_mib=4096, limit_mib=8192)
    )
    for pid in (11, 12, 13):
        proc.cgroupfs_v1(pid=pid, container_id=A)
    gpus.set_process(gpu=GPU0, pid=11, used_bytes=1 * GIB, sm_ratio=0.2)
    gpus.set_process(gpu=GPU0, pid=12, used_bytes=2 * GIB, sm_ratio=0.3)
    gpus.set_process(gpu=GPU1, pid=13, used_bytes=512 * MIB, sm_ratio=0.0)

    snapshot = collector(gpus, allocations, proc).collect()

    on0, on1 = fraction(snapshot, A, GPU0), fraction(snapshot, A, GPU1)
    assert (on0.used_bytes, on0.sm_ratio, on0.pids) == (3 * GIB, pytest.approx(0.5), (11, 12))
    assert (on1.used_bytes, on1.sm_ratio, on1.pids) == (512 * MIB, 0.0, (13,))
    assert on0.limit_bytes == 8 * GIB


def test_a_fraction_that_has_not_touched_its_gpu_shows_zeros(gpus, proc, record, allocations):
    allocations.put(record(container_id=C, pod_name="idle", devices=[GPU1], request_mib=1024))

    snapshot = collector(gpus, allocations, proc).collect()

    idle = fraction(snapshot, C, GPU1)
    assert (idle.used_bytes, idle.sm_ratio, idle.received_ratio, idle.pids) == (0, 0.0, 0.0, ())
    assert idle.entitlement_ratio == 1.0  # alone on the GPU: all of it the moment it starts


@pytest.mark.parametrize(
    ("busy", "expected_busy", "expected_idle"),
    [(1, 1.0, 0.5), (2, 0.5, 1 / 3), (3, 1 / 3, 0.25)],
)
def test_time_slicing_entitlement_is_an_equal_share_of_the_busy_tenants(
    gpus, proc, record, allocations, busy, expected_busy, expected_idle
):
    ids = [A, B, C, D]
    for n, container_id in enumerate(ids):
        allocations.put(record(container_id=container_id, pod_name=f"p{n}", devices=[GPU0], request_mib=1024))
        proc.containerd_v2(pid=500 + n, container_id=container_id)
    for n in range(busy):
        gpus.set_process(gpu=GPU0, pid=500 + n, used_bytes=GIB, sm_ratio=0.3)
    gpus.set_process(gpu=GPU0, pid=503, used_bytes=GIB, sm_ratio=0.0)  # holds memory, runs no kernels

    snapshot = collector(gpus, allocations, proc).collect()

    for n in range(busy):
        f = fraction(snapshot, ids[n])
        assert f.entitlement_ratio == pytest.approx(expected_busy)
        assert f.received_ratio == pytest.approx(1 / busy)
    assert fraction(snapshot, D).entitlement_ratio == pytest.approx(expected_idle)
    assert next(g for g in snapshot.gpus if g.uuid == GPU0).busy_tenants == busy


def test_sm_sharing_entitlement_is_the_portion_and_received_is_the_share_of_measured_sm(
    gpus, proc, record, allocations
):
    for placed in [
        record(
            container_id=A, pod_name="big", devices=[GPU0], request_mib=1024, mode="sm-sharing", portion=0.7
        ),
        record(
            container_id=B, pod_name="small", devices=[GPU0], request_mib=1024, mode="sm-sharing", portion=0.3
        ),
    ]:
        allocations.put(placed)
    proc.containerd_v2(pid=1, container_id=A)
    proc.containerd_v2(pid=2, container_id=B)
    gpus.set_process(gpu=GPU0, pid=1, used_bytes=GIB, sm_ratio=0.6)
    gpus.set_process(gpu=GPU0, pid=2, used_bytes=GIB, sm_ratio=0.4)

    snapshot = collector(gpus, allocations, proc).collect()

    big, small = fraction(snapshot, A), fraction(snapshot, B)
    assert (big.entitlement_ratio, small.entitlement_ratio) == (0.7, 0.3)
    assert (big.received_ratio, small.received_ratio) == (pytest.approx(0.6), pytest.approx(0.4))


def test_processes_outside_any_fraction_are_strays_but_the_mps_server_is_not(gpus, proc, record, allocations):
    allocations.put(record(container_id=A, pod_name="ok", devices=[GPU0], request_mib=1024))
    proc.containerd_v2(pid=1, container_id=A)  # a fraction, but on the wrong GPU below
    proc.containerd_v2(pid=2, container_id=B)  # a container gpufrac never injected
    proc.host(pid=3)  # a host process
    proc.host(pid=4, comm="nvidia-cuda-mps-server")
    gpus.set_process(gpu=GPU1, pid=1, used_bytes=GIB)
    gpus.set_process(gpu=GPU0, pid=2, used_bytes=2 * GIB)
    gpus.set_process(gpu=GPU0, pid=3, used_bytes=3 * GIB)
    gpus.set_process(gpu=GPU0, pid=4, used_bytes=GIB // 4)
    gpus.set_process(gpu=GPU0, pid=99, used_bytes=GIB)  # exited before /proc was read

    snapshot = collector(gpus, allocations, proc).collect()

    assert sorted((s.gpu_uuid, s.pid, s.container_id) for s in snapshot.strays) == [
        (GPU0, 2, B),
        (GPU0, 3, None),
        (GPU0, 99, None),
        (GPU1, 1, A),
    ]
    assert next(g for g in snapshot.gpus if g.uuid == GPU0).unattributed_bytes == 6 * GIB
    assert fraction(snapshot, A).used_bytes == 0


def test_strays_are_only_reported_on_managed_gpus(gpus, proc, allocations):
    proc.host(pid=3)
    gpus.set_process(gpu=GPU1, pid=3, used_bytes=GIB)
    collector_ = UsageCollector(
        backend=gpus, allocations=allocations, proc_root=proc.root, managed_gpus=[GPU0]
    )
    assert collector_.collect().strays == ()


def test_cdi_device_names_match_by_uuid_or_index(gpus, proc, record, allocations):
    for placed in [
        record(container_id=A, pod_name="by-uuid", devices=[f"nvidia.com/gpu={GPU0}"], request_mib=1),
        record(container_id=B, pod_name="by-index", devices=["nvidia.com/gpu=1"], request_mib=1),
    ]:
        allocations.put(placed)
    snapshot = collector(gpus, allocations, proc).collect()
    assert {(f.allocation.pod_name, f.gpu_uuid) for f in snapshot.fractions} == {
        ("by-uuid", GPU0),
        ("by-index", GPU1),
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{A}.scope\n", A),
        (f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{A}.scope/init\n", A),
        (f"0::/../../kubepods-pod1.slice/crio-{B}.scope\n", B),
        (f"11:memory:/kubepods/besteffort/pod1/{C}\n10:pids:/kubepods/besteffort/pod1/{C}\n", C),
        (f"0::/\n7:memory:/kubepods/pod1/docker-{D}.scope\n", D),
        (f"0::/kubepods.slice/kubepods-pod1.slice/crio-conmon-{B}.scope\n", None),
        ("0::/system.slice/containerd.service\n", None),
    ],
)
def test_container_id_from_each_cgroup_layout(text, expected):
    assert container_id_in(cgroup_file=text) == expected


def test_a_whole_gpu_container_is_shown_with_the_gpu_as_request_and_limit(gpus, proc, record, allocations):
    allocations.put(
        record(container_id=A, pod_name="trainer", devices=[GPU1], request_mib=0, limit_mib=0, exclusive=True)
    )
    proc.containerd_v2(pid=5, container_id=A)
    gpus.set_process(gpu=GPU1, pid=5, used_bytes=70 * GIB, sm_ratio=0.9)

    snapshot = collector(gpus, allocations, proc).collect()

    whole = fraction(snapshot, A, GPU1)
    assert (whole.request_bytes, whole.limit_bytes, whole.used_bytes) == (80 * GIB, 80 * GIB, 70 * GIB)
    assert next(g for g in snapshot.gpus if g.uuid == GPU1).allocated_bytes == 80 * GIB


def test_the_file_driven_backend_reads_the_documented_format_on_every_sample(tmp_path):
    from gpufrac.node.usage.simulated import SimulatedUsageFile

    table = tmp_path / "gpus.json"
    backend = SimulatedUsageFile(path=table)
    assert backend.sample() == ()  # no file yet: no GPUs

    table.write_text(
        '{"gpus": [{"uuid": "GPU-x", "index": 0, "memory_total_bytes": 1024,'
        ' "processes": [{"pid": 7, "used_bytes": 512, "sm_ratio": 0.5}]}]}'
    )
    (gpu,) = backend.sample()
    assert (gpu.uuid, gpu.memory_total_bytes, [(p.pid, p.used_bytes, p.sm_ratio) for p in gpu.processes]) == (
        "GPU-x",
        1024,
        [(7, 512, 0.5)],
    )
