"""The webhook's copy of the cluster's ``Queue`` objects and Namespace labels, for judging pods' queues.

The webhook answers in request threads and must not call the API server per request (a burst of pod
creates would become a burst of GETs, each adding to the create's latency). So two informers, Queues
and Namespaces, keep a copy current from a thread of their own with its own event loop; a request
reads the copy. Until both have listed once the book raises ``QueueBookNotReady`` and a pod that
would be judged is refused (fail closed). A cluster without the Queue CRD has no Queue objects: every
queue is then open and nothing is refused for its queue.

What the copy may lag (a watch's latency, about a second): a Namespace created and used at once may be
judged before its labels are seen (a queue that admits it by selector then refuses the pod, and the
retry passes); a binding narrowed a moment ago may admit one more pod, which the scheduler, reading
its own copy, refuses to place.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import AsyncClient
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Namespace

from gpufrac.admission.review import QueueBookNotReady
from gpufrac.contract import keys
from gpufrac.kube.informer import Informer
from gpufrac.placement.model import Queue
from gpufrac.placement.queue_access import queue_from_spec

log = logging.getLogger(__name__)

GpufracQueue = create_global_resource(keys.API_GROUP, keys.QUEUE_API_VERSION, "Queue", keys.QUEUE_PLURAL)


class KubeQueueBook:
    """``QueueBook`` over the API server (module docstring). ``client`` builds the async client in the
    book's own loop (a client belongs to the loop it was made in)."""

    def __init__(self, *, client: Callable[[], AsyncClient]) -> None:
        self._make_client = client
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name="queue-book", daemon=True)
        self._queues: Informer[Any] | None = None
        self._namespaces: Informer[Namespace] | None = None

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Whether both informers listed within ``timeout`` seconds."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout=10)

    def queues(self) -> Mapping[str, Queue]:
        if not self._ready.is_set() or self._queues is None:
            raise QueueBookNotReady
        found: dict[str, Queue] = {}
        for obj in self._queues.store:
            try:
                found[obj.metadata.name] = queue_from_spec(obj.metadata.name, obj.spec)
            except ValueError as error:  # stored without the CRD's validation: as the scheduler, ignored
                log.warning("ignoring a queue: %s", error)
        return found

    def namespace_labels(self, namespace: str) -> Mapping[str, str] | None:
        if not self._ready.is_set() or self._namespaces is None:
            raise QueueBookNotReady
        found = self._namespaces.store.get(namespace)
        return None if found is None else dict(found.metadata.labels or {})

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run())
        except asyncio.CancelledError:
            pass
        finally:
            loop.close()

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        client = self._make_client()
        self._queues = Informer(client=client, resource=GpufracQueue, name="queues")
        self._namespaces = Informer(client=client, resource=Namespace, name="namespaces")
        tasks = [
            asyncio.create_task(i.run(), name=f"book-{i.name}") for i in (self._queues, self._namespaces)
        ]
        try:
            await self._queues.synced.wait()
            await self._namespaces.synced.wait()
            self._ready.set()
            log.info("queue book ready", extra={"queues": len(self._queues.store)})
            await asyncio.gather(*tasks)
        finally:
            # Cancel the informers before the client they use is closed.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()
