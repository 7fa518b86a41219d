"""The injection plan alone: the same function the NRI plugin applies and the audit checks against."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.request import ComputeMode
from gpufrac.node.config import NodeAgentSettings
from gpufrac.node.inject import (
    CONTAINER_PIPE_DIR,
    ENFORCEMENT_ENV,
    EnvPlanner,
    active_thread_percentage,
    is_cdi_name,
    pipe_leaf,
    plan_container,
)

GPU = "GPU-0f0e0d0c-0000-4000-8000-000000000001"
LEAF = "/run/gpufrac/mps-pipes/abc123"


def plan(annotations: dict[str, str], container: str = "c", env: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    return plan_container(annotations=annotations, container=container, env=env, pipe_source=LEAF)


def test_fractional_plan_has_every_variable_and_one_leaf_mount() -> None:
    result, removed = plan(
        {
            "nvidia.com/container.c.gpu-memory.request": "5Gi",
            "nvidia.com/container.c.gpu-memory.limit": "7Gi",
            "nvidia.com/container.c.gpu-compute.mode": "sm-sharing",
            "nvidia.com/container.c.gpu-compute.portion": "0.25",
            "nvidia.com/container.c.gpus.devices": GPU,
        }
    )
    assert result is not None and removed == ()
    assert result.env_map == {
        "NVIDIA_VISIBLE_DEVICES": GPU,
        "NVIDIA_GPU_MEMORY_REQUEST": "5120",
        "NVIDIA_GPU_MEMORY_LIMIT": "7168",
        "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=7168M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
    assert [(m.source, m.destination) for m in result.mounts] == [(LEAF, CONTAINER_PIPE_DIR)]
    assert result.bound.mode is ComputeMode.SM_SHARING and result.bound.compute_portion == 0.25
    assert result.cdi_devices == ()


def test_only_enforcement_variables_present_in_the_container_are_removed() -> None:
    result, removed = plan(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU},
        env=("NVIDIA_VISIBLE_DEVICES=all", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100", "HOME=/", "NOVALUE"),
    )
    assert result is not None
    assert removed == ("NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def test_a_container_without_a_gpu_ask_gets_nothing() -> None:
    assert plan(
        {"nvidia.com/container.gpu.gpu-memory.request": "1Gi", "nvidia.com/container.gpu.gpus.devices": GPU},
        "web",
    ) == (None, ())
    assert plan({}, "web") == (None, ())


def test_names_match_exactly_train_is_not_trainer() -> None:
    annotations = {
        "nvidia.com/container.train.gpu-memory.request": "1Gi",
        "nvidia.com/container.train.gpus.devices": GPU,
    }
    assert plan(annotations, "trainer") == (None, ())
    assert plan(annotations, "train")[0] is not None


def test_unplaced_pod_is_refused_naming_the_devices_key() -> None:
    with pytest.raises(InvalidPodRequest) as refused:
        plan({"nvidia.com/container.c.gpu-memory.request": "1Gi"})
    assert "nvidia.com/container.c.gpus.devices" in str(refused.value)


def test_unresolved_portion_is_refused() -> None:
    # gpu-fraction with devices but without the binder's resolved request: the node does not guess a size.
    with pytest.raises(InvalidPodRequest) as refused:
        plan({"gpu-fraction": "0.5", "nvidia.com/container.c.gpus.devices": GPU})
    assert "gpu-memory.request" in str(refused.value)


def test_a_resolved_pod_level_fraction_is_enforced_on_the_container_the_binder_placed() -> None:
    # The runtime names only the container being created; the binder's keys say which one holds the GPU,
    # whatever the pod-level forms would pick as their target.
    annotations = {
        "gpu-fraction": "0.5",
        "gpu-fraction-container-name": "beta",
        "nvidia.com/container.zeta.gpu-memory.request": "1Gi",
        "nvidia.com/container.zeta.gpu-memory.limit": "2Gi",
        "nvidia.com/container.zeta.gpus.devices": GPU,
        "kai.scheduler/container.alpha.gpu-memory.portion.limit": "0.6",
    }
    zeta, _ = plan(annotations, "zeta")
    assert zeta is not None and zeta.env_map["NVIDIA_GPU_MEMORY_LIMIT"] == "2048"
    assert plan(annotations, "sidecar") == (None, ())
    assert plan(annotations, "beta") == (None, ())


def test_a_pod_level_fraction_nobody_placed_is_refused_for_every_container() -> None:
    for container in ("app", "sidecar"):
        with pytest.raises(InvalidPodRequest) as refused:
            plan({"gpu-fraction": "0.5"}, container)
        assert refused.value.messages == [
            'gpu-fraction="0.5" is invalid: the container has no GPU assignment the node can enforce yet '
            "(no container has devices assigned)."
        ]


def test_whole_gpus_plan_devices_only() -> None:
    result, _ = plan({"gpufrac.io/container.c.gpus": "1", "nvidia.com/container.c.gpus.devices": GPU})
    assert result is not None and result.bound.exclusive
    assert result.env_map == {"NVIDIA_VISIBLE_DEVICES": GPU} and result.mounts == ()


@pytest.mark.parametrize(
    ("device", "cdi"),
    [
        ("nvidia.com/gpu=0", True),
        ("nvidia.com/gpu=GPU-0f0e0d0c-0000-4000-8000-000000000001", True),
        ("nvidia.com/mig=1:0", True),
        (GPU, False),
        ("MIG-5d1a0f0e-0000-4000-8000-000000000001", False),
        ("nvidia.com/gpu", False),
    ],
)
def test_cdi_names_are_recognised(device: str, cdi: bool) -> None:
    assert is_cdi_name(device) is cdi


@pytest.mark.parametrize(
    ("portion", "percent"), [(0.29, 29), (0.57, 57), (0.999, 99), (0.001, 1), (1.0, 100), (0.3333, 33)]
)
def test_active_thread_percentage_floors_to_a_whole_percent_at_least_one(
    portion: float, percent: int
) -> None:
    assert active_thread_percentage(portion) == percent


@given(st.integers(min_value=1, max_value=100))
def test_a_whole_percent_survives_binary_floats(percent: int) -> None:
    assert active_thread_percentage(percent / 100) == percent


def test_pipe_leaf_is_one_directory_per_container() -> None:
    assert pipe_leaf(root="/run/gpufrac/pipes/", container_id="abc") == "/run/gpufrac/pipes/abc"


class Running:
    def __init__(self, name: str, annotations: dict[str, str]) -> None:
        self.name = name
        self.pod_annotations = annotations


def test_audit_planner_expects_what_the_plugin_injects() -> None:
    annotations = {
        "nvidia.com/container.c.gpu-memory.request": "2Gi",
        "nvidia.com/container.c.gpus.devices": GPU,
    }
    planner = EnvPlanner()
    expected = planner.expected_env(container=Running("c", annotations))
    injected, _ = plan(annotations)
    assert injected is not None and expected == injected.env_map
    assert planner.managed_keys == frozenset(ENFORCEMENT_ENV)
    assert planner.expected_env(container=Running("sidecar", annotations)) is None
    assert (
        planner.expected_env(container=Running("c", {"nvidia.com/container.c.gpu-memory.request": "x"}))
        is None
    )


def test_uuids_and_indices_are_requested_as_cdi_devices_of_the_given_kind() -> None:
    annotations = {
        "gpu-fraction": "0.5",
        "gpu-fraction-num-devices": "2",
        "nvidia.com/container.c.gpu-memory.request": "1Gi",
        "nvidia.com/container.c.gpus.devices": f"{GPU},1",
    }
    result, _ = plan_container(
        annotations=annotations, container="c", pipe_source=LEAF, cdi_kind="nvidia.com/gpu"
    )
    assert result is not None and result.cdi_devices == (f"nvidia.com/gpu={GPU}", "nvidia.com/gpu=1")
    assert result.env_map["NVIDIA_VISIBLE_DEVICES"] == f"{GPU},1"  # the variable keeps what was assigned
    off, _ = plan_container(annotations=annotations, container="c", pipe_source=LEAF, cdi_kind="")
    assert off is not None and off.cdi_devices == ()


def test_the_node_agents_cdi_kind_defaults_to_the_toolkits_and_is_checked() -> None:
    assert NodeAgentSettings(node_name="n").cdi_kind == "nvidia.com/gpu"
    assert NodeAgentSettings(node_name="n", cdi_kind="").cdi_kind == ""
    with pytest.raises(ValueError, match=r"cdi_kind='nvidia.com/gpu=0' is invalid: it must be a CDI kind"):
        NodeAgentSettings(node_name="n", cdi_kind="nvidia.com/gpu=0")
