"""A pod as KAI Scheduler's newest NvFractions binder leaves it, created through NRI's real adaptation.

The plan-level matrix (both binder versions, UUIDs and CDI names, both modes) is in
``tests/node/test_kai_binder_shapes.py``; this is the one shape that used to fail on the node — a
default-mode (time-slicing) container with the compute portion the newer binder writes on every bind —
created end to end, with the device plugin's CDI names.
"""

from __future__ import annotations

from nri_harness import Node

UUID = "GPU-8f3c6a2e-0000-4000-8000-00000000000a"
CDI = f"k8s.device-plugin.nvidia.com/gpu={UUID}"


async def test_a_kai_bound_time_slicing_pod_starts_with_its_memory_caps_and_no_compute_cap(
    node: Node,
) -> None:
    pod = await node.pod(
        {
            "gpu-fraction": "0.5",  # the user's request, left by KAI's webhook
            "nvidia.com/container.app.gpu-memory.request": "40779Mi",  # floor(81559 MiB x 0.5)
            "nvidia.com/container.app.gpus.devices": CDI,
            "nvidia.com/container.app.gpu-compute.portion": "0.5",  # newer binder, every mode
        },
        name="kai-notebook",
    )
    created = await node.create(pod, "app")

    assert created.env["NVIDIA_VISIBLE_DEVICES"] == CDI
    assert created.cdi_devices == [CDI]
    assert (created.env["NVIDIA_GPU_MEMORY_REQUEST"], created.env["NVIDIA_GPU_MEMORY_LIMIT"]) == (
        "40779",
        "40779",
    )
    assert created.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40779M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in created.env
    record = node.store.get(created.id)
    assert record is not None and record.mode == "time-slicing" and record.portion is None
