"""The informer against the real API server: list then watch, handlers, resync, clean shutdown.

Relisting after 410 Gone is tested in tests/scheduler/test_watch_gone.py, on a control plane that
compacts etcd every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import pytest
from lightkube import AsyncClient
from lightkube.generic_resource import create_global_resource
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod

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
        # The watch delivers in resourceVersion order, so once the labelled object created after the
        # unlabelled one is seen, the watch has passed the unlabelled one: its absence is then a fact,
        # not a race with a watch that has not caught up yet.
        await client.create(configmap("last", namespace))
        await eventually(lambda: ("add", "last") in seen.events)
        assert seen.events == [
            ("add", "before"),
            ("add", "after"),
            ("update", "before"),
            ("delete", "after"),
            ("add", "last"),
        ]
        assert sorted(informer.store.keys()) == [f"{namespace}/before", f"{namespace}/last"]
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


@contextlib.asynccontextmanager
async def cache_moving(client: AsyncClient, pod: Pod) -> AsyncIterator[None]:
    """Keep re-labelling ``pod`` (outside the watched selection) while the block runs.

    The watch cache sends a bookmark only when its version has moved past the version a watch stands
    at; a watch that already saw everything of a quiet resource gets none. A busy cluster moves it all
    the time; a test moves it with a write the watch does not select.
    """

    async def write() -> None:
        for i in itertools.count():
            await client.patch(
                Pod,
                pod.metadata.name,
                {"metadata": {"labels": {"tick": str(i)}}},
                namespace=pod.metadata.namespace,
            )
            await asyncio.sleep(0.3)

    task = asyncio.create_task(write())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def busybox(name: str, namespace: str) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(containers=[Container(name="c", image="busybox")]),
    )


async def test_pod_watch_survives_the_api_servers_bookmark(client: AsyncClient, namespace: str) -> None:
    """The watch cache sends a BOOKMARK two seconds before a watch's deadline (and every minute); a Pod
    bookmark carries ``"spec":{"containers":null}``, which the typed Pod decoder refuses. Decoding it as a
    Pod killed every informer about a minute after it started."""
    pod = await client.create(busybox("bm", namespace))
    await client.create(Namespace(metadata=ObjectMeta(name=f"{namespace}-x")))
    elsewhere = await client.create(busybox("elsewhere", f"{namespace}-x"))
    async with cache_moving(client, elsewhere):
        events = [
            event
            async for event in watch_objects(
                client,
                Pod,
                selection=Selection(namespace=namespace),
                resource_version=pod.metadata.resourceVersion,
                timeout_seconds=4,
            )
        ]
        bookmarks = [event for event in events if event.type == "BOOKMARK"]
        assert bookmarks, f"the API server sent no bookmark within the watch: {[e.type for e in events]}"
        assert all(event.object is None and int(event.resource_version) > 0 for event in bookmarks)

        informer: Informer[Pod] = Informer(
            client=client, resource=Pod, selection=Selection(namespace=namespace), watch_timeout=3
        )
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 10)
            # Past two bookmarks and two watch ends, the informer still runs and still sees changes.
            await eventually(
                lambda: (informer.bookmarks >= 2 and informer.watch_restarts >= 2) or task.done(), timeout=30
            )
            assert not task.done(), task.exception()
            await client.patch(Pod, "bm", {"metadata": {"labels": {"seen": "yes"}}}, namespace=namespace)
            await eventually(
                lambda: (informer.store.get(f"{namespace}/bm").metadata.labels or {}).get("seen") == "yes"
            )
            assert informer.store.keys() == [f"{namespace}/bm"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


Widget = create_global_resource("informer-test.gpufrac.io", "v1", "Widget", "widgets")


async def test_a_resource_the_server_does_not_serve_is_empty_and_synced_until_it_is_served(
    client: AsyncClient,
) -> None:
    """A component that also watches an optional API (a newer Kubernetes group, a CRD not installed)
    must still start: the informer syncs empty, and picks the objects up once the API is served."""
    informer = Informer(client=client, resource=Widget, unserved_retry_s=0.2)
    recorder = Recorder()
    informer.add_handler(recorder)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        assert informer.unserved and len(informer.store) == 0
        await client.create(
            CustomResourceDefinition.from_dict(
                {
                    "metadata": {"name": "widgets.informer-test.gpufrac.io"},
                    "spec": {
                        "group": "informer-test.gpufrac.io",
                        "scope": "Cluster",
                        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                        "versions": [
                            {
                                "name": "v1",
                                "served": True,
                                "storage": True,
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
            )
        )
        created = False
        for _ in range(300):  # until the new CRD is established
            with contextlib.suppress(Exception):
                await client.create(Widget.from_dict({"metadata": {"name": "w1"}}))
                created = True
                break
            await asyncio.sleep(0.1)
        assert created
        await eventually(lambda: ("add", "w1") in recorder.events, timeout=20)
        assert not informer.unserved
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await client.delete(CustomResourceDefinition, "widgets.informer-test.gpufrac.io")
