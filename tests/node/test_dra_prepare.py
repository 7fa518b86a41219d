"""Preparing a DRA claim: its allocation becomes the same injection an annotation pod gets, in a CDI spec."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpufrac.contract import keys
from gpufrac.contract.request import ComputeMode
from gpufrac.node.dra.prepare import (
    CDI_KIND,
    AllocationError,
    cdi_spec,
    make_pipe_leaves,
    modes_of,
    prepare_claim,
    prepared_plan,
    read_prepared,
    refuse_mixed_modes,
    remove_spec,
    spec_path,
    write_spec,
)
from gpufrac.node.inject import pipe_leaf, plan_container

GPU = "GPU-0f0e0d0c-0000-4000-8000-000000000001"
DEVICE = GPU.lower()
UID = "3f1b9e0c-1111-2222-3333-444455556666"
ROOT = "/run/gpufrac/mps-pipes"


def class_config(mode: str, **extra: Any) -> dict[str, Any]:
    return {
        "source": "FromClass",
        "requests": [],
        "opaque": {
            "driver": keys.DRA_DRIVER_NAME,
            "parameters": {
                "apiVersion": keys.DRA_CONFIG_API_VERSION,
                "kind": keys.DRA_CONFIG_KIND,
                "computeMode": mode,
                **extra,
            },
        },
    }


def claim(*, consumed: str | None = "20Gi", config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ResourceClaim as kube-scheduler leaves it after allocating one share of our GPU."""
    result: dict[str, Any] = {
        "request": "gpu",
        "driver": keys.DRA_DRIVER_NAME,
        "pool": "node-1",
        "device": DEVICE,
    }
    if consumed is not None:
        result["consumedCapacity"] = {keys.DRA_MEMORY_CAPACITY: consumed}
        result["shareID"] = "7d7c1a52-0000-4000-8000-00000000abcd"
    return {
        "metadata": {"name": "share", "namespace": "team-a", "uid": UID},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        result,
                        {"request": "nic", "driver": "nic.example.com", "pool": "node-1", "device": "eth1"},
                    ],
                    "config": config if config is not None else [class_config("time-slicing")],
                }
            }
        },
    }


def prepare(obj: dict[str, Any]):  # type: ignore[no-untyped-def]
    return prepare_claim(obj, uuids={DEVICE: GPU}, pipe_root=ROOT)


def test_a_claim_share_gets_exactly_what_an_annotation_pod_with_that_binding_gets() -> None:
    (share,) = prepare(claim())  # the other driver's device is not ours to prepare
    name = f"{UID}-{DEVICE}"
    # The NRI path's plan for a pod the binder placed on the same GPU with the same 20Gi.
    nri, _ = plan_container(
        annotations={
            "nvidia.com/container.c.gpu-memory.request": "20480Mi",
            "nvidia.com/container.c.gpu-memory.limit": "20480Mi",
            "nvidia.com/container.c.gpus.devices": GPU,
        },
        container="c",
        pipe_source=pipe_leaf(root=ROOT, container_id=name),
        cdi_kind=keys.CDI_GPU_KIND,
    )
    assert nri is not None
    assert share.plan.env == nri.env and share.plan.mounts == nri.mounts
    assert share.plan.env_map["NVIDIA_GPU_MEMORY_LIMIT"] == "20480"
    assert share.cdi_device_ids == (f"{CDI_KIND}={name}", f"{keys.CDI_GPU_KIND}={GPU}")
    spec = cdi_spec(UID, [share])
    assert spec["kind"] == CDI_KIND
    (device,) = spec["devices"]
    assert device["name"] == name
    assert device["containerEdits"]["env"] == [f"{k}={v}" for k, v in nri.env]
    assert device["containerEdits"]["mounts"] == [
        {"hostPath": m.source, "containerPath": m.destination, "options": list(m.options)} for m in nri.mounts
    ]


def test_the_claims_own_config_wins_over_the_class() -> None:
    own = class_config("sm-sharing") | {"source": "FromClaim", "requests": ["gpu"]}
    (share,) = prepare(claim(config=[own, class_config("time-slicing")]))
    assert share.plan.bound.mode is ComputeMode.SM_SHARING
    (share,) = prepare(claim(config=[]))
    assert share.plan.bound.mode is ComputeMode.TIME_SLICING  # the contract's default


def test_without_consumed_capacity_the_claim_holds_the_whole_gpu() -> None:
    (share,) = prepare(claim(consumed=None))  # DRAConsumableCapacity off: whole devices
    assert share.plan.bound.exclusive
    assert share.plan.env_map == {"NVIDIA_VISIBLE_DEVICES": GPU}
    assert share.plan.mounts == ()


