"""What the binder writes for a placement, and what the node agent reads back as its plan."""

from __future__ import annotations

import pytest

from gpufrac.contract import errors as e
from gpufrac.contract.changes import changed_contract_keys, forbidden_changes
from gpufrac.contract.errors import ContractError, InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.render import BoundContainer, DeviceChoice, read_binding, render_binding
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest
from gpufrac.contract.writable import unwritable_keys

NV = "nvidia.com/container."


def test_a_portion_is_floored_on_the_chosen_gpu() -> None:
    request = parse_pod({"gpu-fraction": "0.3", "gpu-fraction.limit": "0.7"}, [ContainerSpec("app")])
    rendered = render_binding(request, [DeviceChoice.on_gpu(request.containers[0], ("GPU-1",), 81559)])
    assert rendered == {
        f"{NV}app.gpus.devices": "GPU-1",
        f"{NV}app.gpu-memory.request": "24467Mi",  # floor(0.3 x 81559) = 24467.7 -> 24467
        f"{NV}app.gpu-memory.limit": "57091Mi",  # floor(0.7 x 81559)
    }


def test_sm_sharing_gets_a_compute_portion_from_its_memory_share() -> None:
    annotations = {f"{NV}app.gpu-memory.request": "20Gi", f"{NV}app.gpu-compute.mode": "sm-sharing"}
    request = parse_pod(annotations, [ContainerSpec("app")])
    rendered = render_binding(request, [DeviceChoice.on_gpu(request.containers[0], ("GPU-1",), 81920)])
    assert rendered[f"{NV}app.gpu-compute.portion"] == "0.25"
    chosen = render_binding(
        request, [DeviceChoice.on_gpu(request.containers[0], ("GPU-1",), 81920, compute_portion=0.4)]
    )
    assert chosen[f"{NV}app.gpu-compute.portion"] == "0.4"


def test_whole_gpus_get_devices_and_the_whole_gpu_marker_the_node_reads_them_by() -> None:
    """A pod that asked through ``nvidia.com/gpu`` alone (no webhook marked it): the node sees no
    resources, so the binding says "whole GPUs" itself, or the node would refuse the pod."""
    request = parse_pod({}, [ContainerSpec("app", gpus=2)])
    rendered = render_binding(request, [DeviceChoice("app", ("GPU-1", "GPU-2"))])
    assert rendered == {f"{NV}app.gpus.devices": "GPU-1,GPU-2", "gpufrac.io/container.app.gpus": "2"}
    (bound,) = read_binding(rendered)
    assert (bound.exclusive, bound.devices, bound.request_mib) == (True, ("GPU-1", "GPU-2"), None)


@pytest.mark.parametrize(
    "placements",
    [
        [DeviceChoice("app", ("GPU-1",), 40960, 40960)],  # 2 requested
        [DeviceChoice("app", ("GPU-1", "GPU-1"), 40960, 40960)],  # repeated
        [],  # container missing
        [DeviceChoice("app", ("GPU-1", "GPU-2"), 0, 0)],
        [DeviceChoice("app", ("GPU-1", "GPU-2"))],  # no MiB booked
    ],
)
def test_rendering_a_placement_that_does_not_fit_the_request_is_a_caller_bug(
    placements: list[DeviceChoice],
) -> None:
    request = parse_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, [ContainerSpec("app")])
    with pytest.raises(ValueError, match="app"):
        render_binding(request, placements)


def test_read_binding_gives_back_what_the_binder_placed() -> None:
    annotations = {
        "gpu-fraction": "0.5",
        f"{NV}app.gpu-compute.mode": "sm-sharing",
    }
    request = parse_pod(annotations, [ContainerSpec("app")])
    bound = {
        **annotations,
        **render_binding(request, [DeviceChoice.on_gpu(request.containers[0], ("GPU-9",), 40960)]),
    }
    assert read_binding(bound) == (
        BoundContainer(
            container="app",
            devices=("GPU-9",),
            mode=ComputeMode.SM_SHARING,
            request_mib=20480,
            limit_mib=20480,
            compute_portion=0.5,
            exclusive=False,
        ),
    )


def test_read_binding_of_whole_gpus_and_of_a_pod_without_gpus() -> None:
    whole = {"gpufrac.io/container.app.gpus": "2", f"{NV}app.gpus.devices": "GPU-1,GPU-2"}
    (app,) = read_binding(whole)
    assert (app.devices, app.exclusive, app.request_mib, app.limit_mib) == (
        ("GPU-1", "GPU-2"),
        True,
        None,
        None,
    )
    assert read_binding({"team": "a", "kai.scheduler/queue": "q"}) == ()


