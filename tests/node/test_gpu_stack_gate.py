"""The GPU stack gate on a real API server: the GPU Operator's ClusterPolicy (its CRD installed here as
the GPU Operator installs it, the object as it writes it), the node agent's publisher, and the Node as
the scheduler reads it (``gpufrac.scheduler.objects.node_spec``)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from lightkube import AsyncClient, Client
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import NodeCondition, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Node

from gpufrac.node.gpustack import (
    DEPLOY_TOOLKIT_LABEL,
    GATE_LABEL,
    ClusterPolicy,
    GpuStackGate,
    GpuStackSettings,
    judge,
    parse_version,
)
from gpufrac.node.inventory.publish import InventoryPublisher
from gpufrac.node.inventory.simulated import SimulatedInventory, parse_flag
from gpufrac.node.mps.mode import DriverVersion, capability_for
from gpufrac.scheduler.objects import node_spec

READY = "gpu-fractioning.nvidia.com/Ready"
CRD = "clusterpolicies.nvidia.com"


@pytest.fixture(scope="session")
def clusterpolicy_crd(kube: Client) -> Iterator[None]:
    """The GPU Operator's ClusterPolicy CRD, a minimal definition written for these tests (not the GPU
    Operator's own: its schema reduced to "any object", as only the fields the gate reads matter here, with
    the status subresource the GPU Operator writes ``status.state`` through), Established."""
    kube.apply(
        CustomResourceDefinition.from_dict(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": CRD},
                "spec": {
                    "group": "nvidia.com",
                    "scope": "Cluster",
                    "names": {
                        "plural": "clusterpolicies",
                        "singular": "clusterpolicy",
                        "kind": "ClusterPolicy",
                    },
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "subresources": {"status": {}},
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    ],
                },
            }
        ),
        field_manager="gpufrac-tests",
        force=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = kube.get(CustomResourceDefinition, CRD)
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the ClusterPolicy CRD did not become Established")
    yield
    kube.delete(CustomResourceDefinition, CRD)


@pytest.fixture
async def node_name(akube: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await akube.create(Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    await akube.patch(
        Node.Status,
        name,
        {"status": NodeStatus(conditions=[NodeCondition(type="Ready", status="True")]).to_dict()},
    )
    yield name
    await akube.delete(Node, name)


@pytest.fixture
async def cluster_policy(akube: AsyncClient, clusterpolicy_crd: None) -> AsyncIterator[Any]:
    """Writes the (one) ClusterPolicy with the given operand versions; deleted after the test, so no other
    test's node agent reads it."""

    async def write(*, toolkit: str, device_plugin: str, state: str = "ready") -> None:
        body = {
            "apiVersion": "nvidia.com/v1",
            "kind": "ClusterPolicy",
            "metadata": {"name": "cluster-policy", "labels": {"app.kubernetes.io/version": "v26.7.1"}},
            "spec": {
                "toolkit": {
                    "repository": "nvcr.io/nvidia/k8s",
                    "image": "container-toolkit",
                    "version": toolkit,
                },
                "devicePlugin": {
                    "repository": "nvcr.io/nvidia",
                    "image": "k8s-device-plugin",
                    "version": device_plugin,
                },
            },
        }
        await akube.apply(ClusterPolicy.from_dict(body), field_manager="gpu-operator", force=True)
        await akube.apply(
            ClusterPolicy.Status.from_dict({**body, "status": {"state": state}}),
            field_manager="gpu-operator",
            force=True,
        )

    yield write
    with contextlib.suppress(ApiError):
        await akube.delete(ClusterPolicy, "cluster-policy")


def publisher(akube: AsyncClient, name: str, backend: SimulatedInventory, **gate: Any) -> InventoryPublisher:
    return InventoryPublisher(
        client=akube,
        node_name=name,
        backend=backend,
        capability=lambda driver: capability_for(driver=driver, mps_running=True),
        stack_gate=GpuStackGate(
            client=akube, node_name=name, settings=GpuStackSettings(refresh_s=0.001, **gate)
        ),
    )


async def readiness(akube: AsyncClient, name: str) -> tuple[str, str, str, str | None, bool]:
    node = await akube.get(Node, name)
    c = next(c for c in node.status.conditions or [] if c.type == READY)
    return c.status, c.reason, c.message, (node.metadata.labels or {}).get(GATE_LABEL), node_spec(node).ready


