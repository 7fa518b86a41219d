"""Keys one slip away from the contract's get a warning naming the key that was meant."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufrac.contract import keys as k
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.near_miss import meant_key, near_miss_warnings
from gpufrac.contract.parse import ContainerSpec, parse_pod


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        ("gpu-fractions", "gpu-fraction"),
        ("gpu-fraction-num-device", "gpu-fraction-num-devices"),
        ("GPU-Fraction", "gpu-fraction"),
        ("gpu_memory", "gpu-memory"),
        ("gpu-memory-limit", "gpu-memory.limit"),
        ("gpu-fraction.limits", "gpu-fraction.limit"),
        ("kai.scheduler/gpu-fraction", "gpu-fraction"),
        ("nvidia.com/gpu-fraction", "gpu-fraction"),
        ("nvidia.com/containers.main.gpu-memory.request", "nvidia.com/container.main.gpu-memory.request"),
        ("nvidia.com/container-main.gpu-memory.limit", "nvidia.com/container.main.gpu-memory.limit"),
        ("nvidia.com/main.gpu-compute.mode", "nvidia.com/container.main.gpu-compute.mode"),
        ("nvidia.com/gpu-memory.request", "nvidia.com/container.<container>.gpu-memory.request"),
        (
            "kai.scheduler/containers.main.gpu-memory.portion.limit",
            "kai.scheduler/container.main.gpu-memory.portion.limit",
        ),
        ("gpufrac.io/placement_policy", k.PLACEMENT_POLICY_ANNOTATION),
        ("gpufrac.io/moveable", k.MOVABLE_ANNOTATION),
    ],
)
def test_a_near_miss_names_the_key_that_was_meant(written: str, meant: str) -> None:
    assert meant_key(written) == meant
    (warning,) = near_miss_warnings({written: "1", "app": "web"})
    assert f'"{written}"' in warning and f'did you mean "{meant}"' in warning


@pytest.mark.parametrize(
    "key",
    [
        *k.POD_LEVEL_KEYS,
        k.KAI_MPS,
        "nvidia.com/container.main.gpu-memory.request",
        "kai.scheduler/container.main.gpu-memory.portion.limit",
        k.PLACEMENT_POLICY_ANNOTATION,
        # other people's keys that merely mention a GPU
        "example.com/gpu-fraction",
        "gpu-type",
        "app.kubernetes.io/name",
        "prometheus.io/scrape",
        "nvidia.com/gpu.product",
    ],
)
def test_a_real_key_or_a_foreign_one_gets_no_warning(key: str) -> None:
    assert meant_key(key) is None
    assert near_miss_warnings({key: "x"}) == []


@given(st.sampled_from([*k.POD_LEVEL_KEYS, k.KAI_MPS]))
def test_every_pod_level_key_is_its_own_key(key: str) -> None:
    assert meant_key(key) is None


def test_an_unknown_suffix_under_a_contract_prefix_is_an_error_that_suggests_the_suffix() -> None:
    with pytest.raises(InvalidPodRequest) as refused:
        parse_pod(
            {"nvidia.com/container.main.gpu-memory.requests": "8Gi"},
            [ContainerSpec(name="main")],
        )
    assert 'did you mean "nvidia.com/container.main.gpu-memory.request"?' in str(refused.value)
