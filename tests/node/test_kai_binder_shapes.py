"""Pods exactly as KAI Scheduler's NvFractions binder leaves them, through the node agent's plan.

KAI's binder (``pkg/binder/plugins/nvfractions/nv_fractions.go``) resolves a fractional pod on the chosen
node: ``nvidia.com/container.<c>.gpu-memory.request`` = floor(node's ``nvidia.com/gpu.memory`` label x
portion) written as a binary quantity (``GpuMemoryAnnotationToNvFractionsMemoryRequest``), the limit
from ``kai.scheduler/container.<c>.gpu-memory.portion.limit`` the same way (the source key stays), and
``gpus.devices`` as the reserved GPU UUIDs, or as CDI names of the device plugin's kind
(``k8s.device-plugin.nvidia.com/gpu=<uuid>``) when the device plugin uses CDI. The older binder
(KAI-Scheduler 45103d4c6fdd02f96ea5ecbce9d5030c6c01dbab) writes exactly that; the newer one (PR #2368,
44d1d0a966465c69b1fd0d24b40b9a1ebb73699e) adds ``gpu-compute.portion`` on every fractional bind, in every
compute mode. The webhook leaves the user's own keys (``gpu-fraction``, ``gpu-fraction.limit``, the
``gpu-memory`` it converted) next to them.

The shapes are built here the way the binder builds them (from the user's pod, the node's memory label,
the received portion and the reserved GPUs), then planned by ``plan_container``, which the NRI plugin
applies and the audit re-checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from gpufrac.contract import keys as k
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.node.inject import plan_container

NODE_GPU_MIB = 81559  # nvidia.com/gpu.memory of an H100 80GB, as GPU Feature Discovery labels it
UUIDS = ("GPU-8f3c6a2e-0000-4000-8000-00000000000a", "GPU-8f3c6a2e-0000-4000-8000-00000000000b")
CDI_KIND = "k8s.device-plugin.nvidia.com/gpu"
LEAF = "/run/gpufrac/mps-pipes/kai"


def kai_quantity(mib: int) -> str:
    """A MiB amount as KAI writes it: a binary-SI quantity in its canonical (largest exact) unit."""
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    user: dict[str, str]  # what the pod carries when KAI's binder sees it (after KAI's webhook)
    container: str
    received_portion: float  # BindRequest.Spec.ReceivedGPU.Portion
    devices: int = 1
    portion_limit: float | None = None  # kai.scheduler/container.<c>.gpu-memory.portion.limit


SHAPES = [
    Shape("gpu-fraction", {"gpu-fraction": "0.5"}, "app", 0.5),
    Shape(
        "gpu-fraction with KAI's stored limit",
        {
            "gpu-fraction": "0.25",
            "gpu-fraction.limit": "0.5",
            k.portion_limit_key("app"): "0.5",  # KAI's webhook adds it and keeps gpu-fraction.limit
        },
        "app",
        0.25,
        portion_limit=0.5,
    ),
    Shape(
        "gpu-fraction for a named container",
        {"gpu-fraction": "0.3", "gpu-fraction-container-name": "worker"},
        "worker",
        0.3,
    ),
    Shape(
        "gpu-memory converted by KAI's webhook",
        {"gpu-memory": "20000", k.memory_request_key("app"): kai_quantity(20000)},
        "app",
        20000 / NODE_GPU_MIB,
    ),
    Shape(
        "gpu-fraction on two devices",
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"},
        "app",
        0.5,
        devices=2,
    ),
]


def bind(shape: Shape, *, newer: bool, cdi: bool, sm_sharing: bool) -> dict[str, str]:
    """The pod's annotations after KAI's binder PreBind (``setNvFractionsMemoryAnnotation``,
    ``setGpuMemoryPortionLimitAnnotation``, the devices, and in the newer binder the compute portion)."""
    annotations = dict(shape.user)
    c = shape.container
    if sm_sharing:
        annotations[k.compute_mode_key(c)] = "sm-sharing"
    if k.memory_request_key(c) not in annotations:
        annotations[k.memory_request_key(c)] = kai_quantity(math.floor(NODE_GPU_MIB * shape.received_portion))
    if shape.portion_limit is not None and k.memory_limit_key(c) not in annotations:
        annotations[k.memory_limit_key(c)] = kai_quantity(math.floor(NODE_GPU_MIB * shape.portion_limit))
    uuids = UUIDS[: shape.devices]
    annotations[k.devices_key(c)] = ",".join(f"{CDI_KIND}={u}" if cdi else u for u in uuids)
    if newer:
        annotations[k.compute_portion_key(c)] = str(shape.received_portion)
    return annotations


def expected_mib(shape: Shape) -> tuple[int, int]:
    if "gpu-memory" in shape.user:
        return 20000, 20000
    request = math.floor(NODE_GPU_MIB * shape.received_portion)
    limit = math.floor(NODE_GPU_MIB * shape.portion_limit) if shape.portion_limit is not None else request
    return request, limit


@pytest.mark.parametrize("sm_sharing", [False, True], ids=["time-slicing", "sm-sharing"])
@pytest.mark.parametrize("cdi", [False, True], ids=["uuid", "cdi"])
@pytest.mark.parametrize("newer", [False, True], ids=["older-binder", "newer-binder"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_every_kai_binder_shape_is_planned(shape: Shape, newer: bool, cdi: bool, sm_sharing: bool) -> None:
    annotations = bind(shape, newer=newer, cdi=cdi, sm_sharing=sm_sharing)
    plan, _ = plan_container(annotations=annotations, container=shape.container, pipe_source=LEAF)

    assert plan is not None
    request, limit = expected_mib(shape)
    env = plan.env_map
    assert (env["NVIDIA_GPU_MEMORY_REQUEST"], env["NVIDIA_GPU_MEMORY_LIMIT"]) == (str(request), str(limit))
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == ",".join(f"{i}={limit}M" for i in range(shape.devices))
    assert env["NVIDIA_VISIBLE_DEVICES"] == annotations[k.devices_key(shape.container)]
    assert plan.cdi_devices == (plan.bound.devices if cdi else ())
    # The portion is a cap on sm-sharing alone, as NVIDIA's reference node agent applies it.
    if newer and sm_sharing:
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(
            math.floor(round(shape.received_portion * 100, 6))
        )
    else:
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
        assert plan.bound.compute_portion is None


def test_a_time_slicing_portion_is_still_checked() -> None:
    """Accepting the newer binder's portion on time-slicing does not accept any text there: a portion
    outside (0, 1] is a broken binding, refused naming the key."""
    annotations = bind(SHAPES[0], newer=True, cdi=False, sm_sharing=False)
    annotations[k.compute_portion_key("app")] = "50"
    with pytest.raises(
        InvalidPodRequest, match=r'nvidia.com/container.app.gpu-compute.portion="50" is invalid'
    ):
        plan_container(annotations=annotations, container="app", pipe_source=LEAF)


def test_stored_limits_that_differ_are_one_request_too_many() -> None:
    """KAI's stored form is accepted because the two limit keys carry the same value; different values
    are still a conflict, so a pod never means two limits."""
    annotations = {"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5", k.portion_limit_key("app"): "0.6"}
    with pytest.raises(InvalidPodRequest, match=r"gpu-fraction\.limit also sets the fraction limit"):
        parse_pod(annotations, [ContainerSpec("app", 0)])
