"""The runtime itself refuses GPU containers while the node agent is away (NRI's default validator).

The mutating webhook marks every GPU pod as requiring the node agent's plugin; a runtime with NRI's default
validator on (containerd: ``[plugins."io.containerd.nri.v1.nri".default_validator] enable = true``) then
refuses its containers until the plugin is connected. The pod's annotations here are what the webhook
stores, and the runtime is NRI's real adaptation with its real validator.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Awaitable, Callable

import pytest
from nri_harness import Node

from gpufrac.admission.review import AdmissionPolicy, mutate_review
from gpufrac.contract import keys
from gpufrac.local.nriruntime import ContainerCreateFailed
from gpufrac.node.nri.plugin import NriPlugin
from gpufrac.node.nri.validator import VALIDATOR_IDENTITY, InjectionValidator

GPU_A = "GPU-8f3c6a2e-0000-4000-8000-00000000000a"


def stored_annotations(annotations: dict[str, str], policy: AdmissionPolicy | None = None) -> dict[str, str]:
    """The pod's annotations after the mutating webhook (what the kubelet hands the runtime)."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml", "annotations": dict(annotations)},
        "spec": {"schedulerName": "gpufrac-scheduler", "containers": [{"name": "train", "image": "x"}]},
    }
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "object": manifest,
            "userInfo": {"username": "alice"},
        },
    }
    response = mutate_review(review, policy or AdmissionPolicy())["response"]
    stored = dict(annotations)
    for op in json.loads(base64.b64decode(response.get("patch", "W10="))):
        if op["path"] == "/metadata/annotations":
            stored = dict(op["value"])
        elif op["path"].startswith("/metadata/annotations/"):
            key = op["path"].removeprefix("/metadata/annotations/").replace("~1", "/").replace("~0", "~")
            if op["op"] == "remove":
                stored.pop(key, None)
            else:
                stored[key] = op["value"]
    return stored


@pytest.fixture
async def guarded(make_node: Callable[..., Awaitable[Node]]) -> Node:
    return await make_node(agent=False, default_validator=True)


async def test_without_the_agent_a_gpu_container_is_refused_and_others_are_not(guarded: Node) -> None:
    gpu = await guarded.pod(
        stored_annotations(
            {
                "nvidia.com/container.train.gpu-memory.request": "20Gi",
                # what the scheduler binds later; written here so the agent has something to inject
                "nvidia.com/container.train.gpus.devices": GPU_A,
            }
        ),
        name="trainer",
    )
    plain = await guarded.pod(stored_annotations({"team": "a"}), name="web")

    with pytest.raises(ContainerCreateFailed) as refused:
        await guarded.create(gpu, "train")
    assert 'required plugin "gpufrac" not present' in str(refused.value)
    created = await guarded.create(plain, "web")
    assert "NVIDIA_VISIBLE_DEVICES" not in created.env

    await guarded.start_agent()
    injected = await guarded.create(gpu, "train")
    assert injected.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
    assert injected.env["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"


async def test_when_the_agent_leaves_gpu_containers_are_refused_again(guarded: Node) -> None:
    agent = await guarded.start_agent()
    gpu = await guarded.pod(
        stored_annotations(
            {
                "nvidia.com/container.train.gpu-memory.request": "1Gi",
                "nvidia.com/container.train.gpus.devices": GPU_A,
            }
        )
    )
    assert (await guarded.create(gpu, "train")).env["NVIDIA_VISIBLE_DEVICES"] == GPU_A

    await agent.stop()
    # The adaptation drops a plugin whose connection closed at its next call to it -- here a plain
    # container's create. (NRI v0.12.3 counts a plugin still in its list as present for the create that
    # finds it closed: a GPU container created at that very moment would pass bare; docs/deploy.md says
    # so, and the restarted agent's Synchronize reports such a container.)
    plain = await guarded.pod(stored_annotations({"team": "a"}))
    await guarded.create(plain, "web")
    with pytest.raises(ContainerCreateFailed, match='required plugin "gpufrac" not present'):
        await guarded.create(gpu, "train")


async def test_with_the_validator_required_and_absent_a_gpu_container_is_refused_though_the_agent_is_there(
    guarded: Node,
) -> None:
    """The webhook configured for a node that runs the agent's validator (``--required-nri-plugin`` twice,
    as the chart and ``gpufrac up`` do): while the validator is away the runtime refuses a GPU container
    even with the agent connected -- the double fault of a hung agent and a missing validator cannot let
    one start bare. The validator's real NRI identity is the name the webhook writes: once it connects,
    the same container is created with its injection."""
    both = AdmissionPolicy(nri_plugins=(keys.NRI_PLUGIN_NAME, keys.NRI_VALIDATOR_PLUGIN_NAME))
    await guarded.start_agent()
    gpu = await guarded.pod(
        stored_annotations(
            {
                "nvidia.com/container.train.gpu-memory.request": "20Gi",
                "nvidia.com/container.train.gpus.devices": GPU_A,
            },
            both,
        ),
        name="trainer",
    )
    with pytest.raises(ContainerCreateFailed) as refused:
        await guarded.create(gpu, "train")
    assert f'required plugin "{keys.NRI_VALIDATOR_PLUGIN_NAME}" not present' in str(refused.value)

    registered = int((await guarded.runtime.list())["registrations"]) + 1
    validator = NriPlugin(
        handler=InjectionValidator(),
        socket_path=str(guarded.socket),
        identity=VALIDATOR_IDENTITY,
        backoff_initial_s=0.02,
        backoff_max_s=0.2,
    )
    task = asyncio.create_task(validator.run())
    try:
        await guarded.runtime.wait_registrations(registered, timeout_s=10)
        injected = await guarded.create(gpu, "train")
        assert injected.env["NVIDIA_VISIBLE_DEVICES"] == GPU_A
        assert injected.env["NVIDIA_GPU_MEMORY_REQUEST"] == "20480"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
