"""A container outside gpufrac that the device plugin gave a GPU, on a node whose GPUs gpufrac shares.

A pod of another scheduler that tolerates the managed taint and asks for ``nvidia.com/gpu`` gets a GPU
from NVIDIA's device plugin: the kubelet hands the runtime the plugin's ``NVIDIA_VISIBLE_DEVICES`` (or its
device-list mounts), and nothing in gpufrac's books knows that GPU is busy. The node agent reports such a
container (the default) or refuses it (``foreign_gpus="refuse"``); the runtime is NRI's real adaptation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from nri_harness import GPU_A, Node

from gpufrac.local.nriruntime import ContainerCreateFailed

DEVICE_PLUGIN_ENV = {"PATH": "/usr/bin", "NVIDIA_VISIBLE_DEVICES": GPU_A}  # what the kubelet passes on
DEVICE_LIST_MOUNT = {
    "destination": f"/var/run/nvidia-container-devices/{GPU_A}",
    "type": "bind",
    "source": "/dev/null",
    "options": ["ro"],
}


async def test_a_device_plugin_gpu_is_created_as_it_is_and_reported_on_its_pod(node: Node) -> None:
    pod = await node.pod({"team": "other"}, name="trainer", namespace="research")
    created = await node.create(pod, "train", env=DEVICE_PLUGIN_ENV)
    assert created.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A and node.store.allocations() == []

    ((regarding, kind, reason, message),) = node.agent.events.emitted
    assert (regarding.kind, regarding.namespace, regarding.name) == ("Pod", "research", "trainer")
    assert (kind, reason) == ("Warning", "GpuOutsideGpufrac")
    assert f"was given a GPU outside gpufrac (NVIDIA_VISIBLE_DEVICES={GPU_A})" in message
    assert node.agent.counters.read().violations["foreign_gpu"] == 1


async def test_device_list_mounts_count_as_a_device_plugin_gpu_too(node: Node) -> None:
    pod = await node.pod(name="mounted")
    await node.create(pod, "c", mounts=[DEVICE_LIST_MOUNT])
    assert [e[2] for e in node.agent.events.emitted] == ["GpuOutsideGpufrac"]
    assert "the device-list mount /var/run/nvidia-container-devices/" in node.agent.events.emitted[0][3]


async def test_containers_without_a_gpu_and_exempt_namespaces_are_not_reported(node: Node) -> None:
    plain = await node.pod(name="web")
    await node.create(plain, "web", env={"PATH": "/usr/bin", "NVIDIA_VISIBLE_DEVICES": "void"})
    system = await node.pod(name="dcgm-exporter", namespace="gpu-operator")
    await node.create(system, "exporter", env={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert node.agent.events.emitted == [] and node.agent.counters.read().violations["foreign_gpu"] == 0


async def test_with_refuse_a_device_plugin_gpu_fails_with_the_reason(
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    node = await make_node(agent=False)
    await node.start_agent(foreign_gpus="refuse")
    pod = await node.pod(name="trainer")
    with pytest.raises(ContainerCreateFailed) as refused:
        await node.create(pod, "train", env=DEVICE_PLUGIN_ENV)
    assert "on a node whose GPUs gpufrac shares" in str(refused.value)
    assert (await node.runtime.list())["containers"] == []
    plain = await node.pod(name="web")
    await node.create(plain, "web")  # a container without a GPU is never refused for it