async def test_an_old_toolkit_in_the_cluster_policy_keeps_the_node_unplaceable_until_upgraded(
    akube: AsyncClient, node_name: str, cluster_policy
) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    agent = publisher(akube, node_name, backend)
    await cluster_policy(toolkit="v1.17.8-ubuntu22.04", device_plugin="v0.20.1")
    await agent.publish_once()
    status, reason, message, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("False", "GPUOperandVersionUnsupported", "failed", False)
    assert "NVIDIA container toolkit is v1.17.8-ubuntu22.04" in message and "below 1.20.1" in message

    # The GPU Operator upgrades its toolkit: the node comes back by itself at the next publish.
    await cluster_policy(toolkit="v1.20.1-ubuntu22.04", device_plugin="v0.20.1")
    await agent.publish_once()
    status, reason, _, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("True", "GpuFractioningReady", "passed", True)

    # The GPU Operator does not deploy the toolkit on this node: its version says nothing about it.
    await akube.patch(Node, node_name, {"metadata": {"labels": {DEPLOY_TOOLKIT_LABEL: "false"}}})
    await agent.publish_once()
    status, reason, message, _, placeable = await readiness(akube, node_name)
    assert (status, reason, placeable) == ("False", "GPUOperandVersionUnsupported", False)
    assert "NVIDIA container toolkit version is unknown" in message and "gpu_stack.toolkit_version" in message


async def test_a_cluster_policy_that_is_not_ready_gates_the_node_until_it_is(
    akube: AsyncClient, node_name: str, cluster_policy
) -> None:
    """The operand versions are new enough, but the GPU Operator says it has not got there (its spec is what
    it wants, its state whether it runs): the node waits with its own reason, unless the hatch is set."""
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    agent = publisher(akube, node_name, backend)
    await cluster_policy(toolkit="v1.20.1-ubuntu22.04", device_plugin="v0.20.1", state="notReady")
    await agent.publish_once()
    status, reason, message, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("False", "GPUOperatorNotReady", "failed", False)
    assert "the GPU Operator is not ready (ClusterPolicy cluster-policy state is 'notReady')" in message

    # The escape hatch: Ready, and the condition and the label say it is overridden and why.
    await publisher(akube, node_name, backend, allow_unsupported=True).publish_once()
    status, reason, message, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("True", "GpuFractioningReady", "overridden", True)
    assert "GPU stack gate overridden (gpu_stack.allow_unsupported): GPUOperatorNotReady" in message

    # The GPU Operator converges: the node comes back by itself at the next publish.
    await cluster_policy(toolkit="v1.20.1-ubuntu22.04", device_plugin="v0.20.1", state="ready")
    await agent.publish_once()
    status, reason, _, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("True", "GpuFractioningReady", "passed", True)


async def test_an_operand_the_gpu_operator_does_not_deploy_here_is_taken_from_the_settings(
    akube: AsyncClient, node_name: str, cluster_policy
) -> None:
    await cluster_policy(toolkit="v1.17.8", device_plugin="v0.20.1")
    await akube.patch(Node, node_name, {"metadata": {"labels": {DEPLOY_TOOLKIT_LABEL: "false"}}})
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    await publisher(akube, node_name, backend, toolkit_version="1.20.2").publish_once()
    status, reason, message, gate, _ = await readiness(akube, node_name)
    assert (status, reason, gate) == ("True", "GpuFractioningReady", "passed"), message


async def test_without_a_gpu_operator_the_settings_say_and_the_escape_hatch_shows(
    akube: AsyncClient, node_name: str, clusterpolicy_crd: None
) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB"))
    await publisher(
        akube, node_name, backend, toolkit_version="1.19.0", device_plugin_version="0.20.1"
    ).publish_once()
    status, reason, message, _, placeable = await readiness(akube, node_name)
    assert (status, reason, placeable) == ("False", "GPUOperandVersionUnsupported", False)
    assert "from the node agent's gpu_stack settings" in message

    await publisher(
        akube,
        node_name,
        backend,
        toolkit_version="1.19.0",
        device_plugin_version="0.20.1",
        allow_unsupported=True,
    ).publish_once()
    status, reason, message, gate, placeable = await readiness(akube, node_name)
    assert (status, reason, gate, placeable) == ("True", "GpuFractioningReady", "overridden", True)
    assert "GPU stack gate overridden (gpu_stack.allow_unsupported): GPUOperandVersionUnsupported" in message


async def test_an_old_driver_is_its_own_reason(akube: AsyncClient, node_name: str) -> None:
    backend = SimulatedInventory(node_name=node_name, spec=parse_flag("1xL4-24GB", driver="580.65.06"))
    await publisher(
        akube, node_name, backend, toolkit_version="1.20.1", device_plugin_version="0.20.1"
    ).publish_once()
    status, reason, message, _, placeable = await readiness(akube, node_name)
    assert (status, reason, placeable) == ("False", "GPUDriverVersionUnsupported", False)
    assert "driver 580.65.06 is below r615" in message


def test_versions_as_the_gpu_operator_writes_them_and_bad_settings_name_the_key() -> None:
    assert parse_version("v1.20.1-ubuntu22.04") == (1, 20, 1)
    assert parse_version("0.20") == (0, 20, 0)
    assert parse_version("latest") is None
    verdict = judge(None, driver=DriverVersion.parse("615.20.01"), allow_unsupported=False)
    assert verdict.blocks and verdict.reason == "GPUOperandVersionUnsupported"
    assert "toolkit version is unknown (no ClusterPolicy and no setting says it" in verdict.message
    with pytest.raises(ValueError, match=r"gpu_stack.toolkit_version='latest' is not a version"):
        GpuStackSettings(toolkit_version="latest")
