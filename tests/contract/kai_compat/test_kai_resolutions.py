"""The KAI forms gpufrac used to misread, as a user of ``gpufrac validate`` and of the scheduler meets them.

Each was a disagreement with KAI Scheduler listed in issue #12: KAI's stored limit form refused as two
requests, KAI's compute request refused as unknown, a ``gpu-fraction-container-name`` naming the wrong
container silently unused, KAI's ``mps`` annotation unknown, and a ``nvidia.com/gpu`` count spelled in
milli-units refused.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpufrac.contract import keys as k
from gpufrac.contract.changes import forbidden_changes
from gpufrac.contract.errors import (
    ConflictingRequests,
    ImmutableRequest,
    InvalidMps,
    InvalidPodRequest,
    KeyWithoutRequest,
    NotTheRequestingContainer,
)
from gpufrac.contract.parse import parse_pod_manifest
from gpufrac.contract.render import DeviceChoice, render_binding
from gpufrac.contract.request import ComputeMode, GpuMemory, PodGpuRequest


def pod(annotations: dict[str, str], *names: str, gpus: dict[str, Any] | None = None) -> dict[str, Any]:
    containers = [
        {
            "name": n,
            "image": "x",
            "resources": {"limits": {k.GPU_RESOURCE: gpus[n]}} if gpus and n in gpus else {},
        }
        for n in names or ("app",)
    ]
    return {"kind": "Pod", "metadata": {"annotations": annotations}, "spec": {"containers": containers}}


def refused(manifest: dict[str, Any]) -> InvalidPodRequest:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod_manifest(manifest, user_written=True)
    return raised.value


def test_kais_stored_limit_form_is_one_limit() -> None:
    request = parse_pod_manifest(
        pod({"gpu-fraction": "0.25", "gpu-fraction.limit": "0.5", k.portion_limit_key("app"): "0.5"}),
        user_written=True,
    )
    (app,) = request.containers
    assert (app.request, app.limit) == (GpuMemory(portion=0.25), GpuMemory(portion=0.5))


def test_stored_limits_written_differently_but_equal_are_one_limit() -> None:
    request = parse_pod_manifest(
        pod({"gpu-fraction": "0.25", "gpu-fraction.limit": "0.50", k.portion_limit_key("app"): ".5"}),
        user_written=True,
    )
    assert request.containers[0].limit == GpuMemory(portion=0.5)


def test_kais_compute_request_is_what_the_scheduler_charges_on_sm_sharing() -> None:
    manifest = pod(
        {
            "gpu-fraction": "0.25",
            k.compute_mode_key("app"): "sm-sharing",
            k.compute_request_key("app"): "0.5",
        }
    )
    (app,) = parse_pod_manifest(manifest, user_written=True).containers
    assert app.compute_request == 0.5 and app.compute_portion_on(81920) == 0.5
    rendered = render_binding(
        PodGpuRequest(containers=(app,)),
        [DeviceChoice.on_gpu(app, ("GPU-a",), 81920)],
    )
    assert rendered[k.compute_portion_key("app")] == "0.5"  # not the memory share, 0.25


def test_a_compute_request_under_time_slicing_reserves_no_compute() -> None:
    (app,) = parse_pod_manifest(pod({"gpu-fraction": "0.25", k.compute_request_key("app"): "0.5"})).containers
    assert app.mode is ComputeMode.TIME_SLICING and app.compute_portion_on(81920) is None


def test_a_compute_request_with_spaces_is_refused_as_kai_refuses_it() -> None:
    error = refused(pod({"gpu-fraction": "0.25", k.compute_request_key("app"): " 0.5"}))
    assert error.messages == [
        'nvidia.com/container.app.gpu-compute.request=" 0.5" is invalid: '
        "a compute portion must be a number greater than 0 and at most 1."
    ]


def test_a_container_name_that_misses_the_request_is_refused() -> None:
    error = refused(
        pod(
            {"gpu-fraction-container-name": "proxy", k.memory_request_key("worker"): "1Gi"}, "proxy", "worker"
        )
    )
    assert [type(e) for e in error.errors] == [NotTheRequestingContainer]
    assert error.messages[0] == (
        'gpu-fraction-container-name="proxy" is invalid: gpu-fraction-container-name must name the container '
        'that holds the GPU request (container "worker" holds the request).'
    )


def test_a_container_name_on_the_requesting_container_is_fine() -> None:
    request = parse_pod_manifest(
        pod(
            {"gpu-fraction-container-name": "worker", k.memory_request_key("worker"): "1Gi"},
            "proxy",
            "worker",
        ),
        user_written=True,
    )
    assert [c.container for c in request.containers] == ["worker"]


def test_mps_true_makes_the_fraction_sm_sharing() -> None:
    (app,) = parse_pod_manifest(pod({"gpu-fraction": "0.5", k.KAI_MPS: "true"}), user_written=True).containers
    assert app.mode is ComputeMode.SM_SHARING


def test_mps_false_changes_nothing() -> None:
    (app,) = parse_pod_manifest(
        pod({"gpu-fraction": "0.5", k.KAI_MPS: "false"}), user_written=True
    ).containers
    assert app.mode is ComputeMode.TIME_SLICING


@pytest.mark.parametrize(
    ("annotations", "gpus", "rule"),
    [
        ({"gpu-fraction": "0.5", k.KAI_MPS: "yes"}, None, InvalidMps),
        ({k.KAI_MPS: "true"}, None, KeyWithoutRequest),
        ({k.KAI_MPS: "true"}, {"app": 1}, KeyWithoutRequest),
        (
            {"gpu-fraction": "0.5", k.KAI_MPS: "true", k.compute_mode_key("app"): "time-slicing"},
            None,
            ConflictingRequests,
        ),
    ],
    ids=["not-a-boolean", "without-a-request", "with-whole-gpus", "against-time-slicing"],
)
def test_mps_that_cannot_mean_sm_sharing_is_refused(
    annotations: dict[str, str], gpus: dict[str, int] | None, rule: type
) -> None:
    error = refused(pod(annotations, gpus=gpus))
    assert [type(e) for e in error.errors] == [rule] and error.errors[0].key == k.KAI_MPS


def test_mps_is_fixed_once_the_pod_exists() -> None:
    """It changes the compute mode, so a tenant flipping it on a running pod would move a container into
    sm-sharing on a GPU booked for time-slicing."""
    (violation,) = forbidden_changes(
        {"gpu-fraction": "0.5", k.KAI_MPS: "false"},
        {"gpu-fraction": "0.5", k.KAI_MPS: "true"},
        creating=False,
    )
    assert isinstance(violation, ImmutableRequest) and violation.key == k.KAI_MPS


def test_whole_gpus_in_milli_units_are_whole_gpus() -> None:
    (app,) = parse_pod_manifest(pod({}, gpus={"app": "2000m"}), user_written=True).containers
    assert app.exclusive and app.device_count == 2
    with pytest.raises(InvalidPodRequest):
        parse_pod_manifest(pod({}, gpus={"app": "500m"}))