def test_consumed_memory_is_rounded_up_to_whole_mib_as_the_contract_does() -> None:
    (share,) = prepare(claim(consumed="1000M"))
    assert share.plan.env_map["NVIDIA_GPU_MEMORY_REQUEST"] == "954"


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        (
            claim(config=[class_config("mig")]),
            'computeMode="mig" is invalid: it must be time-slicing or sm-sharing',
        ),
        (
            claim(
                config=[
                    class_config("sm-sharing")
                    | {"opaque": {"driver": keys.DRA_DRIVER_NAME, "parameters": {}}}
                ]
            ),
            f"it must be {keys.DRA_CONFIG_API_VERSION!r}/{keys.DRA_CONFIG_KIND!r}",
        ),
        (claim(consumed="banana"), 'consumedCapacity.memory="banana" is invalid'),
        ({"metadata": {"name": "share", "namespace": "team-a", "uid": UID}}, "team-a/share is not allocated"),
    ],
)
def test_an_allocation_that_cannot_be_prepared_says_what_and_why(obj: dict[str, Any], says: str) -> None:
    with pytest.raises(AllocationError) as caught:
        prepare(obj)
    assert says in str(caught.value)


def test_a_device_this_node_does_not_publish_is_refused() -> None:
    with pytest.raises(AllocationError) as caught:
        prepare_claim(claim(), uuids={}, pipe_root=ROOT)
    assert f'device="{DEVICE}" is invalid: this node publishes no such GPU' in str(caught.value)


def test_specs_are_written_and_removed_idempotently(tmp_path: Path) -> None:
    spec = cdi_spec(UID, prepare(claim()))
    path = write_spec(tmp_path, UID, spec)
    assert path == spec_path(tmp_path, UID) and json.loads(path.read_text()) == spec
    again = write_spec(tmp_path, UID, spec)  # the kubelet retries a prepare: same file, nothing else
    assert again == path and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert remove_spec(tmp_path, UID) is True
    assert remove_spec(tmp_path, UID) is False  # unprepare twice
    assert list(tmp_path.iterdir()) == []


def test_each_share_gets_its_own_mps_leaf_and_unprepare_removes_only_that(tmp_path: Path) -> None:
    pipes = tmp_path / "mps-pipes"
    shares = prepare_claim(claim(), uuids={DEVICE: GPU}, pipe_root=str(pipes))
    make_pipe_leaves(shares)  # the runtime bind-mounts it: it must exist before the container starts
    (leaf,) = [Path(m.source) for m in shares[0].plan.mounts]
    assert leaf.is_dir() and leaf.parent == pipes
    cdi = tmp_path / "cdi"
    write_spec(cdi, UID, cdi_spec(UID, shares))
    assert remove_spec(cdi, UID, pipe_root=str(pipes)) is True
    assert not leaf.exists() and pipes.is_dir()  # the leaf, not the root


def test_unprepare_leaves_a_busy_leaf_and_anything_outside_the_root(tmp_path: Path) -> None:
    pipes = tmp_path / "mps-pipes"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shares = prepare_claim(claim(), uuids={DEVICE: GPU}, pipe_root=str(pipes))
    make_pipe_leaves(shares)
    (leaf,) = [Path(m.source) for m in shares[0].plan.mounts]
    (leaf / "control").write_text("")  # a client still uses it
    spec = cdi_spec(UID, shares)
    spec["devices"][0]["containerEdits"]["mounts"].append({"hostPath": str(outside), "containerPath": "/x"})
    write_spec(tmp_path / "cdi", UID, spec)
    assert remove_spec(tmp_path / "cdi", UID, pipe_root=str(pipes)) is True
    assert leaf.is_dir() and outside.is_dir()
    assert not spec_path(tmp_path / "cdi", UID).exists()


