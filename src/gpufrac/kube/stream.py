"""List, watch and subresource requests that lightkube's public API does not make the way we need.

lightkube 1.0's ``AsyncClient.watch`` hides three things an informer must control: it does not ask for
bookmarks (``allowWatchBookmarks``), it retries on its own from a version it tracks internally, and it
turns a 410 into a silent restart that replays every object as ADDED. The informer needs the opposite:
one watch request per call, bookmarks so a quiet watch still advances its resourceVersion, and a 410
surfaced as ``Gone`` so it can relist and compute deletions. And ``create`` of a Binding decodes the
answer as a Binding, but the API answers a Status, so lightkube 1.0 raises after the pod was bound.
This module builds those requests with lightkube's request preparation and msgspec decoders (the fast
path the library chose), and is the only place in gpufrac that touches lightkube's non-public client,
so a lightkube upgrade is checked here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx2
import msgspec
from lightkube import ApiError, AsyncClient
from lightkube.core import decoders
from lightkube.core.generic_client import ALL_NS, GenericAsyncClient, json_encode
from lightkube.models.meta_v1 import DeleteOptions
from lightkube.types import PatchType

from gpufrac.kube import lean_http
from gpufrac.kube.errors import KubeError, from_status, translate

T = TypeVar("T")

ALL_NAMESPACES = ALL_NS


@dataclass(frozen=True, slots=True)
class Selection:
    """Which objects of a kind: a namespace (``ALL_NAMESPACES`` for all) and selector strings.

    Selectors are the API's own syntax (``a=b,c!=d``): several ``!=`` on one field, which a dict cannot
    express, is how a pod informer skips finished pods.
    """

    namespace: str | None = None
    labels: str | None = None
    fields: str | None = None


@dataclass(frozen=True, slots=True)
class WatchEvent(Generic[T]):
    """One watch event: ``type`` is ADDED, MODIFIED, DELETED or BOOKMARK.

    A BOOKMARK carries no object (``object`` is None): the API server sends a skeleton whose fields are
    null where the type requires them (a Pod bookmark has ``"spec":{"containers":null}``), so it is never
    decoded as the resource; only its resourceVersion is read.
    """

    type: str
    object: T | None
    resource_version: str


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str = ""


class _Bookmark(msgspec.Struct):
    metadata: _BookmarkMeta = msgspec.field(default_factory=_BookmarkMeta)


def decode_bookmark_version(raw: bytes) -> str:
    """The resourceVersion of a BOOKMARK event's object, ignoring everything else in it."""
    return msgspec.json.decode(raw, type=_Bookmark).metadata.resourceVersion


def _generic(client: AsyncClient) -> GenericAsyncClient:
    return client._client  # lightkube internals: see the module docstring


def _params(selection: Selection, **extra: Any) -> dict[str, Any]:
    return {"labelSelector": selection.labels, "fieldSelector": selection.fields, **extra}


async def list_objects(
    client: AsyncClient, resource: type[T], *, selection: Selection, chunk_size: int = 500
) -> tuple[list[T], str]:
    """Every selected object and the collection's resourceVersion (the point a watch resumes from)."""
    generic = _generic(client)
    request = generic.prepare_request(
        "list", res=resource, namespace=selection.namespace, params=_params(selection, limit=chunk_size)
    )
    items: list[T] = []
    version = ""
    more = True
    try:
        while more:
            response = await generic.send(generic.build_adapter_request(request))
            more, rv, chunk = generic.handle_response("list", response, request)
            version = rv or version
            items.extend(chunk)
    except ApiError as error:
        raise translate(error) from error
    except httpx2.HTTPStatusError as error:
        # An answer that is not a Status: an API group or CRD the server does not serve answers a plain
        # "404 page not found".
        raise from_status(code=error.response.status_code, reason="", message=str(error)) from error
    return items, version


async def post_subresource(client: AsyncClient, obj: object, *, name: str, namespace: str | None) -> None:
    """POST ``obj`` to its subresource of ``name`` (a Binding, an Eviction); the answer is not decoded.

    Sent by ``kube.lean_http`` (a scheduler makes one per pod, and httpx's per-request cost was most of
    the scheduler's CPU), through httpx where that path does not apply; the request is lightkube's
    either way. Watches below take the same path for the same reason.
    """
    await _post(client, obj, name=name, namespace=namespace)


async def create_object(client: AsyncClient, obj: object, *, namespace: str | None) -> None:
    """Create ``obj`` (named by the caller) without decoding the answer: the same lean path as a
    Binding, for writes made once per pod (the scheduler's ``Scheduled`` Events)."""
    await _post(client, obj, name=None, namespace=namespace)


async def _post(client: AsyncClient, obj: object, *, name: str | None, namespace: str | None) -> None:
    generic = _generic(client)
    request = generic.prepare_request("post", obj=obj, name=name, namespace=namespace)
    request.response_type = None
    poster = lean_http.for_client(client, config=generic.config, http=generic._client)
    if poster is not None:
        answer = await poster.post(request.url, json_encode(request.data), params=request.params)
        if answer.status >= 400:
            raise _answer_error(answer)
        return
    try:
        generic.handle_response("post", await generic.send(generic.build_adapter_request(request)), request)
    except ApiError as error:
        raise translate(error) from error


