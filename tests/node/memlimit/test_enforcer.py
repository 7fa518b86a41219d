"""The enforcer sets, reads back and keeps each fraction's limit; the pod condition says what holds."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from gpufrac.contract import keys
from gpufrac.kube.events import ObjectRef
from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.mapping import AllocationRecord
from gpufrac.node.memlimit.condition import pod_condition
from gpufrac.node.memlimit.driver import MIB, NVML_ERROR_NOT_SUPPORTED
from gpufrac.node.memlimit.enforcer import REASON_NOT_ENFORCED, REASON_REAPPLIED, LimitEnforcer
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits
from gpufrac.node.mps.hostpid import OUTSIDE_HOST_PID, outside_host_pid_namespace

GPU_A, GPU_B = "GPU-a", "GPU-b"


@dataclass
class Events:
    emitted: list[tuple[ObjectRef, str, str, str]] = field(default_factory=list)

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        self.emitted.append((regarding, type, reason, message))

    def reasons(self) -> list[str]:
        return [e[2] for e in self.emitted]


@dataclass
class Setup:
    root: Path
    driver: SimulatedMemoryLimits
    enforcer: LimitEnforcer
    events: Events
    changed: list[str]
    version: list[str]


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    root = tmp_path / "cgroupfs"
    root.mkdir()
    (root / "cgroup.controllers").touch()
    gpus = (
        GpuInfo(uuid=GPU_A, index=0, minor=0, model="H100", mib=81559),
        GpuInfo(uuid=GPU_B, index=1, minor=1, model="H100", mib=81559),
    )
    version = ["615.20.01"]
    driver = SimulatedMemoryLimits(
        path=tmp_path / "limits.json", gpus=lambda: gpus, driver_version=lambda: version[0], cgroup_root=root
    )
    events, changed = Events(), []
    by_name = {g.uuid: g.uuid for g in gpus} | {str(g.index): g.uuid for g in gpus}
    enforcer = LimitEnforcer(
        driver=driver, gpu_uuid=by_name.get, cgroup_root=root, events=events, on_change=changed.append
    )
    return Setup(root, driver, enforcer, events, changed, version)


def record(
    cid: str = "c1", *, devices: tuple[str, ...] = (GPU_A,), pod: str = "uid-1", name: str = "app"
) -> AllocationRecord:
    return AllocationRecord(
        container_id=cid,
        pod_namespace="team-a",
        pod_name="infer",
        pod_uid=pod,
        container_name=name,
        devices=devices,
        request_mib=4096,
        limit_mib=6144,
        mode="time-slicing",
        portion=None,
    )


def cgroup(setup: Setup, cid: str = "c1") -> str:
    path = setup.root / "kubepods" / "poduid-1" / cid
    path.mkdir(parents=True, exist_ok=True)
    return f"/kubepods/poduid-1/{cid}"


def test_enforce_sets_soft_request_hard_limit_on_every_gpu_and_reads_back(setup: Setup) -> None:
    booked = setup.enforcer.enforce(record=record(devices=(GPU_A, "1")), pid=0, cgroups_path=cgroup(setup))
    assert booked.in_force, booked.describe()
    held = setup.driver.held()
    full = str(setup.root / "kubepods" / "poduid-1" / "c1")
    assert {gpu: (v[full].soft, v[full].hard) for gpu, v in held.items()} == {
        GPU_A: (4096 * MIB, 6144 * MIB),
        GPU_B: (4096 * MIB, 6144 * MIB),
    }
    assert setup.changed == ["uid-1"]
    assert setup.events.emitted == []


def test_a_driver_that_refuses_or_lies_fails_the_container_with_a_warning(setup: Setup) -> None:
    setup.driver.refuse(gpu=GPU_A, code=NVML_ERROR_NOT_SUPPORTED)
    booked = setup.enforcer.enforce(record=record(), pid=0, cgroups_path=cgroup(setup))
    assert not booked.in_force
    ((ref, type_, reason, message),) = setup.events.emitted
    assert (ref.namespace, ref.name, type_, reason) == ("team-a", "infer", "Warning", REASON_NOT_ENFORCED)
    for words in (GPU_A, "kubepods/poduid-1/c1", "soft 4096 MiB, hard 6144 MiB", "NVML_ERROR_NOT_SUPPORTED"):
        assert words in message

    setup.driver.refuse(gpu=GPU_A, code=None)
    setup.driver.ignore_sets(gpu=GPU_A)
    lied = setup.enforcer.enforce(record=record("c2"), pid=0, cgroups_path=cgroup(setup, "c2"))
    assert not lied.in_force and "the driver holds no limit" in lied.describe()


def test_no_cgroup_is_not_in_force(setup: Setup) -> None:
    booked = setup.enforcer.enforce(record=record(), pid=0, cgroups_path="/kubepods/poduid-1/never-made")
    assert not booked.in_force
    assert "does not exist" in (booked.problem or "")
    assert setup.driver.held() == {}


def test_a_device_not_on_the_node_is_not_in_force(setup: Setup) -> None:
    booked = setup.enforcer.enforce(
        record=record(devices=(GPU_A, "GPU-elsewhere")), pid=0, cgroups_path=cgroup(setup)
    )
    assert not booked.in_force and "GPU-elsewhere is not one of this node's GPUs" in booked.describe()


def test_the_audit_sets_again_what_was_cleared_and_reports_it(setup: Setup) -> None:
    setup.enforcer.enforce(record=record(), pid=0, cgroups_path=cgroup(setup))
    full = str(setup.root / "kubepods" / "poduid-1" / "c1")
    assert setup.enforcer.audit() == []  # nothing changed: nothing to do

    setup.driver.tamper(gpu=GPU_A, cgroup=full)  # cleared behind the agent's back
    (after,) = setup.enforcer.audit()
    assert after.in_force and after.reapplied == 1
    assert setup.events.reasons() == [REASON_REAPPLIED]
    assert "the driver holds no limit" in setup.events.emitted[0][3]
    assert setup.driver.held()[GPU_A][full].hard == 6144 * MIB
    assert setup.enforcer.totals.reapplied == 1

    setup.driver.tamper(gpu=GPU_A, cgroup=full, soft=MIB, hard=80000 * MIB)  # raised behind its back
    setup.driver.refuse(gpu=GPU_A, code=NVML_ERROR_NOT_SUPPORTED)  # and cannot be put back
    (broken,) = setup.enforcer.audit()
    assert not broken.in_force
    assert setup.events.reasons()[-1] == REASON_NOT_ENFORCED
    condition = pod_condition([record()], {b.record.container_id: b for b in setup.enforcer.booked()})
    assert condition is not None and condition.status == "False"
    assert condition.reason == keys.POD_REASON_LIMITS_NOT_IN_FORCE


def test_a_removed_container_is_forgotten(setup: Setup) -> None:
    setup.enforcer.enforce(record=record(), pid=0, cgroups_path=cgroup(setup))
    setup.enforcer.forget("c1")
    assert setup.enforcer.booked() == [] and setup.changed == ["uid-1", "uid-1"]


def test_adopting_a_running_container_sets_only_what_is_missing(setup: Setup) -> None:
    path = cgroup(setup)
    first = setup.enforcer.adopt(record=record(), pid=0, cgroups_path=path)  # an agent restart: no limit held
    assert first.in_force and first.reapplied == 1
    assert setup.events.reasons() == [REASON_REAPPLIED]
    restarted = LimitEnforcer(
        driver=setup.driver, gpu_uuid={GPU_A: GPU_A}.get, cgroup_root=setup.root, events=setup.events
    )
    again = restarted.adopt(record=record(), pid=0, cgroups_path=path)
    assert again.in_force and again.reapplied == 0
    assert setup.events.reasons() == [REASON_REAPPLIED]  # nothing new to report


def test_the_canary_passes_on_a_capable_driver_and_leaves_nothing_behind(setup: Setup) -> None:
    result = setup.enforcer.canary(gpus=[GPU_A, GPU_B])
    assert result.passed, result.message
    assert setup.driver.held() == {}
    assert [p.name for p in setup.root.iterdir() if p.is_dir()] == []


def test_the_canary_fails_with_a_reason_a_user_can_read(setup: Setup) -> None:
    setup.version[0] = "580.65.06"
    result = setup.enforcer.canary(gpus=[GPU_A])
    assert not result.passed
    assert "NVML_ERROR_NOT_SUPPORTED" in result.message and "r615" in result.message
    setup.version[0] = "615.20.01"
    setup.driver.ignore_sets(gpu=GPU_B)
    lied = setup.enforcer.canary(gpus=[GPU_A, GPU_B])
    assert not lied.passed and GPU_B in lied.message
    assert not setup.enforcer.canary(gpus=[]).passed


def test_pod_condition_true_only_when_every_fraction_reads_back(setup: Setup) -> None:
    first, second = record("c1", name="app"), record("c2", name="sidecar")
    whole = AllocationRecord(
        container_id="c3",
        pod_namespace="team-a",
        pod_name="infer",
        pod_uid="uid-1",
        container_name="trainer",
        devices=(GPU_B,),
        request_mib=81559,
        limit_mib=81559,
        mode="time-slicing",
        portion=None,
        exclusive=True,
    )
    assert pod_condition([whole], {}) is None  # whole GPUs are not fractions
    setup.enforcer.enforce(record=first, pid=0, cgroups_path=cgroup(setup, "c1"))
    booked = {b.record.container_id: b for b in setup.enforcer.booked()}
    pending = pod_condition([first, second, whole], booked)
    assert pending is not None and pending.status == "False"
    assert pending.reason == keys.POD_REASON_LIMITS_NOT_VERIFIED and "sidecar" in pending.message
    setup.enforcer.enforce(record=second, pid=0, cgroups_path=cgroup(setup, "c2"))
    booked = {b.record.container_id: b for b in setup.enforcer.booked()}
    done = pod_condition([first, second, whole], booked)
    assert done is not None and done.status == "True" and done.reason == keys.POD_REASON_LIMITS_READ_BACK
    assert "app: soft 4096 MiB, hard 6144 MiB read back on 1 GPU(s) (GPU-a) for cgroup" in done.message
    assert "sidecar: soft 4096 MiB" in done.message


def test_a_fraction_behind_a_blind_mps_daemon_is_never_in_force(setup: Setup) -> None:
    """An MPS daemon outside the host PID namespace sees clients as pid 0: the limit reads back, but the
    memory is not accounted to the container's cgroup. Such a fraction is refused, never said enforced."""
    blind = LimitEnforcer(
        driver=setup.driver,
        gpu_uuid={GPU_A: GPU_A}.get,
        cgroup_root=setup.root,
        events=setup.events,
        blind=lambda record: OUTSIDE_HOST_PID if record.mode == "sm-sharing" else None,
    )
    shared = replace(record("c2"), mode="sm-sharing")
    booked = blind.enforce(record=shared, pid=0, cgroups_path=cgroup(setup, "c2"))
    assert not booked.in_force and "pid 0" in (booked.problem or "")
    assert setup.events.reasons() == [REASON_NOT_ENFORCED]
    condition = pod_condition([shared], {"c2": booked})
    assert condition is not None and condition.status == "False" and "hostPID" in condition.message
    plain = blind.enforce(record=record(), pid=0, cgroups_path=cgroup(setup))
    assert plain.in_force  # time-slicing, its own processes allocate: nothing blind about it


@pytest.mark.parametrize(
    ("status", "nested"),
    [
        ("Name:\tpython\nNSpid:\t4242\n", False),
        ("Name:\tpython\nNSpid:\t4242\t7\n", True),
        ("Name:\tpython\n", False),  # kernels without NSpid: nothing says it is nested
    ],
)
def test_the_pid_namespace_check_reads_nspid(tmp_path: Path, status: str, nested: bool) -> None:
    path = tmp_path / "status"
    path.write_text(status)
    assert outside_host_pid_namespace(path) is nested
