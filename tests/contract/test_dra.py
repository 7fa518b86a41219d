"""The DRA wire format's one reader: a claim's allocation read without any node state (no pipe root, no
inventory object), as gpufrac-scheduler books it, is what the node prepares."""

from __future__ import annotations

from typing import Any

import pytest

from gpufrac.contract import keys
from gpufrac.contract.dra import AllocationError, device_name, mib_quantity, read_allocation
from gpufrac.contract.request import ComputeMode
from gpufrac.node.dra.prepare import prepare_claim
from gpufrac.node.dra.slices import device_name as slice_device_name
from gpufrac.node.inventory.backend import GpuInfo

GPU = "GPU-0f0e0d0c-0000-4000-8000-000000000001"
DEVICE = device_name(GPU, 0)


def allocated(*results: dict[str, Any], mode: str = "sm-sharing") -> dict[str, Any]:
    parameters = {
        "apiVersion": keys.DRA_CONFIG_API_VERSION,
        "kind": keys.DRA_CONFIG_KIND,
        "computeMode": mode,
    }
    return {
        "metadata": {"name": "share", "namespace": "team-a", "uid": "uid-1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": list(results),
                    "config": [
                        {
                            "source": "FromClass",
                            "opaque": {"driver": keys.DRA_DRIVER_NAME, "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }


def ours(request: str, **consumed: str) -> dict[str, Any]:
    return {
        "request": request,
        "driver": keys.DRA_DRIVER_NAME,
        "pool": "node-1",
        "device": DEVICE,
        "consumedCapacity": consumed,
    }


def test_the_reader_gives_the_bound_share_the_node_plans_from() -> None:
    claim = allocated(
        ours("gpu", memory="20Gi", compute="25"),
        {"request": "nic", "driver": "nic.example.com", "pool": "node-1", "device": "eth1"},
    )
    (share,) = read_allocation(claim, uuids={DEVICE: GPU})
    assert (share.request, share.pool, share.device) == ("gpu", "node-1", DEVICE)
    bound = share.bound
    assert (bound.devices, bound.mode, bound.request_mib, bound.limit_mib, bound.exclusive) == (
        (GPU,),
        ComputeMode.SM_SHARING,
        20 * 1024,
        20 * 1024,
        False,
    )
    assert bound.compute_portion == pytest.approx(0.25)
    (prepared,) = prepare_claim(claim, uuids={DEVICE: GPU}, pipe_root="/run/pipes")
    assert prepared.plan.bound == bound


def test_a_device_the_node_does_not_publish_is_refused_with_its_name() -> None:
    with pytest.raises(AllocationError, match=DEVICE):
        read_allocation(allocated(ours("gpu", memory="1Gi")), uuids={})


def test_device_names_and_quantities_are_the_slices_own() -> None:
    gpu = GpuInfo(uuid=GPU, index=3, minor=3, model="H100", mib=81559)
    assert slice_device_name(gpu) == device_name(GPU, 3) == GPU.lower()
    assert device_name("///", 2) == "gpu-2"
    assert mib_quantity(24576) == "24Gi"


def test_the_class_config_renderer_is_what_the_reader_reads() -> None:
    from gpufrac.contract.dra import class_config, read_share_parameters

    entry = class_config("sm-sharing", memory_limit="30Gi")
    assert entry["opaque"]["driver"] == keys.DRA_DRIVER_NAME
    assert read_share_parameters(entry["opaque"]["parameters"], where="config") == (
        ComputeMode.SM_SHARING,
        "30Gi",
    )
