"""The node agent's taint switch, on a real API server: where KAI Scheduler places the GPU pods, the
agent publishes its GPUs and readiness but leaves the node untainted, so KAI's pods can land there."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node

from gpufrac.contract import keys
from gpufrac.node.agent import NodeAgent
from gpufrac.node.config import load_settings


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


@pytest.fixture
async def node_name(client: AsyncClient) -> AsyncIterator[str]:
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    await client.create(Node(metadata=ObjectMeta(name=name)))
    yield name
    await client.delete(Node, name)


def managed_taints(node: Node) -> list[str]:
    assert node.spec is not None
    return [t.key for t in node.spec.taints or [] if t.key == keys.MANAGED_TAINT_KEY]


@pytest.mark.parametrize(("flag", "tainted"), [(None, True), (False, False)], ids=["default", "no-taint"])
async def test_the_agent_taints_its_node_unless_told_not_to(
    client: AsyncClient, node_name: str, tmp_path: Path, flag: bool | None, tainted: bool
) -> None:
    settings = load_settings(
        None,
        node_name=node_name,
        backend="simulated",
        sim_gpus="1xH100-80GB",
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        taint=flag,
    )
    agent = NodeAgent(settings=settings, client=client)
    assert agent.publisher is not None
    await agent.publisher.publish_once()

    node = await client.get(Node, node_name)
    assert node.metadata is not None and node.metadata.labels is not None
    assert node.metadata.labels[keys.MANAGED_LABEL] == "true"  # the GPUs are published either way
    assert keys.NODE_GPUS_ANNOTATION in (node.metadata.annotations or {})
    assert managed_taints(node) == ([keys.MANAGED_TAINT_KEY] if tainted else [])


async def test_with_dra_the_agent_publishes_its_slice_and_registers_with_the_kubelet(
    client: AsyncClient, node_name: str, tmp_path: Path
) -> None:
    import shutil
    import tempfile

    from lightkube.resources.resource_v1 import ResourceSlice

    from gpufrac.node.dra.slices import slice_name

    kubelet_dir = Path(tempfile.mkdtemp(prefix="kubelet-"))  # short: unix socket paths are limited

    settings = load_settings(
        None,
        node_name=node_name,
        backend="simulated",
        sim_gpus="1xH100-80GB",
        state_dir=tmp_path,
        nri_socket=str(tmp_path / "nri.sock"),
        dra=True,
        kubelet_dir=kubelet_dir,
        cdi_dir=tmp_path / "cdi",
    )
    agent = NodeAgent(settings=settings, client=client)
    assert agent.publisher is not None and agent.dra_plugin is not None
    await agent.publisher.publish_once()
    published = await client.get(ResourceSlice, slice_name(node_name))
    assert published.spec is not None and len(published.spec.devices or []) == 1
    await agent.dra_plugin.start()
    try:
        assert agent.dra_plugin.registration_socket.is_socket()
        assert agent.dra_plugin.registration_socket.parent == kubelet_dir / "plugins_registry"
    finally:
        await agent.dra_plugin.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
    assert not agent.dra_plugin.registration_socket.exists()


def test_dra_without_publishing_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dra=True with publish=False is invalid"):
        load_settings(None, node_name="n", backend="simulated", sim_gpus="1xL4-24GB", dra=True, publish=False)
