"""410 Gone for real: a control plane that compacts etcd every second and serves watches from etcd.

This is how a long-disconnected watcher meets "too old resource version": the informer must relist,
deliver what changed while it was away (deletions included), and go on watching; the scheduler must go
on binding.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Namespace
from sched_harness import add_nodes, gpu_pod, new_pool, running, wait_bound

from gpufrac.kube.errors import Gone
from gpufrac.kube.informer import Informer
from gpufrac.kube.stream import Selection, watch_objects
from gpufrac.local.controlplane import ControlPlane

pytestmark = pytest.mark.kube


@pytest.fixture(scope="module")
def compacting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(
        data_dir=tmp_path_factory.mktemp("gone") / "cp",
        apiserver_args=["--etcd-compaction-interval=1s", "--watch-cache=false"],
    )
    with cp:
        yield cp


@pytest.fixture
async def client(compacting: ControlPlane) -> AsyncIterator[AsyncClient]:
    c = compacting.async_client()
    try:
        yield c
    finally:
        await c.close()


async def eventually(check: Callable[[], bool], *, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def compacted(client: AsyncClient, namespace: str, version: str) -> None:
    """Wait until ``version`` is gone from etcd (two or three compaction intervals)."""
    for _ in range(60):
        try:
            async for _ in watch_objects(
                client,
                ConfigMap,
                selection=Selection(namespace=namespace),
                resource_version=version,
                timeout_seconds=1,
            ):
                break
        except Gone as gone:
            assert gone.code == 410
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"version {version} never compacted")


async def test_the_informer_relists_after_410_and_catches_up_including_deletions(client: AsyncClient) -> None:
    ns = "gone-informer"
    await client.create(Namespace(metadata=ObjectMeta(name=ns)))
    for name in ("a", "b"):
        await client.create(ConfigMap(metadata=ObjectMeta(name=name, namespace=ns)))
    informer: Informer[ConfigMap] = Informer(
        client=client, resource=ConfigMap, selection=Selection(namespace=ns)
    )
    deleted: list[str] = []

    class OnDelete:
        def on_add(self, obj: ConfigMap) -> None: ...

        def on_update(self, old: ConfigMap, new: ConfigMap) -> None: ...

        def on_delete(self, obj: ConfigMap) -> None:
            deleted.append(obj.metadata.name)

    informer.add_handler(OnDelete())
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        away_since = informer.resource_version
        # The informer is "disconnected" from away_since; meanwhile the world changes and etcd compacts.
        informer.resume_from(str(10**12))  # park the watch on a future version until we rewind it
        await client.delete(ConfigMap, "a", namespace=ns)
        await client.create(ConfigMap(metadata=ObjectMeta(name="c", namespace=ns)))
        await compacted(client, ns, away_since)
        informer.resume_from(away_since)
        await eventually(lambda: informer.relists >= 1)
        await eventually(lambda: sorted(informer.store.keys()) == [f"{ns}/b", f"{ns}/c"])
        assert deleted == ["a"]
        await client.create(ConfigMap(metadata=ObjectMeta(name="d", namespace=ns)))
        await eventually(lambda: f"{ns}/d" in informer.store)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_scheduler_keeps_binding_after_its_watch_is_gone(
    client: AsyncClient, tmp_path: Path
) -> None:
    pool = new_pool()
    await client.create(Namespace(metadata=ObjectMeta(name=pool.namespace)))
    await add_nodes(client, pool, count=1)
    async with running(client, pool.config()) as service:
        await client.create(gpu_pod(pool, "before", {"gpu-fraction": "0.25"}))
        await wait_bound(client, pool.namespace, 1, timeout=20)
        away_since = service.pods.resource_version
        await client.create(ConfigMap(metadata=ObjectMeta(name="tick", namespace=pool.namespace)))
        await compacted(client, pool.namespace, away_since)
        service.pods.resume_from(away_since)
        await client.create(gpu_pod(pool, "after", {"gpu-fraction": "0.25"}))
        await wait_bound(client, pool.namespace, 2, timeout=30)
        assert service.pods.relists >= 1