async def patch_object(
    client: AsyncClient,
    resource: type,
    *,
    name: str,
    namespace: str | None,
    patch: dict[str, Any],
    patch_type: PatchType = PatchType.MERGE,
) -> str:
    """PATCH ``name`` (or its subresource: ``resource`` says which) and answer the resourceVersion the
    patched object has; the object itself is not decoded. The lean path as a Binding's POST (a claim pod
    takes two such writes per claim, and through lightkube's httpx client they were most of the
    scheduler's CPU), through httpx where that path does not apply. Preconditions ride in the patch
    (``metadata.resourceVersion``: else ``Conflict``)."""
    generic = _generic(client)
    request = generic.prepare_request(
        "patch",
        res=resource,
        obj=patch,
        name=name,
        namespace=namespace,
        headers={"Content-Type": patch_type.value},
    )
    lean = lean_http.for_client(client, config=generic.config, http=generic._client)
    if lean is not None:
        answer = await lean.send(
            "PATCH",
            request.url,
            json_encode(request.data),
            params=request.params,
            content_type=patch_type.value,
        )
        if answer.status >= 400:
            raise _answer_error(answer)
        return decode_bookmark_version(answer.body)
    request.response_type = None
    response = await generic.send(generic.build_adapter_request(request))
    try:
        generic.handle_response("patch", response, request)
    except ApiError as error:
        raise translate(error) from error
    return decode_bookmark_version(response.content)


async def delete_object(
    client: AsyncClient, resource: type, *, name: str, namespace: str | None, options: DeleteOptions
) -> None:
    """DELETE ``name`` with ``options`` in the body, which lightkube's ``delete`` cannot send: a kubelet
    confirms a pod's deletion with a grace period of 0 and its ``uid`` as a precondition, so that a
    namesake created since is never the pod removed."""
    generic = _generic(client)
    request = generic.prepare_request("delete", res=resource, name=name, namespace=namespace)
    request.data = options
    request.response_type = None
    try:
        generic.handle_response("delete", await generic.send(generic.build_adapter_request(request)), request)
    except ApiError as error:
        raise translate(error) from error


async def watch_objects(
    client: AsyncClient,
    resource: type[T],
    *,
    selection: Selection,
    resource_version: str,
    timeout_seconds: int,
) -> AsyncIterator[WatchEvent[T]]:
    """Events after ``resource_version`` until the server ends the request (``timeout_seconds``).

    Raises ``Gone`` when the version is too old, whether the server says so with an HTTP 410 or with
    an ERROR event inside a 200 stream (the watch cache does the latter).
    """
    generic = _generic(client)
    request = generic.prepare_request(
        "list",
        res=resource,
        namespace=selection.namespace,
        watch=True,
        params=_params(
            selection,
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=timeout_seconds,
        ),
    )
    # The server closes the stream after timeout_seconds and sends a bookmark at least every minute;
    # a read that stays silent well past both means the connection is dead.
    read_timeout_s = timeout_seconds + 75.0
    lean = lean_http.for_client(client, config=generic.config, http=generic._client)
    if lean is not None:
        lines = lean.watch_lines(request.url, params=request.params, read_timeout_s=read_timeout_s)
        try:
            async for line in lines:
                if line:
                    yield _watch_event(line, resource)
        except lean_http.HttpStatusError as error:
            raise _answer_error(error.answer) from None
        finally:
            await lines.aclose()
        return
    request.timeout = httpx2.Timeout(10.0, read=read_timeout_s)
    response = await generic.send(generic.build_adapter_request(request), stream=True)
    try:
        if response.is_error:
            await response.aread()
            try:
                generic.raise_for_status(response)
            except ApiError as error:
                raise translate(error) from error
            except httpx2.HTTPStatusError as error:
                raise KubeError(str(error), code=response.status_code) from error
        async for line in response.aiter_lines():
            if line:
                yield _watch_event(line, resource)
    finally:
        await response.aclose()


def _answer_error(answer: lean_http.Answer) -> KubeError:
    """The typed error for an error answer of the lean path, from its ``Status`` when it has one."""
    status = answer.status_object()
    details = status.get("details")
    return from_status(
        code=status.get("code") or answer.status,
        reason=status.get("reason"),
        message=status.get("message") or answer.body[:200].decode("utf-8", "replace"),
        details=details if isinstance(details, dict) else None,
    )


def _watch_event(line: str | bytes, resource: type[T]) -> WatchEvent[T]:
    """One line of a watch stream; raises the typed error of an ERROR event (a 410 is ``Gone``)."""
    event = decoders.decode_watch_event(line)
    if event.type == "ERROR":
        status = decoders.decode_status(event.object)
        raise from_status(code=status.code, reason=status.reason, message=status.message)
    if event.type == "BOOKMARK":
        return WatchEvent(
            type="BOOKMARK", object=None, resource_version=decode_bookmark_version(event.object)
        )
    obj = decoders.decode_object(event.object, resource)
    return WatchEvent(type=event.type, object=obj, resource_version=obj.metadata.resourceVersion or "")
