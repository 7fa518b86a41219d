"""Every accepted form and every rule of the annotation contract, as a table of pods and expectations.

Each row is a pod a user could write; the expectation is either the typed request the scheduler will
place, or the violations (rule class and key) the user will be shown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufrac.contract import errors as e
from gpufrac.contract.errors import InvalidPodRequest, RuleViolation
from gpufrac.contract.parse import ContainerSpec, container_specs, parse_pod, parse_pod_manifest
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, PodGpuRequest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SM = ComputeMode.SM_SHARING
TS = ComputeMode.TIME_SLICING
NV = "nvidia.com/container."


def mib(n: int) -> GpuMemory:
    return GpuMemory(mib=n)


def part(p: float) -> GpuMemory:
    return GpuMemory(portion=p)


def frac(
    container: str, request: GpuMemory, limit: GpuMemory | None = None, **kw: Any
) -> ContainerGpuRequest:
    return ContainerGpuRequest(container=container, request=request, limit=limit or request, **kw)


def whole(container: str, count: int, **kw: Any) -> ContainerGpuRequest:
    return ContainerGpuRequest(
        container=container, request=None, limit=None, exclusive=True, device_count=count, **kw
    )


def specs(*containers: str | ContainerSpec) -> list[ContainerSpec]:
    return [c if isinstance(c, ContainerSpec) else ContainerSpec(name=c) for c in containers]


def test_reference_example_inference_sm_sharing() -> None:
    pod = yaml.safe_load((EXAMPLES / "inference-sm-sharing.yaml").read_text())
    assert parse_pod_manifest(pod, user_written=True) == PodGpuRequest(
        (frac("app", mib(40960), mib(61440), mode=SM, device_count=4),)
    )


def test_reference_example_notebook_time_slicing() -> None:
    pod = yaml.safe_load((EXAMPLES / "notebook-time-slicing.yaml").read_text())
    request = parse_pod_manifest(pod, user_written=True)
    assert request == PodGpuRequest((frac("app", part(0.5), part(0.8), mode=TS, device_count=2),))
    app = request.containers[0]
    assert (app.request_mib(81920), app.limit_mib(81920)) == (40960, 65536)


VALID: list[tuple[str, dict[str, str], list[ContainerSpec], PodGpuRequest]] = [
    (
        "request only: the limit defaults to the request",
        {f"{NV}app.gpu-memory.request": "8Gi"},
        specs("app"),
        PodGpuRequest((frac("app", mib(8192)),)),
    ),
    (
        "limit only: the request is the limit",
        {f"{NV}app.gpu-memory.limit": "8Gi"},
        specs("app"),
        PodGpuRequest((frac("app", mib(8192), mib(8192)),)),
    ),
    (
        "decimal suffixes round up to whole MiB",
        {f"{NV}app.gpu-memory.request": "1000M"},
        specs("app"),
        PodGpuRequest((frac("app", mib(954)),)),
    ),
    (
        "gpu-fraction without a limit: the limit is the fraction",
        {"gpu-fraction": "0.25"},
        specs("app"),
        PodGpuRequest((frac("app", part(0.25)),)),
    ),
    (
        "pod-level forms apply to the first container by default (as KAI)",
        {"gpu-fraction": "0.5"},
        specs("main", "sidecar"),
        PodGpuRequest((frac("main", part(0.5)),)),
    ),
    (
        "gpu-fraction-container-name picks the container",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "sidecar"},
        specs("main", "sidecar"),
        PodGpuRequest((frac("sidecar", part(0.5)),)),
    ),
    (
        "KAI's per-container portion limit",
        {"gpu-fraction": "0.3", "kai.scheduler/container.app.gpu-memory.portion.limit": "0.6"},
        specs("app"),
        PodGpuRequest((frac("app", part(0.3), part(0.6)),)),
    ),
    (
        "legacy gpu-memory is MiB",
        {"gpu-memory": "4096"},
        specs("app"),
        PodGpuRequest((frac("app", mib(4096)),)),
    ),
    (
        "gpu-memory.limit is a quantity",
        {"gpu-memory": "4096", "gpu-memory.limit": "8Gi"},
        specs("app"),
        PodGpuRequest((frac("app", mib(4096), mib(8192)),)),
    ),
    (
        "gpu-memory next to an agreeing explicit request (KAI's translated form)",
        {"gpu-memory": "4096", f"{NV}app.gpu-memory.request": "4Gi"},
        specs("app"),
        PodGpuRequest((frac("app", mib(4096)),)),
    ),
    (
        "gpu-fraction-num-devices multiplies every fractional container",
        {
            f"{NV}a.gpu-memory.request": "10Gi",
            f"{NV}b.gpu-memory.request": "20Gi",
            "gpu-fraction-num-devices": "2",
        },
        specs("a", "b", "c"),
        PodGpuRequest((frac("a", mib(10240), device_count=2), frac("b", mib(20480), device_count=2))),
    ),
    (
        "nvidia.com/gpu is an exclusive whole-GPU request",
        {},
        specs(ContainerSpec("app", gpus=2), "sidecar"),
        PodGpuRequest((whole("app", 2),)),
    ),
    (
        "the webhook's whole-GPU key, with or without the resource",
        {"gpufrac.io/container.app.gpus": "3"},
        specs(ContainerSpec("app", gpus=3), "other"),
        PodGpuRequest((whole("app", 3),)),
    ),
    (
        "names match exactly: train never matches trainer",
        {f"{NV}train.gpu-memory.request": "1Gi"},
        specs("trainer", "train"),
        PodGpuRequest((frac("train", mib(1024)),)),
    ),
    (
        "a pod without a GPU ask, and keys outside the contract, give an empty request",
        {"nvidia.com/something": "x", "kai.scheduler/queue": "q", "example.com/gpu-fraction": "9"},
        specs("app"),
        PodGpuRequest(()),
    ),
    (
        "KAI keys under kai.scheduler/container. other than the portion limit are KAI's business",
        {"kai.scheduler/container.app.future-key": "x"},
        specs("app"),
        PodGpuRequest(()),
    ),
    (
        "a placed pod: the binder's resolved request wins over gpu-fraction",
        {
            "gpu-fraction": "0.5",
            "gpu-fraction.limit": "0.8",
            f"{NV}app.gpu-memory.request": "40960Mi",
            f"{NV}app.gpu-memory.limit": "65536Mi",
            f"{NV}app.gpu-compute.mode": "sm-sharing",
            f"{NV}app.gpu-compute.portion": "0.5",
            f"{NV}app.gpus.devices": "GPU-aaaa,GPU-bbbb",
            "gpu-fraction-num-devices": "2",
        },
        specs("app"),
        PodGpuRequest(
            (
                frac(
                    "app",
                    mib(40960),
                    mib(65536),
                    mode=SM,
                    device_count=2,
                    devices=("GPU-aaaa", "GPU-bbbb"),
                    compute_portion=0.5,
                ),
            )
        ),
    ),
    (
        "surrounding whitespace is forgiven",
        {f"{NV}app.gpu-memory.request": " 2Gi ", f"{NV}app.gpu-compute.mode": " sm-sharing "},
        specs("app"),
        PodGpuRequest((frac("app", mib(2048), mode=SM),)),
    ),
    (
        "a compute mode on a whole-GPU container is accepted",
        {f"{NV}app.gpu-compute.mode": "sm-sharing"},
        specs(ContainerSpec("app", gpus=1)),
        PodGpuRequest((whole("app", 1, mode=SM),)),
    ),
    (
        "CDI device names are accepted as devices",
        {f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "nvidia.com/gpu=0"},
        specs("app"),
        PodGpuRequest((frac("app", mib(1024), devices=("nvidia.com/gpu=0",)),)),
    ),
]


@pytest.mark.parametrize(
    ("annotations", "containers", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID]
)
def test_accepted_forms(
    annotations: dict[str, str], containers: list[ContainerSpec], expected: PodGpuRequest
) -> None:
    assert parse_pod(annotations, containers) == expected


REQ = f"{NV}app.gpu-memory.request"
LIM = f"{NV}app.gpu-memory.limit"
MODE = f"{NV}app.gpu-compute.mode"
PORTION = f"{NV}app.gpu-compute.portion"
DEV = f"{NV}app.gpus.devices"
Violations = list[tuple[type[RuleViolation], str]]

INVALID: list[tuple[str, dict[str, str], list[ContainerSpec], Violations]] = [
    ("fraction of zero", {"gpu-fraction": "0"}, specs("app"), [(e.InvalidFraction, "gpu-fraction")]),
    (
        "a fraction of 1 is a whole GPU",
        {"gpu-fraction": "1"},
        specs("app"),
        [(e.InvalidFraction, "gpu-fraction")],
    ),
    ("fraction above 1", {"gpu-fraction": "1.5"}, specs("app"), [(e.InvalidFraction, "gpu-fraction")]),
    ("negative fraction", {"gpu-fraction": "-0.5"}, specs("app"), [(e.InvalidFraction, "gpu-fraction")]),
    ("fraction NaN", {"gpu-fraction": "NaN"}, specs("app"), [(e.InvalidFraction, "gpu-fraction")]),
    ("blank fraction", {"gpu-fraction": ""}, specs("app"), [(e.InvalidFraction, "gpu-fraction")]),
    (
        "fraction limit not above the fraction",
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.5"},
        specs("app"),
        [(e.InvalidFractionLimit, "gpu-fraction.limit")],
    ),
    (
        "fraction limit of 1",
        {"gpu-fraction": "0.5", "gpu-fraction.limit": "1"},
        specs("app"),
        [(e.InvalidFractionLimit, "gpu-fraction.limit")],
    ),
    (
        "portion limit below the fraction",
        {"gpu-fraction": "0.5", "kai.scheduler/container.app.gpu-memory.portion.limit": "0.4"},
        specs("app"),
        [(e.InvalidFractionLimit, "kai.scheduler/container.app.gpu-memory.portion.limit")],
    ),
    (
        "fraction limit without a fraction",
        {"gpu-fraction.limit": "0.8"},
        specs("app"),
        [(e.KeyWithoutRequest, "gpu-fraction.limit")],
    ),
    (
        "two fraction limits",
        {
            "gpu-fraction": "0.5",
            "gpu-fraction.limit": "0.8",
            "kai.scheduler/container.app.gpu-memory.portion.limit": "0.7",
        },
        specs("app"),
        [(e.ConflictingRequests, "kai.scheduler/container.app.gpu-memory.portion.limit")],
    ),
    (
        "portion limit on a container gpu-fraction does not apply to",
        {"gpu-fraction": "0.5", "kai.scheduler/container.side.gpu-memory.portion.limit": "0.7"},
        specs("app", "side"),
        [(e.NotTheFractionTarget, "kai.scheduler/container.side.gpu-memory.portion.limit")],
    ),
    (
        "device count zero",
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"},
        specs("app"),
        [(e.InvalidDeviceCount, "gpu-fraction-num-devices")],
    ),
    (
        "device count not whole",
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "1.5"},
        specs("app"),
        [(e.InvalidDeviceCount, "gpu-fraction-num-devices")],
    ),
    (
        "device count absurd",
        {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "257"},
        specs("app"),
        [(e.InvalidDeviceCount, "gpu-fraction-num-devices")],
    ),
    (
        "device count without a fractional request",
        {"gpu-fraction-num-devices": "2"},
        specs(ContainerSpec("app", gpus=1)),
        [(e.KeyWithoutRequest, "gpu-fraction-num-devices")],
    ),
    ("gpu-memory with a unit", {"gpu-memory": "4Gi"}, specs("app"), [(e.InvalidLegacyMemory, "gpu-memory")]),
    ("gpu-memory zero", {"gpu-memory": "0"}, specs("app"), [(e.InvalidLegacyMemory, "gpu-memory")]),
    (
        "gpu-memory.limit without a unit",
        {"gpu-memory": "4096", "gpu-memory.limit": "8192"},
        specs("app"),
        [(e.QuantityNeedsUnit, "gpu-memory.limit")],
    ),
    (
        "gpu-memory.limit below gpu-memory",
        {"gpu-memory": "4096", "gpu-memory.limit": "2Gi"},
        specs("app"),
        [(e.LimitBelowRequest, "gpu-memory.limit")],
    ),
    (
        "gpu-memory.limit without gpu-memory",
        {"gpu-memory.limit": "2Gi"},
        specs("app"),
        [(e.KeyWithoutRequest, "gpu-memory.limit")],
    ),
    (
        "one kind of request: gpu-fraction and gpu-memory",
        {"gpu-fraction": "0.5", "gpu-memory": "4096"},
        specs("app"),
        [(e.ConflictingRequests, "gpu-memory")],
    ),
    (
        "one kind of request: explicit request and gpu-fraction before placement",
        {"gpu-fraction": "0.5", REQ: "10Gi"},
        specs("app"),
        [(e.ConflictingRequests, REQ)],
    ),
    (
        "one kind of request: explicit request and a different gpu-memory",
        {"gpu-memory": "4096", REQ: "8Gi"},
        specs("app"),
        [(e.ConflictingRequests, "gpu-memory")],
    ),
    ("limit below request", {REQ: "40Gi", LIM: "20Gi"}, specs("app"), [(e.LimitBelowRequest, LIM)]),
    ("negative request", {REQ: "-1Gi"}, specs("app"), [(e.NotPositive, REQ)]),
    ("zero request", {REQ: "0"}, specs("app"), [(e.NotPositive, REQ)]),
    ("NaN request", {REQ: "NaN"}, specs("app"), [(e.NotAQuantity, REQ)]),
    ("empty request", {REQ: ""}, specs("app"), [(e.NotAQuantity, REQ)]),
    ("unknown suffix", {REQ: "40GB"}, specs("app"), [(e.UnknownQuantitySuffix, REQ)]),
    ("bare number is bytes", {LIM: "4096"}, specs("app"), [(e.BelowMinimum, LIM)]),
    ("blank mode", {REQ: "1Gi", MODE: ""}, specs("app"), [(e.InvalidComputeMode, MODE)]),
    ("unknown mode", {REQ: "1Gi", MODE: "SM-Sharing"}, specs("app"), [(e.InvalidComputeMode, MODE)]),
    ("mode without a request", {MODE: "sm-sharing"}, specs("app"), [(e.KeyWithoutRequest, MODE)]),
    (
        "compute portion above 1",
        {REQ: "1Gi", MODE: "sm-sharing", PORTION: "1.5"},
        specs("app"),
        [(e.InvalidComputePortion, PORTION)],
    ),
    (
        "blank device in the list",
        {REQ: "1Gi", DEV: "GPU-a,,GPU-b"},
        specs("app"),
        [(e.InvalidDeviceList, DEV)],
    ),
    ("repeated device", {REQ: "1Gi", DEV: "GPU-a,GPU-a"}, specs("app"), [(e.InvalidDeviceList, DEV)]),
    (
        "fewer devices than requested",
        {REQ: "1Gi", DEV: "GPU-a", "gpu-fraction-num-devices": "2"},
        specs("app"),
        [(e.DeviceCountMismatch, DEV)],
    ),
    ("devices without a request", {DEV: "GPU-a"}, specs("app"), [(e.KeyWithoutRequest, DEV)]),
    (
        "unknown suffix under nvidia.com/container.",
        {f"{NV}app.gpu-memory.requests": "1Gi"},
        specs("app"),
        [(e.UnknownKey, f"{NV}app.gpu-memory.requests")],
    ),
    (
        "unknown suffix under gpufrac.io/container.",
        {"gpufrac.io/container.app.gpu": "1"},
        specs("app"),
        [(e.UnknownKey, "gpufrac.io/container.app.gpu")],
    ),
    (
        "a key for a container the pod does not have",
        {f"{NV}trainer.gpu-memory.request": "1Gi"},
        specs("train"),
        [(e.UnknownContainer, f"{NV}trainer.gpu-memory.request")],
    ),
    (
        "gpu-fraction-container-name naming no container",
        {"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"},
        specs("app"),
        [(e.UnknownContainer, "gpu-fraction-container-name")],
    ),
    (
        "gpu-fraction on a pod without containers",
        {"gpu-fraction": "0.5"},
        [],
        [(e.UnknownContainer, "gpu-fraction")],
    ),
    (
        "fraction and whole GPU on one container",
        {"gpu-fraction": "0.5"},
        specs(ContainerSpec("app", gpus=1)),
        [(e.FractionWithWholeGpu, "gpu-fraction")],
    ),
    (
        "fraction and whole GPU in one pod",
        {f"{NV}a.gpu-memory.request": "1Gi"},
        specs("a", ContainerSpec("b", gpus=1)),
        [(e.FractionWithWholeGpu, f"{NV}a.gpu-memory.request")],
    ),
    (
        "whole-GPU key disagreeing with the resource",
        {"gpufrac.io/container.app.gpus": "2"},
        specs(ContainerSpec("app", gpus=1)),
        [(e.ConflictingRequests, "gpufrac.io/container.app.gpus")],
    ),
    (
        "whole-GPU key of zero",
        {"gpufrac.io/container.app.gpus": "0"},
        specs("app"),
        [(e.InvalidDeviceCount, "gpufrac.io/container.app.gpus")],
    ),
]


@pytest.mark.parametrize(
    ("annotations", "containers", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_rejected_forms(
    annotations: dict[str, str], containers: list[ContainerSpec], expected: Violations
) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, containers)
    assert [(type(v), v.key) for v in raised.value.errors] == expected
    for violation in raised.value.errors:
        assert violation.value == annotations.get(violation.key, violation.value)


def test_users_may_not_set_binder_owned_keys() -> None:
    annotations = {REQ: "1Gi", DEV: "GPU-a", MODE: "sm-sharing", PORTION: "0.5"}
    assert parse_pod(annotations, specs("app")).containers[0].devices == ("GPU-a",)
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, specs("app"), user_written=True)
    assert {(type(v), v.key) for v in raised.value.errors} == {
        (e.BinderOwnedKey, DEV),
        (e.BinderOwnedKey, PORTION),
    }


def test_every_violation_of_a_pod_is_reported_at_once() -> None:
    annotations = {
        "gpu-fraction": "2",
        "gpu-fraction-num-devices": "x",
        f"{NV}side.gpu-compute.mode": "",
        f"{NV}ghost.gpu-memory.request": "1Gi",
    }
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, specs("app", "side"))
    assert sorted(type(v).__name__ for v in raised.value.errors) == [
        "InvalidComputeMode",
        "InvalidDeviceCount",
        "InvalidFraction",
        "UnknownContainer",
    ]
    assert str(raised.value) == " ".join(raised.value.messages)


def test_a_message_names_key_value_and_rule_in_one_sentence() -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod({REQ: "40Gi", LIM: "20Gi"}, specs("app"))
    (message,) = raised.value.messages
    assert message == (
        'nvidia.com/container.app.gpu-memory.limit="20Gi" is invalid: '
        "the limit must be at least the request (the request is 40960 MiB)."
    )


RULE = "a GPU fraction must be a number greater than 0 and less than 1"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1e-400", " (it reads as 0, too close to 0 to tell apart)"),  # a float underflows to 0
        ("0.99999999999999999999", " (it reads as 1, too close to 1 to tell apart)"),  # rounds to 1
        ("1", " (ask for whole GPUs with nvidia.com/gpu)"),
        ("1.5", " (ask for whole GPUs with nvidia.com/gpu)"),
        ("0", ""),
        ("-1e-400", ""),
        ("-2", ""),
    ],
)
def test_a_fraction_outside_0_and_1_is_refused_and_only_one_of_1_or_more_gets_the_whole_gpu_hint(
    value: str, why: str
) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod({"gpu-fraction": value}, specs("app"))
    assert raised.value.messages == [f'gpu-fraction="{value}" is invalid: {RULE}{why}.']


def test_container_specs_read_the_gpu_limit_or_request() -> None:
    spec = {
        "containers": [
            {"name": "a", "resources": {"limits": {"nvidia.com/gpu": 2}}},
            {"name": "b", "resources": {"requests": {"nvidia.com/gpu": "1"}}},
            {"name": "c"},
        ]
    }
    assert container_specs(spec) == [ContainerSpec("a", 2), ContainerSpec("b", 1), ContainerSpec("c", 0)]


def test_a_non_integer_gpu_resource_is_rejected() -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        container_specs({"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": "0.5"}}}]})
    assert [type(v) for v in raised.value.errors] == [e.InvalidDeviceCount]
    assert raised.value.errors[0].key == "spec.containers[a].resources.limits.nvidia.com/gpu"


@pytest.mark.parametrize(
    ("annotations", "rule", "key"),
    [
        ({"gpu-fraction": "\u0660.\u0665"}, e.InvalidFraction, "gpu-fraction"),  # Arabic-Indic "0.5"
        ({f"{NV}app.gpu-memory.request": "\u0661\u0660Gi"}, e.NotAQuantity, f"{NV}app.gpu-memory.request"),
        ({"gpu-memory": "\u0664\u0660\u0669\u0666"}, e.InvalidLegacyMemory, "gpu-memory"),
        (
            {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "\u0662"},
            e.InvalidDeviceCount,
            "gpu-fraction-num-devices",
        ),
    ],
)
def test_unicode_digits_are_refused_as_kubernetes_does(
    annotations: dict[str, str], rule: type[RuleViolation], key: str
) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, [ContainerSpec("app")])
    assert [(type(v), v.key) for v in raised.value.errors] == [(rule, key)]


# The longest container name whose binder-written keys fit the API server's 63-character name part:
# whole GPUs need `container.<c>.gpus.devices`, a memory share `container.<c>.gpu-memory.request`,
# sm-sharing also `container.<c>.gpu-compute.portion`.
@pytest.mark.parametrize(
    ("annotations", "gpus", "longest"),
    [
        ({}, 1, 40),
        ({"gpu-fraction": "0.5"}, 0, 34),
        ({"gpu-memory": "4096"}, 0, 34),
        (
            {
                "gpu-fraction": "0.5",
                "gpu-fraction-container-name": "{c}",
                "nvidia.com/container.{c}.gpu-compute.mode": "sm-sharing",
            },
            0,
            33,
        ),
    ],
    ids=["whole", "fraction", "legacy-mib", "sm-sharing"],
)
def test_a_gpu_container_name_must_leave_room_for_the_keys_the_scheduler_writes(
    annotations: dict[str, str], gpus: int, longest: int
) -> None:
    def parsed(name: str) -> PodGpuRequest:
        filled = {key.format(c=name): value.format(c=name) for key, value in annotations.items()}
        return parse_pod(filled, [ContainerSpec(name, gpus=gpus)])

    assert parsed("c" * longest).wants_gpu
    too_long = "c" * (longest + 1)
    with pytest.raises(InvalidPodRequest) as raised:
        parsed(too_long)
    (violation,) = raised.value.errors
    assert isinstance(violation, e.UnwritableKey)
    assert violation.key == f"spec.containers[{too_long}].name" and violation.value == too_long
    assert f"allows container names of at most {longest} characters" in violation.message
    assert "the name part must be no more than 63 characters, it has 64" in violation.message


def test_a_long_named_container_without_a_gpu_request_is_no_concern() -> None:
    assert not parse_pod({}, [ContainerSpec("c" * 63)]).wants_gpu
