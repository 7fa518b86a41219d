"""The CRD installed once on the session's control plane, and an operator run in-process per test.

The control plane is shared and GpuFractioningConfigs and Nodes are cluster-scoped, so every test names
its own config and selects its nodes by a label of its own, and deletes what it created.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from lightkube import ApiError, AsyncClient, Client, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Node

from gpufrac.operator.resource import CRD_NAME, GpuFractioningConfig

CRD_FILE = Path(__file__).resolve().parents[2] / "deploy" / "crds" / "gpufrac.io_gpufractioningconfigs.yaml"


@pytest.fixture(scope="session")
def crd(kube: Client) -> None:
    """The CRD from deploy/crds, applied (idempotent) and Established."""
    (obj,) = codecs.load_all_yaml(CRD_FILE.read_text())
    kube.apply(obj, field_manager="gpufrac-tests", force=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = kube.get(CustomResourceDefinition, CRD_NAME)
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            return
        time.sleep(0.1)
    pytest.fail("the GpuFractioningConfig CRD did not become Established")


@pytest.fixture
def tag() -> str:
    """A unique suffix: the test's config name and the label value its nodes carry."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
async def cleanup(akube: AsyncClient) -> AsyncIterator[list[tuple[type, str]]]:
    """Cluster-scoped objects (kind, name) a test created; deleted after it."""
    created: list[tuple[type, str]] = []
    yield created
    for kind, name in reversed(created):
        with contextlib.suppress(ApiError):
            await akube.delete(kind, name)


@pytest.fixture
def make_config(
    akube: AsyncClient, crd: None, cleanup: list[tuple[type, str]]
) -> Callable[..., Awaitable[Any]]:
    async def make(name: str, spec: dict[str, Any]) -> Any:
        created = await akube.create(GpuFractioningConfig(metadata=ObjectMeta(name=name), spec=spec))
        cleanup.append((GpuFractioningConfig, name))
        return created

    return make


@pytest.fixture
def make_node(akube: AsyncClient, cleanup: list[tuple[type, str]]) -> Callable[..., Awaitable[Node]]:
    async def make(name: str, labels: dict[str, str]) -> Node:
        created = await akube.create(Node(metadata=ObjectMeta(name=name, labels=labels)))
        cleanup.append((Node, name))
        return created

    return make
