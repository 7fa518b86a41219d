"""What a node advertises follows its driver and its running daemon, and the placement engine obeys it."""

from __future__ import annotations

import tomllib

import pytest
from mps_harness import started

from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.node.mps.backoff import Backoff
from gpufrac.node.mps.config import BackoffSettings, MpsSettings
from gpufrac.node.mps.mode import DriverVersion, MpsMode, capability_for, mode_for_driver
from gpufrac.node.mps.v3config import render_v3_config
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import GpuDevice, NodeSpec, PendingPod


def test_driver_version_decides_the_mode() -> None:
    assert mode_for_driver(DriverVersion.parse("615.0")) is MpsMode.V3
    assert mode_for_driver(DriverVersion.parse("620.10.02")) is MpsMode.V3
    assert mode_for_driver(DriverVersion.parse("580.65.06")) is MpsMode.CLASSIC
    with pytest.raises(ValueError, match="MAJOR"):
        DriverVersion.parse("r615")


def test_labels_say_only_what_the_node_enforces() -> None:
    old = capability_for(driver=DriverVersion.parse("580.65.06"), mps_running=True)
    assert old.labels() == {
        "gpufrac.io/compute-mode.time-slicing": "false",
        "gpufrac.io/compute-mode.sm-sharing": "true",
        "gpufrac.io/mps": "classic",
    }
    down = capability_for(driver=DriverVersion.parse("615.20.01"), mps_running=False)
    assert down.enforceable == {ComputeMode.TIME_SLICING}
    assert down.labels()["gpufrac.io/mps"] == "none"


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_period() -> None:
    backoff = Backoff(settings=BackoffSettings(initial_s=1, factor=2, max_s=5, stable_s=60, degraded_after=3))
    assert [backoff.failed(now=t) for t in range(5)] == [1, 2, 4, 5, 5]
    assert backoff.degraded
    backoff.ready(now=100)
    assert not backoff.degraded
    assert backoff.failed(now=130) == 5  # up for 30 s: still the same incident
    backoff.ready(now=200)
    assert backoff.failed(now=260) == 1  # up for 60 s: a fresh start


def test_v3_config_is_valid_toml_with_memacct_context_share_and_a_capped_default() -> None:
    data = tomllib.loads(render_v3_config(settings=MpsSettings(default_namespace_thread_percentage=2)))
    assert data["schema_version"] == "1.0"
    assert data["servers"]["shared"]["namespaces"]["default"]["active_thread_percentage"] == "2"
    assert data["features"]["memacct"]["enabled"] is True
    assert data["features"]["context-share"]["enabled"] is True


def _node(name: str, *, modes: frozenset[ComputeMode]) -> NodeSpec:
    gpu = GpuDevice(uuid=f"GPU-{name}", index=0, memory_mib=81920, model="H100")
    return NodeSpec(name=name, cpu_milli=64000, memory_bytes=512 << 30, gpus=(gpu,), compute_modes=modes)


def _pod(name: str, mode: ComputeMode) -> PendingPod:
    request = ContainerGpuRequest(container="main", request=GpuMemory(mib=8192), limit=None, mode=mode)
    return PendingPod(
        namespace="default", name=name, uid=f"uid-{name}", gpu=PodGpuRequest(containers=(request,))
    )


async def test_an_old_driver_node_takes_only_sm_sharing_pods(make_supervisor) -> None:
    supervisor = await started(make_supervisor(driver="580.65.06"))
    old_modes = supervisor.capability().enforceable
    engine = Engine(policy="binpack")
    engine.add_node(_node("old", modes=old_modes))

    time_slicing = engine.place(_pod("notebook", ComputeMode.TIME_SLICING))
    sm_sharing = engine.place(_pod("inference", ComputeMode.SM_SHARING))

    assert isinstance(time_slicing, Unschedulable)
    assert "cannot enforce the compute mode" in time_slicing.message
    assert isinstance(sm_sharing, Placement) and sm_sharing.node == "old"

    # Once its daemon is stopped, the same node no longer takes sm-sharing either.
    await supervisor.stop()
    engine.update_node(_node("old", modes=supervisor.capability().enforceable))
    assert isinstance(engine.place(_pod("inference-2", ComputeMode.SM_SHARING)), Unschedulable)
    new = capability_for(driver=DriverVersion.parse("615.20.01"), mps_running=True).enforceable
    engine.add_node(_node("new", modes=new))
    placed = engine.place(_pod("notebook-2", ComputeMode.TIME_SLICING))
    assert isinstance(placed, Placement) and placed.node == "new"
