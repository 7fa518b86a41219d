"""Devices reach the container: the CDI devices the node agent requests, through NRI's real adaptation.

The NVIDIA toolkit is set to ignore ``NVIDIA_VISIBLE_DEVICES`` in unprivileged containers (the operator
requirement, docs/node-agent.md), so a GPU container bound by UUID gets its GPUs as the CDI devices
``nvidia.com/gpu=<uuid>`` the agent adds to the adjustment (``cdi_kind``; the toolkit's spec carries the
device nodes and the memory-limit hook). A container without a gpufrac ask gets no CDI device from the
agent, whatever it sets itself; what a device plugin gave it is reported (or refused), not widened.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from nri_harness import GPU_A, GPU_B, Node

from gpufrac.contract import keys
from gpufrac.local.nriruntime import ContainerCreateFailed

KAI_NEWER = {  # KAI's newer binder on a default-mode (time-slicing) pod, devices as NVML UUIDs
    "gpu-fraction": "0.5",
    "nvidia.com/container.app.gpu-memory.request": "40779Mi",
    "nvidia.com/container.app.gpus.devices": GPU_A,
    "nvidia.com/container.app.gpu-compute.portion": "0.5",
}

TWO_DEVICES = {
    "gpu-fraction": "0.5",
    "gpu-fraction-num-devices": "2",
    "nvidia.com/container.app.gpu-memory.request": "40779Mi",
}


def _adds_nothing(adjust: dict[str, object]) -> bool:
    """No variable, mount or CDI device in an adjustment (the adaptation fills in empty sections)."""
    return not any(adjust.get(part) for part in ("env", "mounts", "CDI_devices"))


async def test_a_uuid_bound_container_gets_the_toolkits_cdi_device_for_its_gpu(node: Node) -> None:
    pod = await node.pod(KAI_NEWER, name="kai-notebook")
    created = await node.create(pod, "app")
    assert created.cdi_devices == [f"nvidia.com/gpu={GPU_A}"]
    assert [d["name"] for d in created.adjust["CDI_devices"]] == [f"nvidia.com/gpu={GPU_A}"]
    # The variable stays as assigned (the legacy path and the audit's record of what was given).
    assert created.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
    assert created.env["NVIDIA_GPU_MEMORY_LIMIT"] == "40779"


async def test_each_device_is_requested_in_order_and_indices_by_their_cdi_index_name(node: Node) -> None:
    pod = await node.pod({**TWO_DEVICES, "nvidia.com/container.app.gpus.devices": "1,0"})
    created = await node.create(pod, "app")
    assert created.cdi_devices == ["nvidia.com/gpu=1", "nvidia.com/gpu=0"]

    both = await node.pod({**TWO_DEVICES, "nvidia.com/container.app.gpus.devices": f"{GPU_B},{GPU_A}"})
    assert (await node.create(both, "app")).cdi_devices == [
        f"nvidia.com/gpu={GPU_B}",
        f"nvidia.com/gpu={GPU_A}",
    ]


async def test_cdi_names_pass_as_assigned_without_a_second_request(node: Node) -> None:
    cdi = f"k8s.device-plugin.nvidia.com/gpu={GPU_A}"
    pod = await node.pod({**KAI_NEWER, "nvidia.com/container.app.gpus.devices": cdi})
    assert (await node.create(pod, "app")).cdi_devices == [cdi]


async def test_with_cdi_kind_empty_a_uuid_bound_container_gets_only_the_variable(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    node = await make_node(agent=False)
    await node.start_agent(cdi_kind="")
    pod = await node.pod(KAI_NEWER)
    created = await node.create(pod, "app")
    assert created.cdi_devices == [] and "CDI_devices" not in created.adjust
    assert created.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A


async def test_a_container_without_gpu_annotations_gets_no_cdi_device(node: Node) -> None:
    pod = await node.pod({"team": "web"}, name="web")
    created = await node.create(pod, "web")
    assert created.cdi_devices == [] and _adds_nothing(created.adjust)
    assert "NVIDIA_VISIBLE_DEVICES" not in created.env


async def test_gpus_a_container_asks_for_itself_are_not_widened_and_are_reported(node: Node) -> None:
    """No gpufrac ask, but a pod CDI annotation, its own ``NVIDIA_VISIBLE_DEVICES`` and a CDI device
    (what a device plugin's CDI response becomes): the agent adds nothing -- no CDI device, no variable --
    and reports the GPU it was given outside gpufrac. The pod annotation alone grants nothing: containerd
    reads CDI annotations from the container's config (the kubelet's, from device plugins), not the pod's."""
    annotated = await node.pod({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}, name="annotated")
    created = await node.create(annotated, "app")
    assert created.cdi_devices == [] and _adds_nothing(created.adjust)
    assert node.agent.events.emitted == []

    asking = await node.pod({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}, name="asking", namespace="research")
    created = await node.create(
        asking, "app", env={"NVIDIA_VISIBLE_DEVICES": "all"}, cdi_devices=[f"nvidia.com/gpu={GPU_B}"]
    )
    assert created.cdi_devices == [f"nvidia.com/gpu={GPU_B}"]  # its own, nothing added
    assert _adds_nothing(created.adjust) and created.env["NVIDIA_VISIBLE_DEVICES"] == "all"
    ((regarding, _, reason, _message),) = node.agent.events.emitted
    assert (regarding.name, reason) == ("asking", "GpuOutsideGpufrac")
    assert node.agent.counters.read().violations["foreign_gpu"] == 1


async def test_a_cdi_gpu_outside_gpufrac_is_refused_with_refuse(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    node = await make_node(agent=False)
    await node.start_agent(foreign_gpus="refuse")
    pod = await node.pod(name="trainer")
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(pod, "train", cdi_devices=[f"nvidia.com/gpu={GPU_A}"])
    assert f"(the CDI device nvidia.com/gpu={GPU_A})" in str(refused.value)
    assert (await node.runtime.list())["containers"] == []


async def test_a_gpu_share_prepared_by_gpufracs_dra_driver_is_not_foreign(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    """A DRA claim's container carries our driver's CDI device (``gpu.gpufrac.io/claim=…``, whose spec
    brings ``nvidia.com/gpu=<uuid>`` and the share's variables): gpufrac placed and prepared it. Before,
    it was reported (and, with ``refuse``, refused) as a GPU outside gpufrac."""
    node = await make_node(agent=False)
    await node.start_agent(foreign_gpus="refuse")
    pod = await node.pod(name="claimed")
    created = await node.create(
        pod,
        "app",
        env={"NVIDIA_VISIBLE_DEVICES": GPU_A},
        cdi_devices=[f"{keys.DRA_CDI_KIND}=0f1e-gpu-0", f"nvidia.com/gpu={GPU_A}"],
    )
    assert _adds_nothing(created.adjust)
    assert node.agent.events.emitted == []
    assert node.agent.counters.read().violations["foreign_gpu"] == 0
