"""The requests a scheduler makes per pod, on plain HTTP/1.1: a POST (the Binding), a PATCH (a DRA
claim's finalizer and allocation) and a watch.

Why: a burst binds thousands of pods, one Binding each, and reads each pod twice from a watch. Through
httpx a POST cost about 1 ms of CPU (its URL parsing, an auth flow per request, a connection pool that
probes the socket of every idle connection on each request, h11's state machine), 45 % of the
scheduler's CPU per pod under ``bench/scheduler_e2e.py --profile``, and reading watch lines through
httpx and h11 another 30 % once the POSTs were lean, on a machine where the scheduler shares the CPU
with the API server it talks to. The claim writes of a DRA claim pod (two merge PATCHes through
lightkube) were 52 % of its CPU under ``bench/kube_scheduler_e2e.py --scenarios claims --profile``. Here
a POST or PATCH is one write of prepared bytes on a kept-alive connection taken from a free list, its
answer a status line, headers and a ``Content-Length`` (or chunked) body; a watch is its own connection
whose chunked body is split into lines.

Same endpoint, TLS context and credentials as the lightkube client it is made from (``for_client``):
the cluster's CA, the client certificate, and the ``Authorization`` header of lightkube's own auth
object (static token, token file, exec plugin, basic). That header is computed once and again after a
401 (the token file is re-read, the exec plugin re-run) before the request is retried once, which is
what those auth flows do per request in httpx. Anything this path does not speak (a proxy in the
environment, a transport of the caller's own such as one that adds impersonation headers) falls back to
the httpx client (``for_client`` answers None).

A failure after the request may have been written is raised as ``ConnectionError`` (or
``TimeoutError``); it is never retried here, because a POST or PATCH may have taken effect: the binder
reads the pod to know, as it does for httpx's errors, and the claim writer's next try reads the claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx2
import msgspec
from lightkube import AsyncClient
from lightkube.config.client_adapter import user_auth, verify_cluster

#: An idle connection older than this is closed rather than reused: the API server (or a load
#: balancer in front of it) may have dropped it, and a POST on a dead connection cannot be retried.
IDLE_REUSE_S = 30.0
#: Connections kept open at most; more requests than this wait for a free one.
MAX_CONNECTIONS = 64
_MAX_HEADER_BYTES = 64 * 1024
#: A path that needs no quoting: unreserved characters and the separators an API path uses.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9._~/:@-]*").fullmatch
#: The headers that frame an answer's body and say whether its connection stays open.
_FRAMING_HEADERS = re.compile(
    r"^(content-length|transfer-encoding|connection)[ \t]*:(.*)$", re.IGNORECASE | re.MULTILINE
).findall
#: Encoded query strings kept (a watch's carries its resourceVersion, so they are many over time).
_QUERIES_KEPT = 64
#: How much a watch reads at once, and the longest chunk size line it waits for.
_WATCH_READ_BYTES = 65536
_MAX_CHUNK_LINE = 1024
_PROXY_VARIABLES = ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")


@dataclass(frozen=True, slots=True)
class Answer:
    """The API server's answer: HTTP status and the body (a ``Status`` object for subresource POSTs)."""

    status: int
    body: bytes

    def status_object(self) -> dict[str, Any]:
        """The decoded ``Status`` (empty when the body is not one)."""
        try:
            decoded = msgspec.json.decode(self.body) if self.body else {}
        except msgspec.DecodeError:
            return {}
        return decoded if isinstance(decoded, dict) else {}


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()

    def reusable(self, now: float) -> bool:
        alive = not self.reader.at_eof() and not self.writer.is_closing()
        return alive and now - self.idle_since < IDLE_REUSE_S

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class HttpStatusError(Exception):
    """A watch request answered with an error status; ``answer`` holds the server's ``Status``."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(f"HTTP {answer.status}")
        self.answer = answer


class LeanHttp:
    """POSTs and PATCHes to one API server over up to ``max_connections`` kept-alive HTTPS connections,
    and watches."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        path_prefix: str,
        ssl_context: ssl.SSLContext | None,
        auth: httpx2.Auth | None,
        timeout_s: float,
        user_agent: str = "gpufrac",
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._host = host
        self._port = port
        self._prefix = path_prefix.rstrip("/")
        self._ssl = ssl_context
        self._auth = auth
        self._timeout_s = timeout_s
        self._host_header = host if ":" not in host else f"[{host}]"
        if (ssl_context is not None and port != 443) or (ssl_context is None and port != 80):
            self._host_header += f":{port}"
        self._user_agent = user_agent
        self._idle: deque[_Connection] = deque()
        self._slots = asyncio.Semaphore(max_connections)
        self._authorization: str | None = None
        self._authorized = False
        self._auth_lock = asyncio.Lock()
        self._queries: dict[tuple[tuple[str, Any], ...], str] = {}

    async def post(self, path: str, body: bytes, *, params: dict[str, str] | None = None) -> Answer:
        """POST ``body`` (JSON) to ``path`` (relative to the server's URL); the answer, any status."""
        return await self.send("POST", path, body, params=params)

    async def send(
        self,
        method: str,
        path: str,
        body: bytes,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Answer:
        """Send ``body`` (of ``content_type``: a PATCH names its patch type) with ``method`` to ``path``;
        the answer, any status. A 401 is retried once with the credentials read again (nothing was
        applied)."""
        target = self._target(path, params)
        answer = await self._send(method, target, body, content_type)
        if answer.status == 401 and self._auth is not None:
            await self._authorize(refresh=answer)
            answer = await self._send(method, target, body, content_type)
        return answer

    async def close(self) -> None:
        while self._idle:
            self._idle.popleft().close()

    # -- internals ----------------------------------------------------------------------------------

    async def watch_lines(
        self, path: str, *, params: dict[str, str], read_timeout_s: float
    ) -> AsyncIterator[bytes]:
        """GET ``path`` on a connection of its own and yield the lines of its body until the server ends
        it; raises ``HttpStatusError`` for an error status (after a 401, the credentials are read again
        for the next request) and ``TimeoutError`` when no byte arrives for ``read_timeout_s``."""
        target = self._target(path, params)
        if not self._authorized:
            await self._authorize(refresh=None)
        connection = await self._open()
        try:
            async with asyncio.timeout(self._timeout_s):
                connection.writer.write(self._head("GET", target, body=None))
                await connection.writer.drain()
                status, headers = await _read_head(connection.reader)
            if status != 200:
                async with asyncio.timeout(self._timeout_s):
                    body = await _read_body(connection.reader, status, headers)
                answer = Answer(status, body)
                if status == 401 and self._auth is not None:
                    await self._authorize(refresh=answer)
                raise HttpStatusError(answer)
            pending = b""
            pieces = (
                _chunked_arrivals(connection.reader, read_timeout_s=read_timeout_s)
                if headers.get("transfer-encoding", "").lower() == "chunked"
                else _body_pieces(connection.reader, headers, read_timeout_s=read_timeout_s)
            )
            async for data in pieces:
                pending += data
                if b"\n" not in data:
                    continue
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line
            if pending:
                yield pending
        finally:
            connection.close()

    def _target(self, path: str, params: dict[str, str] | None) -> str:
        path = path.lstrip("/")
        # An API path is names and slashes: quoted only when it has a character that needs it.
        target = self._prefix + "/" + (path if _PLAIN_PATH(path) else quote(path, safe="/:@"))
        if not params:
            return target
        # Every POST carries the same few parameters (the client's fieldManager): encoded once.
        try:
            query = self._queries.get(shape := tuple(params.items()))
        except TypeError:  # an unhashable value
            return target + "?" + urlencode(params)
        if query is None:
            query = self._queries[shape] = urlencode(params)
            if len(self._queries) > _QUERIES_KEPT:
                self._queries.clear()
        return target + "?" + query

    def _head(
        self, method: str, target: str, *, body: bytes | None, content_type: str = "application/json"
    ) -> bytes:
        head = [
            f"{method} {target} HTTP/1.1",
            f"Host: {self._host_header}",
            "Accept: application/json",
            f"User-Agent: {self._user_agent}",
        ]
        if body is not None:
            head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        if self._authorization:
            head.append(f"Authorization: {self._authorization}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")

    async def _send(self, method: str, target: str, body: bytes, content_type: str) -> Answer:
        if not self._authorized:
            await self._authorize(refresh=None)
        request = self._head(method, target, body=body, content_type=content_type)
        async with self._slots:
            connection = await self._connection()
            try:
                async with asyncio.timeout(self._timeout_s):
                    connection.writer.write(request)
                    await connection.writer.drain()
                    status, keep_alive, payload = await _read_answer(connection.reader)
            except BaseException:
                connection.close()
                raise
            if keep_alive:
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()
            return Answer(status, payload)

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()  # the most recently used: the likeliest to be alive
            if connection.reusable(now):
                return connection
            connection.close()
        return await self._open()

    async def _open(self) -> _Connection:
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await asyncio.open_connection(
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                    limit=_MAX_HEADER_BYTES,
                )
        except TimeoutError:
            raise TimeoutError(f"connecting to {self._host}:{self._port} timed out") from None
        return _Connection(reader, writer)

    async def _authorize(self, *, refresh: Answer | None) -> None:
        """The Authorization header from lightkube's auth object, as its flow sets it on a request."""
        async with self._auth_lock:
            if self._auth is None:
                self._authorized = True
                return
            request = httpx2.Request("POST", f"https://{self._host_header}/")
            flow = self._auth.async_auth_flow(request)
            request = await flow.__anext__()
            if refresh is not None:
                with contextlib.suppress(StopAsyncIteration):
                    request = await flow.asend(httpx2.Response(refresh.status, request=request))
            with contextlib.suppress(Exception):
                await flow.aclose()
            self._authorization = request.headers.get("Authorization")
            self._authorized = True


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    """(status, whether the connection may be reused, body) of one HTTP/1.1 response."""
    status, headers = await _read_head(reader)
    keep_alive = headers.get("connection", "").lower() != "close" and headers[":version"] == "HTTP/1.1"
    if "content-length" not in headers and "transfer-encoding" not in headers and status not in (204, 304):
        keep_alive = False  # the body ends with the connection
    return status, keep_alive, await _read_body(reader, status, headers)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        raise ConnectionError("the API server closed the connection before answering") from error
    except asyncio.LimitOverrunError as error:
        raise ConnectionError("the API server's answer has an oversized header") from error
    text = head.decode("latin-1")
    first = text[: text.find("\r\n")]
    parts = first.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP/1.1 answer: {first[:80]!r}")
    headers: dict[str, str] = {":version": parts[0]}
    # Only the headers that frame the body and the connection are read (the API server sends about ten).
    for name, value in _FRAMING_HEADERS(text):
        headers[name.lower()] = value.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, status: int, headers: dict[str, str]) -> bytes:
    if status in (204, 304) or 100 <= status < 200:
        return b""
    length = headers.get("content-length")
    if length is not None and "transfer-encoding" not in headers:
        try:
            return await reader.readexactly(int(length))
        except asyncio.IncompleteReadError as error:
            raise ConnectionError(
                "the API server closed the connection in the middle of an answer"
            ) from error
        except ValueError as error:
            raise ConnectionError(f"malformed Content-Length: {length[:40]!r}") from error
    return b"".join([piece async for piece in _body_pieces(reader, headers, read_timeout_s=None)])