def test_one_memory_key_alone_stands_for_both() -> None:
    (only_limit,) = read_binding({f"{NV}app.gpu-memory.limit": "2Gi", f"{NV}app.gpus.devices": "GPU-1"})
    (only_request,) = read_binding({f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1"})
    assert (only_limit.request_mib, only_limit.limit_mib) == (2048, 2048)
    assert (only_request.request_mib, only_request.limit_mib) == (1024, 1024)


PLACED = {f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1"}


@pytest.mark.parametrize(
    ("annotations", "refusal"),
    [
        ({f"{NV}app.gpu-memory.request": "1Gi"}, (e.NotPlaced, f"{NV}app.gpus.devices")),
        ({"gpufrac.io/container.app.gpus": "1"}, (e.NotPlaced, f"{NV}app.gpus.devices")),
        ({"gpu-memory": "1024"}, (e.NotPlaced, "gpu-memory")),
        (
            {"gpu-fraction": "0.5", f"{NV}app.gpus.devices": "GPU-1"},
            (e.NotPlaced, f"{NV}app.gpu-memory.request"),
        ),
        ({**PLACED, f"{NV}app.gpus.devices": "GPU-1,GPU-1"}, (e.InvalidDeviceList, f"{NV}app.gpus.devices")),
        ({**PLACED, f"{NV}app.gpus.devices": "GPU 1"}, (e.InvalidDeviceList, f"{NV}app.gpus.devices")),
        (
            {**PLACED, f"{NV}app.gpus.devices": "GPU-1,GPU-2"},
            (e.DeviceCountMismatch, f"{NV}app.gpus.devices"),
        ),
        ({**PLACED, "gpu-fraction-num-devices": "2"}, (e.DeviceCountMismatch, f"{NV}app.gpus.devices")),
        ({**PLACED, "gpu-fraction-num-devices": "two"}, (e.InvalidDeviceCount, "gpu-fraction-num-devices")),
        (
            {**PLACED, "gpufrac.io/container.app.gpus": "1"},
            (e.FractionWithWholeGpu, f"{NV}app.gpu-memory.request"),
        ),
        (
            {"gpufrac.io/container.app.gpus": "2", f"{NV}app.gpus.devices": "GPU-1"},
            (e.DeviceCountMismatch, f"{NV}app.gpus.devices"),
        ),
        (
            {**PLACED, f"{NV}app.gpu-memory.limit": "512Mi"},
            (e.LimitBelowRequest, f"{NV}app.gpu-memory.limit"),
        ),
        ({**PLACED, f"{NV}app.gpu-memory.request": "lots"}, (e.NotAQuantity, f"{NV}app.gpu-memory.request")),
        ({**PLACED, f"{NV}app.gpu-compute.mode": " "}, (e.InvalidComputeMode, f"{NV}app.gpu-compute.mode")),
        (
            {**PLACED, f"{NV}app.gpu-compute.portion": "0"},
            (e.InvalidComputePortion, f"{NV}app.gpu-compute.portion"),
        ),
        (
            {**PLACED, f"{NV}app.gpu-compute.mode": "sm-sharing", f"{NV}app.gpu-compute.portion": "1.5"},
            (e.InvalidComputePortion, f"{NV}app.gpu-compute.portion"),
        ),
        ({**PLACED, f"{NV}app.gpu-memory.limt": "8Gi"}, (e.UnknownKey, f"{NV}app.gpu-memory.limt")),
        ({**PLACED, "gpufrac.io/container.side.gpu": "1"}, (e.UnknownKey, "gpufrac.io/container.side.gpu")),
        ({"gpu-memory": "4Gi", f"{NV}app.gpus.devices": "GPU-1"}, (e.InvalidLegacyMemory, "gpu-memory")),
        (
            {"gpu-memory": "4096", "gpu-memory.limit": "8192", f"{NV}app.gpus.devices": "GPU-1"},
            (e.QuantityNeedsUnit, "gpu-memory.limit"),
        ),
        (  # legacy gpu-memory names no container: with two placed, the node cannot tell whose it is
            {
                "gpu-memory": "4096",
                f"{NV}a.gpus.devices": "GPU-1",
                f"{NV}b.gpus.devices": "GPU-2",
                f"{NV}b.gpu-memory.request": "1Gi",
            },
            (e.NotPlaced, f"{NV}a.gpu-memory.request"),
        ),
    ],
)
def test_read_binding_refuses_what_the_node_cannot_enforce(
    annotations: dict[str, str], refusal: tuple[type[e.RuleViolation], str]
) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        read_binding(annotations)
    assert [(type(v), v.key) for v in raised.value.errors] == [refusal]


def test_legacy_gpu_memory_holds_for_a_container_a_binder_gave_only_devices() -> None:
    (app,) = read_binding({"gpu-memory": "4096", f"{NV}app.gpus.devices": "GPU-1"})
    assert (app.request_mib, app.limit_mib, app.devices) == (4096, 4096, ("GPU-1",))
    named = {
        "gpu-memory": "4096",
        "gpu-memory.limit": "6Gi",
        "gpu-fraction-container-name": "b",
        f"{NV}a.gpu-memory.request": "1Gi",
        f"{NV}a.gpus.devices": "GPU-1",
        f"{NV}b.gpus.devices": "GPU-2",
    }
    a, b = read_binding(named)
    assert (a.request_mib, a.limit_mib) == (1024, 1024)
    assert (b.request_mib, b.limit_mib) == (4096, 6144)


def test_read_binding_reads_nothing_but_the_binding() -> None:
    # The user's side of the request was resolved by the binder; KAI's own keys are no binding.
    user_side = {
        "gpu-fraction": "0.25",
        "gpu-fraction.limit": "0.9",
        "kai.scheduler/container.app.gpu-memory.portion.limit": "0.9",
        "kai.scheduler/container.app.anything": "x",
    }
    (app,) = read_binding({**PLACED, **user_side})
    assert (app.request_mib, app.limit_mib) == (1024, 1024)


def test_changes_to_contract_keys_are_detected() -> None:
    old = {"a": "1", "gpu-fraction": "0.5", f"{NV}app.gpus.devices": "GPU-1"}
    new = {"a": "2", "gpu-fraction": "0.6", "gpu-memory": "10"}
    assert changed_contract_keys(old, new) == ["gpu-fraction", "gpu-memory", f"{NV}app.gpus.devices"]


def test_only_creation_may_set_request_keys_and_nobody_but_the_scheduler_binder_keys() -> None:
    devices = f"{NV}app.gpus.devices"
    created = forbidden_changes({}, {"gpu-fraction": "0.5", devices: "GPU-1"}, creating=True)
    assert [(type(v), v.key) for v in created] == [(e.BinderOwnedKey, devices)]
    updated = forbidden_changes(
        {"gpu-fraction": "0.5", devices: "GPU-1"}, {"gpu-fraction": "0.9"}, creating=False
    )
    assert [(type(v), v.key, v.detail) for v in updated] == [
        (e.ImmutableRequest, "gpu-fraction", ""),
        (e.BinderOwnedKey, devices, "it was removed"),
    ]
    assert forbidden_changes({"gpu-fraction": "0.5"}, {"gpu-fraction": "0.5", "x": "y"}, creating=False) == []


def test_read_binding_accepts_a_portion_on_time_slicing_and_does_not_apply_it() -> None:
    """KAI Scheduler's newest binder writes a compute portion on every fractional bind; under time-slicing
    the node takes the binding and applies no SM cap (NVIDIA's reference node agent does the same)."""
    (bound,) = read_binding({**PLACED, f"{NV}app.gpu-compute.portion": "0.5"})
    assert bound.mode is ComputeMode.TIME_SLICING and bound.compute_portion is None
    (bound,) = read_binding(
        {**PLACED, f"{NV}app.gpu-compute.mode": "sm-sharing", f"{NV}app.gpu-compute.portion": "0.5"}
    )
    assert bound.compute_portion == 0.5


def test_rendering_a_key_the_api_server_would_refuse_is_a_contract_error() -> None:
    """A request parsed before the rule existed (or built by hand) still never becomes an invalid key."""
    name = "tokenizer-and-embedding-server-east"  # 35: the request key's name part would have 64
    half = GpuMemory(portion=0.5)
    request = PodGpuRequest(containers=(ContainerGpuRequest(container=name, request=half, limit=half),))
    with pytest.raises(InvalidPodRequest) as raised:
        render_binding(request, [DeviceChoice(name, ("GPU-1",), 40960, 40960)])
    assert isinstance(raised.value, ContractError)
    (violation,) = raised.value.errors
    assert isinstance(violation, e.UnwritableKey)
    assert violation.message == (
        f'spec.containers[{name}].name="{name}" is invalid: the container name is too long or malformed for'
        " the annotation keys the scheduler writes when it places the pod (the scheduler must write"
        f" {NV}{name}.gpu-memory.request, and the name part must be no more than 63 characters, it has 64;"
        " this GPU request allows container names of at most 34 characters)."
    )
    assert unwritable_keys(request) == [violation]
