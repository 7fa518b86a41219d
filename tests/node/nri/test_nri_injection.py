"""What a container gets at creation, through NRI's real adaptation with gpufrac's plugin registered."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nri_harness import GPU_A, GPU_B, Node

from gpufrac.local.nriruntime import ContainerCreateFailed
from gpufrac.node.inventory.backend import GpuInfo

MPS_DIR = "/run/nvidia/mps"

ENFORCEMENT = {
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_GPU_MEMORY_REQUEST",
    "NVIDIA_GPU_MEMORY_LIMIT",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
}


def enforcement(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in ENFORCEMENT}


async def test_per_container_keys_give_devices_memory_and_a_private_mps_directory(node: Node) -> None:
    pod = await node.pod(
        {
            "nvidia.com/container.train.gpu-memory.request": "20Gi",
            "nvidia.com/container.train.gpu-memory.limit": "30Gi",
            "nvidia.com/container.train.gpus.devices": f"{GPU_A},{GPU_B}",
            "gpu-fraction-num-devices": "2",
        },
        name="trainer",
    )
    created = await node.create(pod, "train", env={"PATH": "/usr/bin", "EPOCHS": "3"})

    assert enforcement(created.env) == {
        "NVIDIA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}",
        "NVIDIA_GPU_MEMORY_REQUEST": "20480",
        "NVIDIA_GPU_MEMORY_LIMIT": "30720",
        "CUDA_MPS_PIPE_DIRECTORY": MPS_DIR,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=30720M,1=30720M",
    }
    assert created.env["EPOCHS"] == "3" and created.env["PATH"] == "/usr/bin"
    mount = created.mount_at(MPS_DIR)
    assert mount is not None and mount["type"] == "bind"
    # One leaf per container, created on the host before the runtime bind-mounts it.
    assert mount["source"] == str(node.pipe_root / created.id)
    assert os.path.isdir(mount["source"]) and os.listdir(mount["source"]) == []

    record = node.store.get(created.id)
    assert record is not None
    assert (record.pod_namespace, record.pod_name, record.container_name) == ("ml", "trainer", "train")
    assert (record.devices, record.request_mib, record.limit_mib) == ((GPU_A, GPU_B), 20480, 30720)
    assert record.mode == "time-slicing" and record.portion is None and record.pipe_dir == mount["source"]


@pytest.mark.parametrize(
    ("portion", "percent"), [("0.29", "29"), ("0.5", "50"), ("0.004", "1"), ("1", "100")]
)
async def test_sm_sharing_gets_its_active_thread_percentage(node: Node, portion: str, percent: str) -> None:
    pod = await node.pod(
        {
            "nvidia.com/container.infer.gpu-memory.request": "10Gi",
            "nvidia.com/container.infer.gpu-compute.mode": "sm-sharing",
            "nvidia.com/container.infer.gpu-compute.portion": portion,
            "nvidia.com/container.infer.gpus.devices": GPU_A,
        }
    )
    created = await node.create(pod, "infer")
    assert created.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percent
    assert created.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    record = node.store.get(created.id)
    assert record is not None and record.mode == "sm-sharing" and record.portion == float(portion)


async def test_time_slicing_gets_no_thread_ceiling(node: Node) -> None:
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    created = await node.create(pod, "c")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in created.env


@pytest.mark.parametrize(
    ("keys", "request_mib", "limit_mib"),
    [
        ({"nvidia.com/container.c.gpu-memory.request": "1000M"}, "954", "954"),  # ceiling of 953.67 MiB
        ({"nvidia.com/container.c.gpu-memory.limit": "6Gi"}, "6144", "6144"),  # limit only: request = limit
    ],
    ids=["request-only", "limit-only"],
)
async def test_request_only_and_limit_only_set_both_variables(
    node: Node, keys: dict[str, str], request_mib: str, limit_mib: str
) -> None:
    pod = await node.pod({**keys, "nvidia.com/container.c.gpus.devices": GPU_A})
    created = await node.create(pod, "c")
    assert created.env["NVIDIA_GPU_MEMORY_REQUEST"] == request_mib
    assert created.env["NVIDIA_GPU_MEMORY_LIMIT"] == limit_mib


async def test_kai_gpu_fraction_resolved_by_the_binder_applies_to_the_named_container(node: Node) -> None:
    # KAI's pod-level form as our scheduler leaves it on a bound pod: the portion, plus the binder-owned
    # resolved request (floor(0.5 x 81559 MiB)) and devices of the target container.
    pod = await node.pod(
        {
            "gpu-fraction": "0.5",
            "gpu-fraction-container-name": "model",
            "nvidia.com/container.model.gpu-memory.request": "40779Mi",
            "nvidia.com/container.model.gpus.devices": GPU_A,
        }
    )
    model = await node.create(pod, "model")
    sidecar = await node.create(pod, "proxy", env={"PATH": "/bin"})
    assert model.env["NVIDIA_GPU_MEMORY_REQUEST"] == model.env["NVIDIA_GPU_MEMORY_LIMIT"] == "40779"
    assert model.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
    assert sidecar.env == {"PATH": "/bin"} and sidecar.mounts == []
    assert node.store.get(sidecar.id) is None


async def test_kai_gpu_fraction_without_a_name_targets_the_placed_container(node: Node) -> None:
    pod = await node.pod(
        {
            "gpu-fraction": "0.25",
            "gpu-fraction.limit": "0.5",
            "nvidia.com/container.main.gpu-memory.request": "20389Mi",
            "nvidia.com/container.main.gpu-memory.limit": "40779Mi",
            "nvidia.com/container.main.gpus.devices": GPU_B,
        }
    )
    init_like = await node.create(pod, "aaa-logger")
    main = await node.create(pod, "main")
    assert enforcement(init_like.env) == {}
    assert (main.env["NVIDIA_GPU_MEMORY_REQUEST"], main.env["NVIDIA_GPU_MEMORY_LIMIT"]) == ("20389", "40779")


async def test_legacy_gpu_memory_with_devices(node: Node) -> None:
    pod = await node.pod({"gpu-memory": "4096", "nvidia.com/container.app.gpus.devices": GPU_A})
    created = await node.create(pod, "app")
    assert created.env["NVIDIA_GPU_MEMORY_REQUEST"] == created.env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"


async def test_multi_container_pod_touches_only_annotated_containers(node: Node) -> None:
    pod = await node.pod(
        {
            "nvidia.com/container.encoder.gpu-memory.request": "2Gi",
            "nvidia.com/container.encoder.gpus.devices": GPU_A,
            "nvidia.com/container.decoder.gpu-memory.request": "3Gi",
            "nvidia.com/container.decoder.gpu-compute.mode": "sm-sharing",
            "nvidia.com/container.decoder.gpu-compute.portion": "0.3",
            "nvidia.com/container.decoder.gpus.devices": GPU_B,
        }
    )
    encoder = await node.create(pod, "encoder")
    decoder = await node.create(pod, "decoder")
    # "encoder" is a prefix of nothing here, but "enc" would not match "encoder" either: exact names.
    logger = await node.create(pod, "enc", env={"LOG": "1"})

    assert encoder.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A and encoder.env["NVIDIA_GPU_MEMORY_LIMIT"] == "2048"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in encoder.env
    assert decoder.env["NVIDIA_VISIBLE_DEVICES"] == GPU_B and decoder.env["NVIDIA_GPU_MEMORY_LIMIT"] == "3072"
    assert decoder.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert encoder.mount_at(MPS_DIR)["source"] != decoder.mount_at(MPS_DIR)["source"]  # type: ignore[index]
    assert logger.env == {"LOG": "1"} and logger.mounts == [] and logger.adjust.get("env") is None
    assert sorted(r.container_name for r in node.store.allocations()) == ["decoder", "encoder"]


async def test_cdi_device_names_pass_through_as_env_and_cdi_requests(node: Node) -> None:
    pod = await node.pod(
        {
            "nvidia.com/container.c.gpu-memory.request": "8Gi",
            "nvidia.com/container.c.gpus.devices": "nvidia.com/gpu=0,nvidia.com/gpu=1",
            "gpu-fraction-num-devices": "2",
        }
    )
    created = await node.create(pod, "c")
    assert created.env["NVIDIA_VISIBLE_DEVICES"] == "nvidia.com/gpu=0,nvidia.com/gpu=1"
    assert created.cdi_devices == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert created.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M,1=8192M"


async def test_whole_gpu_container_gets_its_devices_and_nothing_to_cap(node: Node) -> None:
    pod = await node.pod(
        {
            "gpufrac.io/container.trainer.gpus": "2",
            "nvidia.com/container.trainer.gpus.devices": f"{GPU_A},{GPU_B}",
        }
    )
    created = await node.create(pod, "trainer", env={"NVIDIA_VISIBLE_DEVICES": "all", "HOME": "/root"})
    assert enforcement(created.env) == {"NVIDIA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}"}
    assert created.env["HOME"] == "/root" and created.mounts == []
    record = node.store.get(created.id)
    assert record is not None and record.exclusive and record.pipe_dir is None


async def test_user_set_enforcement_env_and_mps_mount_are_replaced(node: Node) -> None:
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    user_env = {
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_GPU_MEMORY_LIMIT": "999999",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=999999M",
        "APP": "yes",
    }
    host_mps = {"destination": MPS_DIR, "type": "bind", "source": "/run/nvidia/mps", "options": ["rbind"]}
    created = await node.create(pod, "c", env=user_env, mounts=[host_mps])

    assert created.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
    assert created.env["NVIDIA_GPU_MEMORY_LIMIT"] == "1024"
    assert created.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    assert created.env["APP"] == "yes"
    # One the plan does not set (time-slicing: no active-thread percentage) NRI cannot remove: refused.
    with pytest.raises(ContainerCreateFailed, match="sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='100'"):
        await node.create(pod, "c", env={**user_env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"})
    mps_mounts = [m for m in created.mounts if m["destination"] == MPS_DIR]
    assert len(mps_mounts) == 1 and mps_mounts[0]["source"] == str(node.pipe_root / created.id)


async def test_pod_without_gpu_annotations_is_untouched(node: Node) -> None:
    pod = await node.pod({"prometheus.io/scrape": "true"})
    created = await node.create(pod, "web", env={"NVIDIA_VISIBLE_DEVICES": "none", "A": "1"})
    assert created.env == {"NVIDIA_VISIBLE_DEVICES": "none", "A": "1"}
    assert created.mounts == [] and node.store.allocations() == []


async def test_many_devices_make_an_answer_larger_than_one_mux_frame(make_node) -> None:  # type: ignore[no-untyped-def]
    # 128 CDI devices: the adjustment is several KiB, which NRI's Go reader only accepts in frames of at
    # most 4 KiB followed by the rest of the message (see gpufrac.node.nri.mux).
    gpus = [
        GpuInfo(uuid=f"GPU-8f3c6a2e-0000-4000-8000-{i:012d}", index=i, minor=i, model="H100", mib=81559)
        for i in range(128)
    ]
    node = await make_node(agent=False)
    await node.start_agent(gpus=gpus)
    devices = [f"nvidia.com/gpu={gpu.uuid}" for gpu in gpus]
    pod = await node.pod(
        {
            "nvidia.com/container.c.gpu-memory.request": "1Gi",
            "nvidia.com/container.c.gpus.devices": ",".join(devices),
            "gpu-fraction-num-devices": "128",
        }
    )
    created = await node.create(pod, "c")
    assert created.cdi_devices == devices
    assert created.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split(",")[-1] == "127=1024M"


# -- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("annotations", "named"),
    [
        (
            {
                "nvidia.com/container.c.gpu-memory.request": "4Zi",
                "nvidia.com/container.c.gpus.devices": GPU_A,
            },
            'nvidia.com/container.c.gpu-memory.request="4Zi" is invalid',
        ),
        (
            {
                "nvidia.com/container.c.gpu-memory.request": "1Gi",
                "nvidia.com/container.c.gpu-compute.mode": " ",
                "nvidia.com/container.c.gpus.devices": GPU_A,
            },
            "nvidia.com/container.c.gpu-compute.mode",
        ),
        (
            {
                "nvidia.com/container.c.gpu-memory.request": "8Gi",
                "nvidia.com/container.c.gpu-memory.limit": "4Gi",
                "nvidia.com/container.c.gpus.devices": GPU_A,
            },
            'nvidia.com/container.c.gpu-memory.limit="4Gi" is invalid',
        ),
        (  # not placed: no devices were assigned, so there is nothing the node could enforce
            {"nvidia.com/container.c.gpu-memory.request": "1Gi"},
            "nvidia.com/container.c.gpus.devices",
        ),
        (
            {
                "nvidia.com/container.c.gpu-memory.requests": "1Gi",
                "nvidia.com/container.c.gpus.devices": GPU_A,
            },
            'nvidia.com/container.c.gpu-memory.requests="1Gi" is invalid',
        ),
    ],
    ids=["unknown-suffix", "blank-mode", "limit-below-request", "not-placed", "unknown-key"],
)
async def test_bad_annotations_fail_the_container_with_a_message_naming_the_key(
    node: Node, annotations: dict[str, str], named: str
) -> None:
    pod = await node.pod(annotations)
    with pytest.raises(ContainerCreateFailed) as failed:
        await node.create(pod, "c")
    assert named in str(failed.value)
    assert str(failed.value).count("gpufrac:") == 1
    listed = await node.runtime.list()
    assert listed["containers"] == [] and node.store.allocations() == []
    assert not node.pipe_root.exists() or os.listdir(node.pipe_root) == []


async def test_fail_open_creates_the_container_without_enforcement(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(fail_open=True)
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "4Zi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    created = await node.create(pod, "c", env={"NVIDIA_VISIBLE_DEVICES": "all", "APP": "1"})
    # Started, but never with more than nothing: the user's own device selection is removed too.
    assert created.env == {"APP": "1"}
    assert created.mounts == [] and node.store.allocations() == []
    assert node.agent.injector.failed_open == 1
    listed = await node.runtime.list()
    assert [c["id"] for c in listed["containers"]] == [created.id]


# -- lifecycle ---------------------------------------------------------------------------------------------


async def test_remove_deletes_the_record_and_the_leaf_directory(node: Node) -> None:
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    created = await node.create(pod, "c")
    leaf = node.pipe_root / created.id
    await node.runtime.start_container(created.id)
    await node.runtime.stop_container(created.id)
    assert node.store.get(created.id) is not None  # a stopped container still exists
    await node.runtime.remove_container(created.id)
    assert node.store.get(created.id) is None
    assert not leaf.exists()
    node.store.flush()
    assert not (node.store.directory / f"{created.id}.json").exists()


# -- devices the node does not have --------------------------------------------------------------------

OTHER_NODES_GPU = "GPU-0b0b0b0b-0000-4000-8000-0000000000ff"


@pytest.mark.parametrize(
    ("devices", "offender"),
    [
        ("all", "all"),
        (OTHER_NODES_GPU, OTHER_NODES_GPU),
        (f"{GPU_A},{OTHER_NODES_GPU}", OTHER_NODES_GPU),
        ("nvidia.com/gpu=all", "nvidia.com/gpu=all"),
        ("nvidia.com/gpu=7", "nvidia.com/gpu=7"),
        ("vendor.example/gpu=0", "vendor.example/gpu=0"),
    ],
    ids=["all", "other-node-uuid", "one-of-two", "cdi-all", "cdi-missing-index", "cdi-other-kind"],
)
async def test_devices_not_in_the_nodes_inventory_fail_the_container_before_any_injection(
    node: Node, devices: str, offender: str
) -> None:
    count = len(devices.split(","))
    pod = await node.pod(
        {
            "nvidia.com/container.c.gpu-memory.request": "1Gi",
            "nvidia.com/container.c.gpus.devices": devices,
            "gpu-fraction-num-devices": str(count),
        }
    )
    with pytest.raises(ContainerCreateFailed) as failed:
        await node.create(pod, "c", env={"NVIDIA_VISIBLE_DEVICES": "all"})
    message = str(failed.value)
    assert f'nvidia.com/container.c.gpus.devices="{devices}" is invalid' in message
    assert f'"{offender}" is not in this node\'s GPU inventory' in message
    listed = await node.runtime.list()
    assert listed["containers"] == [] and node.store.allocations() == []
    assert not node.pipe_root.exists() or os.listdir(node.pipe_root) == []


async def test_whole_gpus_named_all_are_refused_too(node: Node) -> None:
    pod = await node.pod({"gpufrac.io/container.t.gpus": "1", "nvidia.com/container.t.gpus.devices": "all"})
    with pytest.raises(ContainerCreateFailed, match='"all" is not in this node\'s GPU inventory'):
        await node.create(pod, "t")


async def test_the_nodes_gpus_by_index_and_cdi_name_are_accepted(node: Node) -> None:
    pod = await node.pod(
        {
            "nvidia.com/container.c.gpu-memory.request": "1Gi",
            "nvidia.com/container.c.gpus.devices": f"1,nvidia.com/gpu={GPU_A}",
            "gpu-fraction-num-devices": "2",
        }
    )
    created = await node.create(pod, "c")
    assert created.env["NVIDIA_VISIBLE_DEVICES"] == f"1,nvidia.com/gpu={GPU_A}"


async def test_until_the_inventory_is_read_gpu_containers_are_refused(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(agent=False)
    await node.start_agent(gpus=None)
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    with pytest.raises(ContainerCreateFailed, match="GPU inventory has not been read yet"):
        await node.create(pod, "c")
    plain = await node.pod({"team": "a"})
    await node.create(plain, "web")  # containers without GPUs do not wait for it


async def test_fail_open_creates_a_foreign_device_container_without_any_gpu(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(fail_open=True)
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": "all"}
    )
    created = await node.create(pod, "c", env={"NVIDIA_VISIBLE_DEVICES": "all", "APP": "1"})
    assert created.env == {"APP": "1"} and node.store.allocations() == []


# -- container ids a hostile runtime could send -----------------------------------------------------------

HOSTILE_IDS = ["../../escape", "a/b", "with\x00nul", "x" * 300, ".hidden", "..", "-flag"]


def paths_under(root: Path) -> set[Path]:
    return set(root.rglob("*")) if root.exists() else set()


@pytest.mark.parametrize(
    "container_id", HOSTILE_IDS, ids=["traversal", "slash", "nul", "overlong", "dot", "dotdot", "dash"]
)
async def test_a_container_id_that_could_name_a_path_fails_before_anything_is_made(
    node: Node, container_id: str
) -> None:
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    escape = node.root.parent / f"escape-{node.root.name}"  # where ../../ from the pipe root leads
    container_id = container_id.replace("escape", escape.name)
    before = paths_under(node.root)
    with pytest.raises(ContainerCreateFailed) as failed:
        await node.runtime.create_container(id=container_id, pod_id=pod, name="c")
    assert "container id" in str(failed.value) and "is invalid" in str(failed.value)
    assert node.store.allocations() == []
    assert paths_under(node.root) - before == set()  # no leaf directory, no record
    assert not escape.exists()


async def test_synchronize_skips_a_hostile_container_id_without_making_a_path(make_node) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(agent=False)
    pod = await node.pod(
        {"nvidia.com/container.c.gpu-memory.request": "1Gi", "nvidia.com/container.c.gpus.devices": GPU_A}
    )
    escape = node.root.parent / f"escape-{node.root.name}"
    await node.runtime.create_container(id=f"../../{escape.name}", pod_id=pod, name="c")  # nobody refuses
    before = paths_under(node.root)
    agent = await node.start_agent()
    assert agent.store.allocations() == [] and agent.injector.unenforced == {}
    assert {p for p in paths_under(node.root) - before if p.is_file()} == set()
    assert not escape.exists()