async def _chunked_arrivals(reader: asyncio.StreamReader, *, read_timeout_s: float) -> AsyncIterator[bytes]:
    """A chunked body (a watch's) as it arrives: the data of every whole chunk that one read of the
    socket brought, joined. One read and one ``read_timeout_s`` per arrival instead of three reads and
    a timeout per chunk: in a burst one read brings many watch events (each is one chunk)."""
    buffer = b""
    try:
        while True:
            async with asyncio.timeout(read_timeout_s):
                data = await reader.read(_WATCH_READ_BYTES)
            if not data:
                raise ConnectionError("the API server closed the connection in the middle of an answer")
            buffer = buffer + data if buffer else data
            pieces: list[bytes] = []
            start = 0
            while True:
                line_end = buffer.find(b"\r\n", start)
                if line_end < 0:
                    if len(buffer) - start > _MAX_CHUNK_LINE:
                        raise ValueError("a chunk size line without an end")
                    break
                size = int(buffer[start:line_end].split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:  # the last chunk: what follows (trailers) is not read, the watch ends
                    if pieces:
                        yield b"".join(pieces)
                    return
                data_end = line_end + 2 + size
                if len(buffer) < data_end + 2:
                    break  # the rest of this chunk is still on its way
                pieces.append(buffer[line_end + 2 : data_end])
                start = data_end + 2
            buffer = buffer[start:]
            if pieces:
                yield b"".join(pieces)
    except ValueError as error:  # a chunk size that is not hex
        raise ConnectionError(f"malformed chunked answer: {error}") from error


async def _body_pieces(
    reader: asyncio.StreamReader, headers: dict[str, str], *, read_timeout_s: float | None
) -> AsyncIterator[bytes]:
    """The body as it arrives: chunk by chunk, or all of a ``Content-Length``, or up to the end."""
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                if read_timeout_s is None:  # an answer: the request's own timeout covers it
                    piece = await _chunk(reader)
                else:
                    async with asyncio.timeout(read_timeout_s):
                        piece = await _chunk(reader)
                if piece is None:
                    return
                yield piece
        elif "content-length" in headers:
            async with asyncio.timeout(read_timeout_s):
                piece = await reader.readexactly(int(headers["content-length"]))
            yield piece
        else:
            while True:
                async with asyncio.timeout(read_timeout_s):
                    piece = await reader.read(65536)
                if not piece:
                    return
                yield piece
    except asyncio.IncompleteReadError as error:
        raise ConnectionError("the API server closed the connection in the middle of an answer") from error
    except (ValueError, asyncio.LimitOverrunError) as error:  # a chunk size that is not hex, or endless
        raise ConnectionError(f"malformed chunked answer: {error}") from error


async def _chunk(reader: asyncio.StreamReader) -> bytes | None:
    """The data of the next chunk of a chunked body; None after the last one (its trailers read)."""
    size_line = await reader.readuntil(b"\r\n")
    size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
    if size == 0:
        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, blank line
            pass
        return None
    piece = await reader.readexactly(size)
    await reader.readexactly(2)
    return piece


_BY_CLIENT: weakref.WeakKeyDictionary[AsyncClient, LeanHttp | None] = weakref.WeakKeyDictionary()


def for_client(client: AsyncClient, *, config: Any, http: httpx2.AsyncClient) -> LeanHttp | None:
    """The poster that speaks for ``client`` (one per client), or None where this path does not apply.

    ``config`` is lightkube's resolved ``SingleConfig`` and ``http`` its httpx client (both handed in by
    ``kube.stream``, the one module that reads lightkube's internals).
    """
    if client in _BY_CLIENT:
        return _BY_CLIENT[client]
    poster = _make(config, http)
    _BY_CLIENT[client] = poster
    return poster


def _make(config: Any, http: httpx2.AsyncClient) -> LeanHttp | None:
    url = http.base_url
    if url.scheme not in ("https", "http") or not url.host:
        return None
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None  # httpx honours the proxy; this path does not speak CONNECT
    if type(http._transport) is not httpx2.AsyncHTTPTransport or http._mounts:
        # A transport of the caller's own (one that impersonates another user, say) decides what goes
        # out: this path would bypass it and speak as the client's own identity.
        return None
    if url.scheme == "https":
        context = verify_cluster(config.cluster, config.user, config.abs_file)
        context.set_alpn_protocols(["http/1.1"])
    else:
        context = None
    timeout = http.timeout
    return LeanHttp(
        host=url.host,
        port=url.port or (443 if url.scheme == "https" else 80),
        path_prefix=url.raw_path.decode("ascii").split("?", 1)[0],
        ssl_context=context,
        auth=user_auth(config.user),
        timeout_s=max(t for t in (timeout.connect, timeout.read, timeout.write, 10.0) if t is not None),
        user_agent=http.headers.get("User-Agent", "gpufrac"),
    )
