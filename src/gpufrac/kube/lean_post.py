"""POSTs of small JSON bodies on kept-alive HTTP/1.1 connections: the scheduler's one write per pod.

Why: a burst binds thousands of pods, one Binding each. Through httpx a POST cost about 1 ms of CPU (its
URL parsing, an auth flow per request, a connection pool that probes the socket of every idle connection
on each request, h11's state machine): 45 % of the scheduler's CPU per pod under
``bench/scheduler_e2e.py --profile``, on a machine where the scheduler shares the CPU with the API
server it writes to. Here a request is one write of prepared bytes on a connection taken from a free
list, and the answer a status line, headers and a ``Content-Length`` (or chunked) body.

Same endpoint, TLS context and credentials as the lightkube client it is made from (``for_client``):
the cluster's CA, the client certificate, and the ``Authorization`` header of lightkube's own auth
object (static token, token file, exec plugin, basic). That header is computed once and again after a
401 (the token file is re-read, the exec plugin re-run) before the request is retried once, which is
what those auth flows do per request in httpx. Anything this path does not speak (plain HTTP to a
proxy, an ``https_proxy`` in the environment) falls back to the httpx client (``for_client`` answers
None).

A failure after the request may have been written is raised as ``ConnectionError`` (or
``TimeoutError``); it is never retried here, because a POST may have taken effect: the binder reads the
pod to know, as it does for httpx's errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
import weakref
from collections import deque
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


class LeanPoster:
    """POSTs to one API server over up to ``max_connections`` kept-alive HTTPS connections."""

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

    async def post(self, path: str, body: bytes, *, params: dict[str, str] | None = None) -> Answer:
        """POST ``body`` (JSON) to ``path`` (relative to the server's URL); the answer, any status."""
        target = self._prefix + "/" + quote(path.lstrip("/"), safe="/:@")
        if params:
            target += "?" + urlencode(params)
        answer = await self._send(target, body)
        if answer.status == 401 and self._auth is not None:
            await self._authorize(refresh=answer)
            answer = await self._send(target, body)
        return answer

    async def close(self) -> None:
        while self._idle:
            self._idle.popleft().close()

    # -- internals ----------------------------------------------------------------------------------

    async def _send(self, target: str, body: bytes) -> Answer:
        if not self._authorized:
            await self._authorize(refresh=None)
        head = [
            f"POST {target} HTTP/1.1",
            f"Host: {self._host_header}",
            "Accept: application/json",
            "Content-Type: application/json",
            f"User-Agent: {self._user_agent}",
            f"Content-Length: {len(body)}",
        ]
        if self._authorization:
            head.append(f"Authorization: {self._authorization}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
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
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        raise ConnectionError("the API server closed the connection before answering") from error
    except asyncio.LimitOverrunError as error:
        raise ConnectionError("the API server's answer has an oversized header") from error
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    keep_alive = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _read_chunked(reader)
        elif "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:  # delimited by the end of the connection
            body = await reader.read()
            keep_alive = False
    except asyncio.IncompleteReadError as error:
        raise ConnectionError("the API server closed the connection in the middle of an answer") from error
    return status, keep_alive, body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)


_POSTERS: weakref.WeakKeyDictionary[AsyncClient, LeanPoster | None] = weakref.WeakKeyDictionary()


def for_client(client: AsyncClient, *, config: Any, http: httpx2.AsyncClient) -> LeanPoster | None:
    """The poster that speaks for ``client`` (one per client), or None where this path does not apply.

    ``config`` is lightkube's resolved ``SingleConfig`` and ``http`` its httpx client (both handed in by
    ``kube.stream``, the one module that reads lightkube's internals).
    """
    if client in _POSTERS:
        return _POSTERS[client]
    poster = _make(config, http)
    _POSTERS[client] = poster
    return poster


def _make(config: Any, http: httpx2.AsyncClient) -> LeanPoster | None:
    url = http.base_url
    if url.scheme not in ("https", "http") or not url.host:
        return None
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None  # httpx honours the proxy; this path does not speak CONNECT
    if url.scheme == "https":
        context = verify_cluster(config.cluster, config.user, config.abs_file)
        context.set_alpn_protocols(["http/1.1"])
    else:
        context = None
    timeout = http.timeout
    return LeanPoster(
        host=url.host,
        port=url.port or (443 if url.scheme == "https" else 80),
        path_prefix=url.raw_path.decode("ascii").split("?", 1)[0],
        ssl_context=context,
        auth=user_auth(config.user),
        timeout_s=max(t for t in (timeout.connect, timeout.read, timeout.write, 10.0) if t is not None),
        user_agent=http.headers.get("User-Agent", "gpufrac"),
    )
