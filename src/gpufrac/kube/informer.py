"""An informer: a local copy of a set of API objects, kept current by list + watch.

The same contract as client-go's: list once, then watch from the list's resourceVersion; bookmarks keep
the version fresh while nothing changes, so a reconnect resumes instead of relisting; a 410 Gone (the
version fell out of the server's window) relists and diffs the new list against the store, so objects
deleted while the watch was away still produce a delete. Transient errors (connection reset, 5xx)
re-watch from the last version after a backoff. An optional resync re-delivers every stored object as
an update, which is how a consumer retries work that depends on time rather than on a change.

A resource the API server does not serve (a list answered 404: an API group of a newer Kubernetes, a
CRD not installed) counts as synced and empty, with one warning, and is listed again every
``unserved_retry_s``; once served it behaves as any other. So a component that also watches an
optional API (the scheduler's DRA claims, PodGroups) starts on a cluster without it.

Handlers are synchronous on purpose: they run on the informer's task between two events and must only
update memory and enqueue work (the scheduler's handlers do). A handler that raises is logged and the
informer goes on; one bad object must not stop the watch for all others.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

import httpx2
from lightkube import AsyncClient

from gpufrac.kube.errors import Gone, KubeError, NotFound
from gpufrac.kube.stream import Selection, WatchEvent, list_objects, watch_objects

log = logging.getLogger(__name__)

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class EventHandler(Protocol[T_contra]):
    """What an informer calls for each change; called on the informer's task, must not block."""

    def on_add(self, obj: T_contra) -> None: ...

    def on_update(self, old: T_contra, new: T_contra) -> None: ...

    def on_delete(self, obj: T_contra) -> None: ...


def object_key(obj: object) -> str:
    """``namespace/name`` for namespaced objects, ``name`` for cluster-scoped ones."""
    meta = obj.metadata  # type: ignore[attr-defined]
    return f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name


class Store(Generic[T]):
    """The informer's objects by key; read it from handlers or after ``synced``, write it never."""

    def __init__(self) -> None:
        self._items: dict[str, T] = {}

    def get(self, key: str) -> T | None:
        return self._items.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def keys(self) -> list[str]:
        return list(self._items)