def test_a_share_of_the_other_mode_on_a_gpu_holding_prepared_claims_is_refused(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    held = "aaaaaaaa-1111-2222-3333-444455556666"
    write_spec(cdi, held, cdi_spec(held, prepare(claim())))  # a time-slicing claim on the GPU
    sm = prepare(claim(config=[class_config("sm-sharing")]))
    with pytest.raises(AllocationError) as caught:
        refuse_mixed_modes(sm, in_use=modes_of(read_prepared(cdi, other_than=UID)))
    assert (
        f"request gpu asks for sm-sharing on GPU {GPU}, which is held in time-slicing by claim {held}: "
        "one compute mode per GPU" in str(caught.value)
    )
    refuse_mixed_modes(
        prepare(claim()), in_use=modes_of(read_prepared(cdi, other_than=UID))
    )  # same mode: fine
    # A retried prepare of the held claim itself, now sm-sharing (its own spec does not count against it).
    refuse_mixed_modes(sm, in_use=modes_of(read_prepared(cdi, other_than=held)))
    remove_spec(cdi, held)
    refuse_mixed_modes(
        sm, in_use=modes_of(read_prepared(cdi, other_than=UID))
    )  # released: the GPU takes either


def test_an_sm_sharing_share_gets_its_compute_portion_as_the_nri_path_gives_it() -> None:
    obj = claim(config=[class_config("sm-sharing")])
    obj["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"][keys.DRA_COMPUTE_CAPACITY] = "25"
    (share,) = prepare(obj)
    nri, _ = plan_container(
        annotations={
            "nvidia.com/container.c.gpu-memory.request": "20Gi",
            "nvidia.com/container.c.gpu-compute.mode": "sm-sharing",
            "nvidia.com/container.c.gpu-compute.portion": "0.25",
            "nvidia.com/container.c.gpus.devices": GPU,
        },
        container="c",
        pipe_source=pipe_leaf(root=ROOT, container_id=f"{UID}-{DEVICE}"),
    )
    assert nri is not None and share.plan.env == nri.env
    assert share.plan.env_map["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_compute_is_ignored_for_time_slicing_and_zero_means_no_ceiling() -> None:
    for mode, percent in (("time-slicing", "25"), ("sm-sharing", "0")):
        obj = claim(config=[class_config(mode)])
        obj["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"][
            keys.DRA_COMPUTE_CAPACITY
        ] = percent
        (share,) = prepare(obj)
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in share.plan.env_map


def test_a_compute_amount_that_is_no_percent_is_refused() -> None:
    obj = claim(config=[class_config("sm-sharing")])
    obj["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"][keys.DRA_COMPUTE_CAPACITY] = (
        "150"
    )
    with pytest.raises(AllocationError) as caught:
        prepare(obj)
    assert 'consumedCapacity.compute="150" is invalid: it must be from 0 to 100' in str(caught.value)


def claim_config(**parameters: Any) -> dict[str, Any]:
    """The claim's own configuration for its request ``gpu`` (applied after the class's)."""
    return class_config("time-slicing", **parameters) | {"source": "FromClaim", "requests": ["gpu"]}


def test_a_claims_memory_limit_above_its_share_is_what_an_annotation_pod_with_that_limit_gets() -> None:
    config = [claim_config(memoryLimit="40Gi"), class_config("time-slicing")]
    (share,) = prepare(claim(consumed="20Gi", config=config))
    nri, _ = plan_container(
        annotations={
            "nvidia.com/container.c.gpu-memory.request": "20480Mi",
            "nvidia.com/container.c.gpu-memory.limit": "40960Mi",
            "nvidia.com/container.c.gpus.devices": GPU,
        },
        container="c",
        pipe_source=pipe_leaf(root=ROOT, container_id=f"{UID}-{DEVICE}"),
        cdi_kind=keys.CDI_GPU_KIND,
    )
    assert nri is not None
    assert share.plan.env == nri.env
    assert share.plan.env_map["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"
    assert share.plan.env_map["NVIDIA_GPU_MEMORY_LIMIT"] == "40960"


@pytest.mark.parametrize(
    ("consumed", "limit", "says"),
    [
        (
            "20Gi",
            "10Gi",
            'memoryLimit of request gpu="10Gi" is invalid: the limit must not be below the request',
        ),
        (None, "40Gi", "a limit applies to a share of a GPU, and this allocation holds the whole GPU"),
        ("20Gi", "lots", "memoryLimit of request gpu"),
    ],
)
def test_a_memory_limit_that_cannot_hold_is_refused_naming_the_parameter(
    consumed: str | None, limit: str, says: str
) -> None:
    with pytest.raises(AllocationError) as caught:
        prepare(claim(consumed=consumed, config=[claim_config(memoryLimit=limit)]))
    assert says in str(caught.value)


def test_a_prepared_share_reads_back_from_its_spec_as_what_it_was_planned_from(tmp_path: Path) -> None:
    """The spec files are the node's state: what a GPU holds (mode, memory) and the MPS namespace a
    share needs are read back from them, and plan the same injection again."""
    obj = claim(
        config=[class_config("sm-sharing"), claim_config(memoryLimit="30Gi", computeMode="sm-sharing")]
    )
    obj["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"][keys.DRA_COMPUTE_CAPACITY] = "29"
    whole = claim(consumed=None)
    whole["metadata"]["uid"] = other = "bbbbbbbb-1111-2222-3333-444455556666"
    write_spec(tmp_path, UID, cdi_spec(UID, prepare(obj), claim="team-a/share"))
    write_spec(tmp_path, other, cdi_spec(other, prepare(whole)))  # written without the claim's name

    shares, exclusive = sorted(read_prepared(tmp_path), key=lambda d: d.claim_uid != UID)
    assert (shares.claim, shares.key) == ("team-a/share", f"{UID}-{DEVICE}")
    (planned,) = prepare(obj)
    assert shares.bound == replace(planned.plan.bound, container=shares.key)  # 0.29 as written: 29 %
    assert prepared_plan(shares).env == planned.plan.env
    assert (exclusive.claim, exclusive.bound.exclusive, exclusive.bound.request_mib) == (other, True, None)
    assert [d.key for d in read_prepared(tmp_path, other_than=UID)] == [exclusive.key]
