"""The informer against the real API server: list then watch, handlers, resync, clean shutdown.

Relisting after 410 Gone is tested in tests/scheduler/test_watch_gone.py, on a control plane that
compacts etcd every second.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap

from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection, watch_objects

pytestmark = pytest.mark.kube


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_add(self, obj: ConfigMap) -> None:
        self.events.append(("add", obj.metadata.name))

    def on_update(self, old: ConfigMap, new: ConfigMap) -> None:
        self.events.append(("update", new.metadata.name))

    def on_delete(self, obj: ConfigMap) -> None:
        self.events.append(("delete", obj.metadata.name))


async def eventually(check: Callable[[], bool], *, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture
def client(akube: AsyncClient) -> AsyncClient:
    return akube


def configmap(name: str, namespace: str, **data: str) -> ConfigMap:
    return ConfigMap(metadata=ObjectMeta(name=name, namespace=namespace, labels={"app": "x"}), data=data)


async def test_lists_existing_objects_then_delivers_every_change(client: AsyncClient, namespace: str) -> None:
    await client.create(configmap("before", namespace))
    informer: Informer[ConfigMap] = Informer(
        client=client, resource=ConfigMap, selection=Selection(namespace=namespace, labels="app=x")
    )
    seen = Recorder()
    informer.add_handler(seen)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        assert seen.events == [("add", "before")]
        await client.create(configmap("after", namespace))
        await client.patch(ConfigMap, "before", {"data": {"k": "v"}}, namespace=namespace)
        await client.delete(ConfigMap, "after", namespace=namespace)
        await client.create(ConfigMap(metadata=ObjectMeta(name="unlabelled", namespace=namespace)))
        await eventually(lambda: ("delete", "after") in seen.events)
        assert seen.events == [("add", "before"), ("add", "after"), ("update", "before"), ("delete", "after")]
        assert informer.store.keys() == [f"{namespace}/before"]
        assert informer.store.get(f"{namespace}/before").data == {"k": "v"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.done()


async def test_resync_redelivers_stored_objects_as_updates(client: AsyncClient, namespace: str) -> None:
    await client.create(configmap("only", namespace))
    informer: Informer[ConfigMap] = Informer(
        client=client, resource=ConfigMap, selection=Selection(namespace=namespace), resync_period=0.1
    )
    seen = Recorder()
    informer.add_handler(seen)
    task = asyncio.create_task(informer.run())
    try:
        await eventually(lambda: seen.events.count(("update", "only")) >= 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_failing_handler_does_not_stop_the_others(client: AsyncClient, namespace: str) -> None:
    class Broken(Recorder):
        def on_add(self, obj: ConfigMap) -> None:
            raise RuntimeError("boom")

    informer: Informer[ConfigMap] = Informer(
        client=client, resource=ConfigMap, selection=Selection(namespace=namespace)
    )
    seen = Recorder()
    informer.add_handler(Broken())
    informer.add_handler(seen)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        await client.create(configmap("x", namespace))
        await client.create(configmap("y", namespace))
        await eventually(lambda: ("add", "y") in seen.events)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_pod_watch_survives_the_api_servers_bookmark(client: AsyncClient, namespace: str) -> None:
    """The watch cache sends a BOOKMARK two seconds before a watch's deadline (and every minute) once
    the pods' resourceVersion moved past the watch's; a Pod bookmark carries ``"spec":{"containers":null}``,
    which the typed Pod decoder refuses. Decoding it as a Pod killed every informer about a minute after
    it started."""
    from lightkube.models.core_v1 import Container, PodSpec
    from lightkube.resources.core_v1 import Namespace, Pod

    def pod(name: str, ns: str) -> Pod:
        return Pod(
            metadata=ObjectMeta(name=name, namespace=ns),
            spec=PodSpec(containers=[Container(name="c", image="i")]),
        )

    elsewhere = f"{namespace}-other"
    await client.create(Namespace(metadata=ObjectMeta(name=elsewhere)))
    watched = await client.create(pod("bm", namespace))

    async def move_the_pods_version_elsewhere() -> None:
        # A pod in another namespace advances the pods' version without an event for our watch: the
        # next bookmark is newer than anything the watch saw, so the server sends it.
        await client.create(pod(f"other-{uuid.uuid4().hex[:6]}", elsewhere))

    mover = asyncio.create_task(move_the_pods_version_elsewhere())
    events = [
        event
        async for event in watch_objects(
            client,
            Pod,
            selection=Selection(namespace=namespace),
            resource_version=watched.metadata.resourceVersion,
            timeout_seconds=4,
        )
    ]
    await mover
    bookmarks = [event for event in events if event.type == "BOOKMARK"]
    assert bookmarks, f"the API server sent no bookmark within the watch: {[e.type for e in events]}"
    assert all(
        event.object is None and int(event.resource_version) > int(watched.metadata.resourceVersion)
        for event in bookmarks
    )

    informer: Informer[Pod] = Informer(
        client=client, resource=Pod, selection=Selection(namespace=namespace), watch_timeout=3
    )
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        start_version = int(informer.resource_version)
        await move_the_pods_version_elsewhere()
        # Only a bookmark can move the informer's version past the other namespace's pod.
        await eventually(lambda: int(informer.resource_version) > start_version or task.done(), timeout=20)
        assert not task.done(), task.exception()
        await client.patch(Pod, "bm", {"metadata": {"labels": {"seen": "yes"}}}, namespace=namespace)
        await eventually(
            lambda: (informer.store.get(f"{namespace}/bm").metadata.labels or {}).get("seen") == "yes"
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