class Informer(Generic[T]):
    """Keeps ``store`` equal to the selected objects and tells ``handlers`` about every change.

    Run it as a task (``await informer.run()``); cancel the task to stop it. ``synced`` is set once the
    first list is in the store and its adds were delivered.
    """

    def __init__(
        self,
        *,
        client: AsyncClient,
        resource: type[T],
        selection: Selection = Selection(),
        resync_period: float | None = None,
        watch_timeout: int = 300,
        max_backoff: float = 30.0,
        unserved_retry_s: float = 60.0,
        name: str | None = None,
    ) -> None:
        self._client = client
        self._resource = resource
        self._selection = selection
        self._resync_period = resync_period
        self._watch_timeout = watch_timeout
        self._max_backoff = max_backoff
        self._unserved_retry_s = unserved_retry_s
        #: Whether the last list found the resource not served (404); see the module docstring.
        self.unserved = False
        self._handlers: list[EventHandler[T]] = []
        self._version = ""
        self._watch_task: asyncio.Task[None] | None = None
        self.name = name or resource.__name__
        self.store: Store[T] = Store()
        self.synced = asyncio.Event()
        self.relists = 0
        self.watch_restarts = 0
        #: BOOKMARK events received. The API server sends one (before a watch's deadline, and about
        #: every minute) only when its cache has moved past the version this watch stands at.
        self.bookmarks = 0

    def add_handler(self, handler: EventHandler[T]) -> None:
        self._handlers.append(handler)

    @property
    def resource_version(self) -> str:
        """The version the next watch resumes from."""
        return self._version

    def resume_from(self, resource_version: str) -> None:
        """End the current watch and resume from ``resource_version``.

        An operator's lever (and how the tests reproduce an expired version against a real server): a
        version older than the server's window comes back as 410 Gone and the informer relists.
        """
        self._version = resource_version
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def run(self) -> None:
        resync = asyncio.create_task(self._resync_loop(), name=f"{self.name}-resync")
        failures = 0
        need_list = True
        try:
            while True:
                try:
                    if need_list:
                        if not await self._relist():
                            await asyncio.sleep(self._unserved_retry_s)
                            continue
                        need_list = False
                    self._watch_task = asyncio.create_task(self._watch_once(), name=f"{self.name}-watch")
                    try:
                        await self._watch_task
                    except asyncio.CancelledError:
                        # resume_from() cancels only the watch; our own cancellation must propagate.
                        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                            raise
                    finally:
                        self._watch_task = None
                    failures = 0
                except Gone as error:
                    log.info("%s watch expired, relisting: %s", self.name, error.message)
                    need_list = True
                    self.relists += 1
                except (KubeError, httpx2.HTTPError, OSError) as error:
                    failures += 1
                    delay = min(self._max_backoff, 0.2 * 2 ** min(failures, 10)) * random.uniform(0.8, 1.2)
                    log.warning("%s watch failed (%s), retrying in %.1fs", self.name, error, delay)
                    await asyncio.sleep(delay)
        finally:
            # The resync loop reads the store; stop it before the informer is gone.
            resync.cancel()
            await asyncio.gather(resync, return_exceptions=True)

    async def _relist(self) -> bool:
        """List and diff against the store; False when the resource is not served (the store is then
        empty and synced)."""
        try:
            items, version = await list_objects(self._client, self._resource, selection=self._selection)
        except NotFound as error:
            if not self.unserved:
                log.warning(
                    "%s: the API server does not serve this resource (%s); treated as empty, listed again "
                    "every %.0fs",
                    self.name,
                    error.message,
                    self._unserved_retry_s,
                )
            self.unserved = True
            items, version = [], ""
        else:
            if self.unserved:
                log.info("%s: the API server serves this resource now", self.name)
            self.unserved = False
        fresh = {object_key(obj): obj for obj in items}
        old_items = self.store._items
        self.store._items = fresh
        for key, old in old_items.items():
            if key not in fresh:
                self._dispatch("on_delete", old)
        for key, obj in fresh.items():
            old = old_items.get(key)
            if old is None:
                self._dispatch("on_add", obj)
            elif old.metadata.resourceVersion != obj.metadata.resourceVersion:  # type: ignore[attr-defined]
                self._dispatch("on_update", old, obj)
        self._version = version
        self.synced.set()
        return not self.unserved

    async def _watch_once(self) -> None:
        events = watch_objects(
            self._client,
            self._resource,
            selection=self._selection,
            resource_version=self._version,
            timeout_seconds=self._watch_timeout,
        )
        async for event in events:
            self._apply(event)
        self.watch_restarts += 1

    def _apply(self, event: WatchEvent[T]) -> None:
        if event.resource_version:
            self._version = event.resource_version
        if event.type == "BOOKMARK":
            self.bookmarks += 1
            return
        items = self.store._items
        key = object_key(event.object)
        if event.type == "DELETED":
            old = items.pop(key, None)
            self._dispatch("on_delete", event.object if event.object is not None else old)
            return
        old = items.get(key)
        items[key] = event.object
        if old is None:
            self._dispatch("on_add", event.object)
        else:
            self._dispatch("on_update", old, event.object)

    def _dispatch(self, method: str, *args: T) -> None:
        for handler in self._handlers:
            try:
                getattr(handler, method)(*args)
            except Exception:
                log.exception("%s handler %s.%s failed", self.name, type(handler).__name__, method)

    async def _resync_loop(self) -> None:
        if not self._resync_period:
            return
        while True:
            await asyncio.sleep(self._resync_period)
            if not self.synced.is_set():
                continue
            for obj in self.store:
                self._dispatch("on_update", obj, obj)
