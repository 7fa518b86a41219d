"""What the binder writes for a placement, and what the node agent reads back as its plan."""

from __future__ import annotations

import pytest

from gpufrac.contract import errors as e
from gpufrac.contract.changes import changed_contract_keys, forbidden_changes
from gpufrac.contract.errors import ContractError, InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.render import ContainerPlacement, node_plan, render_binding, unwritable_keys
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest

NV = "nvidia.com/container."


def test_a_portion_is_floored_on_the_chosen_gpu() -> None:
    request = parse_pod({"gpu-fraction": "0.3", "gpu-fraction.limit": "0.7"}, [ContainerSpec("app")])
    rendered = render_binding(request, [ContainerPlacement("app", ("GPU-1",), gpu_mib=81559)])
    assert rendered == {
        f"{NV}app.gpus.devices": "GPU-1",
        f"{NV}app.gpu-memory.request": "24467Mi",  # floor(0.3 x 81559) = 24467.7 -> 24467
        f"{NV}app.gpu-memory.limit": "57091Mi",  # floor(0.7 x 81559)
    }


def test_sm_sharing_gets_a_compute_portion_from_its_memory_share() -> None:
    annotations = {f"{NV}app.gpu-memory.request": "20Gi", f"{NV}app.gpu-compute.mode": "sm-sharing"}
    request = parse_pod(annotations, [ContainerSpec("app")])
    rendered = render_binding(request, [ContainerPlacement("app", ("GPU-1",), gpu_mib=81920)])
    assert rendered[f"{NV}app.gpu-compute.portion"] == "0.25"
    chosen = render_binding(
        request, [ContainerPlacement("app", ("GPU-1",), gpu_mib=81920, compute_portion=0.4)]
    )
    assert chosen[f"{NV}app.gpu-compute.portion"] == "0.4"


def test_whole_gpus_get_devices_only() -> None:
    request = parse_pod({}, [ContainerSpec("app", gpus=2)])
    assert render_binding(request, [ContainerPlacement("app", ("GPU-1", "GPU-2"), gpu_mib=81920)]) == {
        f"{NV}app.gpus.devices": "GPU-1,GPU-2"
    }


@pytest.mark.parametrize(
    "placements",
    [
        [ContainerPlacement("app", ("GPU-1",), gpu_mib=81920)],  # 2 requested
        [ContainerPlacement("app", ("GPU-1", "GPU-1"), gpu_mib=81920)],  # repeated
        [],  # container missing
        [ContainerPlacement("app", ("GPU-1", "GPU-2"), gpu_mib=0)],
    ],
)
def test_rendering_a_placement_that_does_not_fit_the_request_is_a_caller_bug(
    placements: list[ContainerPlacement],
) -> None:
    request = parse_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, [ContainerSpec("app")])
    with pytest.raises(ValueError, match="app"):
        render_binding(request, placements)


def test_node_plan_of_a_bound_pod() -> None:
    annotations = {
        "gpu-fraction": "0.5",
        f"{NV}app.gpu-compute.mode": "sm-sharing",
    }
    request = parse_pod(annotations, [ContainerSpec("app")])
    bound = {**annotations, **render_binding(request, [ContainerPlacement("app", ("GPU-9",), gpu_mib=40960)])}
    (plan,) = node_plan(parse_pod(bound, [ContainerSpec("app")]))
    assert (plan.devices, plan.request_mib, plan.limit_mib, plan.mode, plan.compute_portion) == (
        ("GPU-9",),
        20480,
        20480,
        ComputeMode.SM_SHARING,
        0.5,
    )


def test_node_plan_refuses_what_it_cannot_enforce() -> None:
    unplaced = parse_pod({f"{NV}app.gpu-memory.request": "1Gi"}, [ContainerSpec("app")])
    with pytest.raises(InvalidPodRequest) as raised:
        node_plan(unplaced)
    assert [type(v) for v in raised.value.errors] == [e.NotPlaced]
    assert "no devices are assigned" in raised.value.messages[0]


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


def test_rendering_a_key_the_api_server_would_refuse_is_a_contract_error() -> None:
    """A request parsed before the rule existed (or built by hand) still never becomes an invalid key."""
    name = "tokenizer-and-embedding-server-east"  # 35: the request key's name part would have 64
    half = GpuMemory(portion=0.5)
    request = PodGpuRequest(containers=(ContainerGpuRequest(container=name, request=half, limit=half),))
    with pytest.raises(InvalidPodRequest) as raised:
        render_binding(request, [ContainerPlacement(name, ("GPU-1",), gpu_mib=81920)])
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
