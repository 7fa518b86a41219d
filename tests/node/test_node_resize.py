"""A running fraction resized on the node, against the SIMULATED per-cgroup driver (no API server here:
``test_resize_kube.py`` runs the same through a real one).

What a user would notice is asserted: the limits the driver holds for the container's cgroup, the record
the metrics and every later audit read, the pod's conditions and Events. The scheduler's patch is played
by changing the binder-written annotations that ``read_binding`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac._generated.nri import api_pb2 as api
from gpufrac.contract import keys
from gpufrac.kube.events import NORMAL, WARNING, ObjectRef
from gpufrac.node.inject import pipe_leaf, plan_container
from gpufrac.node.inventory.backend import GpuInfo
from gpufrac.node.mapping import AllocationRecord, MappingStore
from gpufrac.node.memlimit.condition import pod_condition
from gpufrac.node.memlimit.driver import MIB, NVML_ERROR_UNKNOWN, MemoryLimits
from gpufrac.node.memlimit.enforcer import LimitEnforcer
from gpufrac.node.memlimit.simulated import SimulatedMemoryLimits
from gpufrac.node.nri.handler import GpuInjector
from gpufrac.node.resize import (
    EVENT_APPLIED,
    EVENT_LIMIT_BELOW_USAGE,
    REASON_APPLYING,
    REASON_LIMIT_BELOW_USAGE,
    REASON_WAITING_FOR_USAGE,
    AllocationsInForce,
    ResizeTracker,
)

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
CID = "c" * 64
POD_UID = "uid-1"
CGROUP = f"/kubepods/poduid-1/{CID}"


@dataclass
class Events:
    emitted: list[tuple[str, str, str]] = field(default_factory=list)

    def emit(self, *, regarding: ObjectRef, type: str, reason: str, message: str) -> None:
        self.emitted.append((type, reason, message))

    def of(self, reason: str) -> list[tuple[str, str, str]]:
        return [e for e in self.emitted if e[1] == reason]


def binding(*, request: int, limit: int, devices: tuple[str, ...] = (GPU_A,), portion: float | None = None):
    """What the binder writes on the pod (and the scheduler patches when it grants a resize)."""
    annotations = {
        keys.devices_key("app"): ",".join(devices),
        keys.memory_request_key("app"): f"{request}Mi",
        keys.memory_limit_key("app"): f"{limit}Mi",
    }
    if len(devices) > 1:
        annotations[keys.GPU_FRACTION_NUM_DEVICES] = str(len(devices))
    if portion is not None:
        annotations[keys.compute_mode_key("app")] = "sm-sharing"
        annotations[keys.compute_portion_key("app")] = str(portion)
    return annotations


@dataclass
class Node:
    """One agent's view of the node: its store, enforcer and tracker over the node's state directory and
    the driver (which outlives an agent, as the real one does)."""

    root: Path
    state: Path
    driver: SimulatedMemoryLimits
    store: MappingStore
    limits: LimitEnforcer
    tracker: ResizeTracker
    events: Events
    now: list[float]

    @property
    def cgroup(self) -> str:
        return str(self.root / CGROUP.lstrip("/"))

    def held(self) -> dict[str, tuple[int, int]]:
        return {
            gpu: (v[self.cgroup].soft // MIB, v[self.cgroup].hard // MIB)
            for gpu, v in self.driver.held().items()
            if self.cgroup in v
        }

    def use(self, mib: int, gpu: str = GPU_A) -> None:
        self.driver.set_used(gpu=gpu, cgroup=self.cgroup, used=mib * MIB)

    def audit(self) -> None:
        self.limits.audit()
        self.tracker.after_audit()

    def condition(self):
        return self.tracker.condition(POD_UID)

    def enforced(self):
        return pod_condition(
            self.store.allocations(), {b.record.container_id: b for b in self.limits.booked()}
        )


GPUS = (
    GpuInfo(uuid=GPU_A, index=0, minor=0, model="H100", mib=81559),
    GpuInfo(uuid=GPU_B, index=1, minor=1, model="H100", mib=81559),
)


def agent(root: Path, state: Path, *, timeout_s: float = 600.0) -> Node:
    """A (re)started agent: a fresh store (read from disk), enforcer and tracker."""
    driver = SimulatedMemoryLimits(
        path=state.parent / "limits.json",
        gpus=lambda: GPUS,
        driver_version=lambda: "615.20.01",
        cgroup_root=root,
    )
    events = Events()
    by_name = {g.uuid: g.uuid for g in GPUS}
    limits = LimitEnforcer(driver=driver, gpu_uuid=by_name.get, cgroup_root=root, events=events)
    store = MappingStore(directory=state)
    now = [1000.0]
    tracker = ResizeTracker(
        store=store, limits=limits, events=events, shrink_timeout_s=timeout_s, clock=lambda: now[0]
    )
    return Node(root, state, driver, store, limits, tracker, events, now)


@pytest.fixture
def cgroupfs(tmp_path: Path) -> Path:
    root = tmp_path / "cgroupfs"
    (root / CGROUP.lstrip("/")).mkdir(parents=True)
    (root / "cgroup.controllers").touch()
    return root


def record(*, request: int, limit: int, devices: tuple[str, ...] = (GPU_A,)) -> AllocationRecord:
    return AllocationRecord(
        container_id=CID,
        pod_namespace="team-a",
        pod_name="infer",
        pod_uid=POD_UID,
        container_name="app",
        devices=devices,
        request_mib=request,
        limit_mib=limit,
        mode="time-slicing",
        portion=None,
    )


def started(node: Node, rec: AllocationRecord) -> None:
    """The container was created (its record) and started (its limits set and read back)."""
    node.store.put(rec)
    assert node.limits.enforce(record=rec, pid=0, cgroups_path=CGROUP).in_force


async def test_a_grow_is_set_on_the_running_containers_cgroup_read_back_and_said(
    cgroupfs: Path, tmp_path: Path
) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    started(node, record(request=4096, limit=6144, devices=(GPU_A, GPU_B)))
    node.use(5000)

    resized = await node.tracker.observe(
        pod_uid=POD_UID, annotations=binding(request=8192, limit=12288, devices=(GPU_A, GPU_B))
    )

    assert resized == 1
    assert node.held() == {GPU_A: (8192, 12288), GPU_B: (8192, 12288)}  # both GPUs, soft and hard
    (stored,) = node.store.allocations()
    assert (stored.request_mib, stored.limit_mib) == (8192, 12288)  # what metrics and the audit read
    assert node.condition() is None  # in force: no GpuResizeInProgress
    enforced = node.enforced()
    assert enforced is not None and enforced.status == "True" and "hard 12288 MiB" in enforced.message
    ((kind, _, message),) = node.events.of(EVENT_APPLIED)
    assert kind == NORMAL
    assert "request 4096 MiB, limit 6144 MiB -> request 8192 MiB, limit 12288 MiB" in message
    # Nothing changes again: the same binding is no resize, and the audit finds it in force.
    assert (
        await node.tracker.observe(
            pod_uid=POD_UID, annotations=binding(request=8192, limit=12288, devices=(GPU_A, GPU_B))
        )
        == 0
    )
    node.audit()
    assert node.held() == {GPU_A: (8192, 12288), GPU_B: (8192, 12288)}
    assert len(node.events.emitted) == 1


async def test_a_shrink_below_use_sets_the_request_waits_then_applies_when_the_use_falls(
    cgroupfs: Path, tmp_path: Path
) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    started(node, record(request=4096, limit=8192))
    node.use(6000)

    await node.tracker.observe(pod_uid=POD_UID, annotations=binding(request=2048, limit=3072))

    assert node.held() == {GPU_A: (2048, 8192)}  # the new request at once, the old hard limit kept
    waiting = node.condition()
    assert waiting is not None and (waiting.status, waiting.reason) == ("True", REASON_WAITING_FOR_USAGE)
    assert GPU_A in waiting.message and "6000 MiB" in waiting.message and "3072 MiB" in waiting.message
    assert node.enforced().status == "True"  # the kept limit is in force: the container is bounded
    assert node.events.of(EVENT_APPLIED) == []
    # Usage reporting (the limit series, the over-limit audit) sees the limit the container is held to.
    in_force = AllocationsInForce(store=node.store, limits=node.limits)
    assert [(a.request_mib, a.limit_mib) for a in in_force.allocations()] == [(2048, 8192)]

    node.use(4000)  # still above the new limit: the audit keeps the old one
    node.audit()
    assert node.held() == {GPU_A: (2048, 8192)}
    assert "4000 MiB" in node.condition().message

    node.use(1500)  # the workload freed memory: the next audit lowers the hard limit
    node.audit()
    assert node.held() == {GPU_A: (2048, 3072)}
    assert node.condition() is None
    assert [(a.request_mib, a.limit_mib) for a in in_force.allocations()] == [(2048, 3072)]
    ((_, _, message),) = node.events.of(EVENT_APPLIED)
    assert "limit 8192 MiB -> request 2048 MiB, limit 3072 MiB" in message
    assert node.events.of("GpuMemoryLimitReapplied") == []  # a held-back limit is no tampering


async def test_a_shrink_that_waits_past_the_timeout_says_so_once_and_keeps_the_old_limit(
    cgroupfs: Path, tmp_path: Path
) -> None:
    node = agent(cgroupfs, tmp_path / "state", timeout_s=600)
    started(node, record(request=4096, limit=8192))
    node.use(6000)
    await node.tracker.observe(pod_uid=POD_UID, annotations=binding(request=2048, limit=3072))

    node.now[0] += 599
    node.audit()
    assert node.condition().reason == REASON_WAITING_FOR_USAGE
    node.now[0] += 2
    node.audit()
    node.audit()
    gave_up = node.condition()
    assert (gave_up.status, gave_up.reason) == ("True", REASON_LIMIT_BELOW_USAGE)
    ((kind, _, message),) = node.events.of(EVENT_LIMIT_BELOW_USAGE)  # once, not per cycle
    assert kind == WARNING and "600s" in message and "6000 MiB in use" in message
    assert node.held() == {GPU_A: (2048, 8192)}

    node.use(100)  # the old hard limit stays only until the use falls
    node.audit()
    assert node.held() == {GPU_A: (2048, 3072)} and node.condition() is None


async def test_a_resize_the_driver_does_not_read_back_is_not_in_force_until_it_does(
    cgroupfs: Path, tmp_path: Path
) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    started(node, record(request=4096, limit=6144))
    node.driver.ignore_sets(gpu=GPU_A)  # the set "succeeds" and changes nothing

    await node.tracker.observe(pod_uid=POD_UID, annotations=binding(request=8192, limit=10240))

    assert node.held() == {GPU_A: (4096, 6144)}
    applying = node.condition()
    assert (applying.status, applying.reason) == ("True", REASON_APPLYING)
    assert "request 8192 MiB, limit 10240 MiB not in force" in applying.message
    enforced = node.enforced()
    assert (enforced.status, enforced.reason) == ("False", keys.POD_REASON_LIMITS_NOT_IN_FORCE)
    assert node.events.of(EVENT_APPLIED) == []

    node.driver.ignore_sets(gpu=GPU_A, ignore=False)
    node.audit()  # sets the record's (new) amounts again
    assert node.held() == {GPU_A: (8192, 10240)}
    assert node.condition() is None and node.enforced().status == "True"
    assert len(node.events.of(EVENT_APPLIED)) == 1


async def test_a_binding_that_moves_devices_is_not_a_resize(cgroupfs: Path, tmp_path: Path) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    started(node, record(request=4096, limit=6144))
    assert (
        await node.tracker.observe(
            pod_uid=POD_UID, annotations=binding(request=8192, limit=8192, devices=(GPU_B,))
        )
        == 0
    )
    assert node.held() == {GPU_A: (4096, 6144)}
    ((kind, _, message),) = node.events.emitted
    assert kind == WARNING and "never change on a running container" in message


# -- an agent killed in the middle of a resize ----------------------------------------------------------


def sandbox(annotations: dict[str, str]) -> api.PodSandbox:
    return api.PodSandbox(id="sb-1", name="infer", namespace="team-a", uid=POD_UID, annotations=annotations)


def running(annotations: dict[str, str], *, created_with: dict[str, str]) -> api.Container:
    """The runtime's view of the running container: the environment it was CREATED with (before the resize),
    its pid and cgroups path."""
    plan, _ = plan_container(
        annotations=created_with, container="app", pipe_source=pipe_leaf(root="/leaves", container_id=CID)
    )
    assert plan is not None
    return api.Container(
        id=CID,
        pod_sandbox_id="sb-1",
        name="app",
        state=api.CONTAINER_RUNNING,
        pid=0,
        env=[f"{k}={v}" for k, v in plan.env],
        linux=api.LinuxContainer(cgroups_path=CGROUP),
    )


async def restart(node: Node, annotations: dict[str, str], created_with: dict[str, str]) -> Node:
    """The agent dies (its memory is gone; what it had written is on disk) and a new one starts: the
    runtime's Synchronize lists the running container with its pod's annotations as they are now."""
    node.store.flush()
    again = agent(node.root, node.state)
    injector = GpuInjector(store=again.store, pipe_root=Path("/leaves"), limits=again.limits)
    await injector.synchronize(
        pods=[sandbox(annotations)], containers=[running(annotations, created_with=created_with)]
    )
    again.store.flush()
    return again


OLD = binding(request=4096, limit=8192)
NEW = binding(request=6144, limit=12288)


@pytest.mark.parametrize(
    "dies", ["after the record, before the driver", "after the driver, before the record"]
)
async def test_an_agent_restarted_mid_resize_ends_with_cgroup_record_and_pod_alike(
    cgroupfs: Path, tmp_path: Path, dies: str
) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    old = record(request=4096, limit=8192)
    started(node, old)
    if dies.startswith("after the record"):
        node.driver.refuse(gpu=GPU_A, code=NVML_ERROR_UNKNOWN)  # the agent is killed before its set lands
        await node.tracker.observe(pod_uid=POD_UID, annotations=NEW)
        node.driver.refuse(gpu=GPU_A, code=None)
        assert node.held() == {GPU_A: (4096, 8192)}
    else:
        node.driver.set_limits(gpu=GPU_A, cgroup=node.cgroup, soft=6144 * MIB, hard=12288 * MIB)
        node.store.put(old)  # its record write never reached the disk
    after = await restart(node, NEW, created_with=OLD)

    (stored,) = MappingStore(directory=node.state).allocations()  # as the next agent would read it
    assert (stored.request_mib, stored.limit_mib) == (6144, 12288)
    assert after.held() == {GPU_A: (6144, 12288)}
    assert after.limits.get(CID).in_force and after.condition() is None
    assert after.enforced().status == "True"


async def test_an_agent_restarted_mid_shrink_keeps_the_rule_and_applies_when_the_use_falls(
    cgroupfs: Path, tmp_path: Path
) -> None:
    node = agent(cgroupfs, tmp_path / "state")
    started(node, record(request=4096, limit=8192))
    node.use(7000)
    # Killed after the scheduler's patch, before it saw it: the new agent meets the new binding first.
    after = await restart(node, binding(request=2048, limit=4096), created_with=OLD)

    assert after.held() == {GPU_A: (2048, 8192)}  # never lowered below the use, even by adoption
    waiting = after.condition()
    assert (
        waiting is not None and waiting.reason == REASON_WAITING_FOR_USAGE and "7000 MiB" in waiting.message
    )
    after.use(1000)
    after.audit()
    assert after.held() == {GPU_A: (2048, 4096)} and after.condition() is None
    ((_, _, message),) = after.events.of(EVENT_APPLIED)
    assert "-> request 2048 MiB, limit 4096 MiB" in message


def test_the_simulated_driver_reports_use_with_the_limits(cgroupfs: Path, tmp_path: Path) -> None:
    """The premise of the shrink rule: currentUsed comes with every read of the cgroup's limits."""
    node = agent(cgroupfs, tmp_path / "state")
    node.use(1234)
    assert node.driver.get_limits(gpu=GPU_A, cgroup=node.cgroup) == MemoryLimits(
        soft=0, hard=0xFFFFFFFFFFFFFFFF, current_used=1234 * MIB
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("resize"), st.integers(1, 40), st.integers(0, 40)),  # request, limit above it
            st.tuples(st.just("use"), st.floats(0, 1), st.just(0)),  # a share of the hard limit held now
        ),
        max_size=12,
    )
)
async def test_random_resizes_never_lower_a_limit_below_use_and_end_as_the_pod_says(
    cgroupfs: Path, tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[str, float, int]]
) -> None:
    """Any sequence of resizes and usage changes (the use never above the hard limit held: the driver
    refuses allocations past it): the request is always in force, the hard limit is never set below the
    use, it is the pod's as soon as the use allows, and the record always says what the pod says."""
    node = agent(cgroupfs, tmp_path_factory.mktemp("state"))
    node.use(0)  # the driver's state outlives an example, as it outlives an agent
    started(node, record(request=1024, limit=2048))
    want = (1024, 2048)
    for kind, a, b in steps:
        before = node.held()[GPU_A]
        if kind == "resize":
            want = (int(a) * 256, int(a) * 256 + b * 256)
            await node.tracker.observe(pod_uid=POD_UID, annotations=binding(request=want[0], limit=want[1]))
        else:
            node.use(int(a * before[1]))
            node.audit()
        used = node.driver.get_limits(gpu=GPU_A, cgroup=node.cgroup).current_used // MIB
        soft, hard = node.held()[GPU_A]
        assert soft == want[0]
        assert hard >= min(used, before[1]) and hard >= want[1]
        assert hard == (want[1] if used <= want[1] else max(before[1], want[1]))
        assert node.condition() is None if hard == want[1] else node.condition() is not None
        (stored,) = node.store.allocations()
        assert (stored.request_mib, stored.limit_mib) == want
