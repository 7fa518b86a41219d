"""The operator's informers against the real API server, past its watch bookmarks.

The API server's watch cache sends a BOOKMARK two seconds before a watch's deadline (and every minute).
A bookmark is a skeleton of the resource with nulls where the type requires values (a DaemonSet's has
``"spec":{"selector":null,"template":{...}}``); decoding it as the resource killed the informers about a
minute after start. tests/kube/test_informer.py covers Pods; here are the kinds the operator watches:
its CRD (a generic resource), DaemonSets and Nodes.

The watch cache sends a bookmark only when its version has moved past the version a watch stands at,
so each watch here runs while an object of the same kind outside its selection keeps changing (for the
configs, whose real informer selects all of them, the test selects by a label to have an outside).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.models.apps_v1 import DaemonSetSpec
from lightkube.models.core_v1 import Container, PodSpec, PodTemplateSpec
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection, watch_objects
from gpufrac.operator.render import MANAGED_BY
from gpufrac.operator.resource import GpuFractioningConfig

pytestmark = pytest.mark.kube


async def _survives_bookmarks(
    client: AsyncClient, resource: type, selection: Selection, *, name: str, outside: str
) -> None:
    """A raw watch of ``name``'s selection gets a bookmark as the resource, and an informer lives past
    two bookmarks and two watch ends, then still sees ``name`` change."""
    ns = selection.namespace

    async def relabel(target: str, value: str) -> None:
        patch = {"metadata": {"labels": {"tick": value}}}
        await client.patch(resource, target, patch, namespace=ns, patch_type=PatchType.MERGE)

    async def move_cache() -> None:
        for i in itertools.count():
            await relabel(outside, str(i))
            await asyncio.sleep(0.3)

    mover = asyncio.create_task(move_cache())
    informer = Informer(client=client, resource=resource, selection=selection, watch_timeout=3)
    task: asyncio.Task[None] | None = None
    try:
        version = (await client.get(resource, name, namespace=ns)).metadata.resourceVersion
        events = [
            event
            async for event in watch_objects(
                client, resource, selection=selection, resource_version=version, timeout_seconds=4
            )
        ]
        bookmarks = [e for e in events if e.type == "BOOKMARK"]
        assert bookmarks, f"{resource.__name__}: no bookmark within the watch: {[e.type for e in events]}"
        assert all(e.object is None and int(e.resource_version) > 0 for e in bookmarks)

        task = asyncio.create_task(informer.run())
        await asyncio.wait_for(informer.synced.wait(), 10)
        deadline = asyncio.get_running_loop().time() + 30
        while (informer.watch_restarts < 2 or informer.bookmarks < 2) and not task.done():
            assert asyncio.get_running_loop().time() < deadline, f"{resource.__name__}: no bookmarks"
            await asyncio.sleep(0.1)
        assert not task.done(), task.exception()
        await relabel(name, "seen")
        key = f"{ns}/{name}" if ns else name
        while (informer.store.get(key).metadata.labels or {}).get("tick") != "seen":
            assert asyncio.get_running_loop().time() < deadline + 10, f"{resource.__name__}: change not seen"
            await asyncio.sleep(0.05)
    finally:
        for t in (mover, task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)


async def test_every_informer_of_the_operator_lives_past_the_api_servers_bookmarks(
    akube: AsyncClient,
    namespace: str,
    tag: str,
    make_config: Callable[..., Awaitable[Any]],
    make_node: Callable[..., Awaitable[Node]],
) -> None:
    managed = {"app.kubernetes.io/managed-by": MANAGED_BY, "test": tag}
    for config in (f"bm-{tag}", f"bm-{tag}-outside"):
        await make_config(config, {"nodeAgent": {"image": "gpufrac:test"}})
    await akube.patch(
        GpuFractioningConfig, f"bm-{tag}", {"metadata": {"labels": {"test": tag}}}, patch_type=PatchType.MERGE
    )
    await make_node(f"bm-{tag}", {"test": tag})
    await make_node(f"bm-{tag}-outside", {})
    for ds, labels in (("bm", managed), ("outside", {})):
        await akube.create(
            DaemonSet(
                metadata=ObjectMeta(name=ds, namespace=namespace, labels=labels),
                spec=DaemonSetSpec(
                    selector=LabelSelector(matchLabels={"app": ds}),
                    template=PodTemplateSpec(
                        metadata=ObjectMeta(labels={"app": ds}),
                        spec=PodSpec(containers=[Container(name="c", image="busybox")]),
                    ),
                ),
            )
        )
    await asyncio.gather(
        _survives_bookmarks(
            akube,
            GpuFractioningConfig,
            Selection(labels=f"test={tag}"),
            name=f"bm-{tag}",
            outside=f"bm-{tag}-outside",
        ),
        _survives_bookmarks(
            akube,
            DaemonSet,
            Selection(namespace=namespace, labels=f"app.kubernetes.io/managed-by={MANAGED_BY},test={tag}"),
            name="bm",
            outside="outside",
        ),
        _survives_bookmarks(
            akube, Node, Selection(labels=f"test={tag}"), name=f"bm-{tag}", outside=f"bm-{tag}-outside"
        ),
    )
