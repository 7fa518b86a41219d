"""What the node agent says about its GPUs, before any API call: simulated backend and the Node's state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufrac.node.inventory.backend import InventoryUnavailable
from gpufrac.node.inventory.publish import desired_state
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag, simulated_uuid
from gpufrac.node.mps.mode import DriverVersion, capability_for


def test_flag_describes_groups_of_gpus_with_known_or_given_memory() -> None:
    spec = parse_flag("2xA100-40GB,1xL4-24GB:23000", driver="580.65.06")
    assert [(g.model, g.mib) for g in spec.gpus] == [
        ("A100-40GB", 40960),
        ("A100-40GB", 40960),
        ("L4-24GB", 23000),
    ]
    assert spec.driver == "580.65.06"
    with pytest.raises(ValueError, match="COUNTxMODEL"):
        parse_flag("H100")
    with pytest.raises(ValueError, match="unknown GPU model"):
        parse_flag("1xB999")


def test_simulated_gpus_have_stable_uuids_per_node() -> None:
    inv = SimulatedInventory(node_name="gpu-7", spec=parse_flag("2xH100-80GB")).read()
    assert [g.uuid for g in inv.gpus] == [simulated_uuid("gpu-7", 0), simulated_uuid("gpu-7", 1)]
    assert (
        inv.gpus[0].uuid
        != SimulatedInventory(node_name="gpu-8", spec=parse_flag("1xH100-80GB")).read().gpus[0].uuid
    )


def test_yaml_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    config = tmp_path / "gpus.yaml"
    config.write_text("driver: 615.20.01\ngpus:\n  - {count: 2, model: L4-24GB}\n")
    backend = SimulatedInventory(node_name="n", config=config)
    assert len(backend.read().usable) == 2

    config.write_text("driver: 615.20.01\ngpus:\n  - {model: L4-24GB}\n  - {model: L4-24GB, xid: 48}\n")
    os.utime(config, ns=(1, 1))  # a different mtime even within the filesystem's timestamp granularity
    inv = backend.read()
    assert len(inv.gpus) == 2 and len(inv.usable) == 1
    assert "XID 48" in inv.withdrawn[0][1]

    config.write_text("gpus: [")
    os.utime(config, ns=(2, 2))
    with pytest.raises(InventoryUnavailable, match=r"gpus\.yaml"):
        backend.read()


def v3(mps_running: bool = True):  # type: ignore[no-untyped-def]
    return capability_for(driver=DriverVersion.parse("615.20.01"), mps_running=mps_running)


def test_ready_node_publishes_every_usable_gpu_and_its_capability() -> None:
    backend = SimulatedInventory(node_name="n", spec=parse_flag("2xH100-80GB"))
    state = desired_state(inventory=backend.read(), capability=v3())
    assert state.ready and state.reason == "GpuFractioningReady"
    assert json.loads(state.gpus_annotation) == [
        {"uuid": simulated_uuid("n", 0), "index": 0, "model": "H100-80GB", "mib": 81559, "mode": "fractions"},
        {"uuid": simulated_uuid("n", 1), "index": 1, "model": "H100-80GB", "mib": 81559, "mode": "fractions"},
    ]
    assert state.labels["gpufrac.io/managed"] == "true"
    assert state.labels["gpu-fractioning.kai.scheduler/nvidia-driver-version.major"] == "615"
    assert state.labels["gpufrac.io/compute-mode.time-slicing"] == "true"
    assert state.labels["gpufrac.io/compute-mode.sm-sharing"] == "true"
    assert state.labels["gpufrac.io/gpu-model"] == "H100-80GB" and state.labels["gpufrac.io/gpu-count"] == "2"


def test_faulted_and_missing_gpus_are_withdrawn_with_a_reason_and_a_mig_gpu_is_published_as_mig() -> None:
    backend = SimulatedInventory(node_name="n", spec=parse_flag("4xH100-80GB"))
    backend.set_mig(0)
    backend.set_xid(3, 48)
    gone = simulated_uuid("n", 2)
    backend.remove_gpu(2)
    state = desired_state(inventory=backend.read(), capability=v3(), missing={gone: 2})
    assert [(g["index"], g["mode"]) for g in state.gpus] == [(0, "mig"), (1, "fractions")]
    assert state.gpus[0]["mig"] == []  # MIG on, no slices made yet
    assert state.ready and state.labels["gpufrac.io/gpu-count"] == "2"
    assert "GPU 3" in state.message and "XID 48" in state.message
    assert f"GPU 2 ({gone}) withdrawn: it is gone" in state.message


@pytest.mark.parametrize(
    ("setup", "reason", "says"),
    [
        (lambda b: b.set_lost(0), "NoUsableGpus", "no GPU is usable"),
        (lambda b: b.remove_gpu(0), "NoUsableGpus", "no GPU was found"),
        (lambda b: b.set_driver("580.65.06"), "NoEnforceableComputeMode", "needs r615+"),
    ],
    ids=["lost", "gone", "old-driver-no-mps"],
)
def test_not_ready_says_what_is_missing(setup, reason: str, says: str) -> None:  # type: ignore[no-untyped-def]
    backend = SimulatedInventory(node_name="n", spec=parse_flag("1xL4-24GB"))
    setup(backend)
    inventory = backend.read()
    capability = capability_for(driver=DriverVersion.parse(inventory.driver_version), mps_running=False)
    state = desired_state(inventory=inventory, capability=capability)
    assert not state.ready and state.reason == reason and says in state.message


def test_old_driver_with_mps_enforces_sm_sharing_only() -> None:
    backend = SimulatedInventory(node_name="n", spec=parse_flag("1xL4-24GB", driver="580.65.06"))
    capability = capability_for(driver=DriverVersion.parse("580.65.06"), mps_running=True)
    state = desired_state(inventory=backend.read(), capability=capability)
    assert state.ready and "enforceable: sm-sharing" in state.message
    assert state.labels["gpufrac.io/compute-mode.time-slicing"] == "false"
    assert state.labels["gpufrac.io/compute-mode.sm-sharing"] == "true"
    assert state.labels["gpu-fractioning.kai.scheduler/nvidia-driver-version.major"] == "580"


def test_unreadable_inventory_and_disconnected_nri_are_not_ready() -> None:
    state = desired_state(inventory=None, unavailable="NVML: Driver Not Loaded")
    assert not state.ready and state.gpus == () and "Driver Not Loaded" in state.message
    backend = SimulatedInventory(node_name="n", spec=parse_flag("1xL4-24GB"))
    state = desired_state(inventory=backend.read(), capability=v3(), nri_connected=False)
    assert not state.ready and state.reason == "NriPluginNotConnected" and len(state.gpus) == 1


def test_nvml_backend_imports_without_a_gpu() -> None:
    from gpufrac.node.inventory import nvml  # REAL backend: import only, there is no GPU here

    assert nvml._cuda_version(12040) == "12.4" and nvml._cuda_version(13040) == "13.4"
