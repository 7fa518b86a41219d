"""A fault-injecting proxy in front of the REAL kube-apiserver of the test environment.

The suite's API server never answers 429 or 5xx, never loses an answer and never cuts a watch, so the
scheduler's paths for those answers would only ever run in a user's cluster. This proxy plays them: it
listens on 127.0.0.1 (plain HTTP, no credentials: loopback only), forwards every request to the real API
server as the admin (TLS with the admin's client certificate), and answers chosen requests itself.

Choosing. A ``Rule`` matches requests (``binds``, ``evictions``, ``watches``: one predicate
on the parsed request) and holds a list of ``Fault``; the rule's first matching request gets the first
fault, the next one the second, and so on (``None`` in the list lets that request through); once the
list is used up the rule lets everything through. So every test plays a known, finite script.

Faults:

- ``answer(code, retry_after=...)``: the proxy answers with a ``Status`` of that code and the API's
  reason for it (429 ``TooManyRequests`` with ``Retry-After`` and ``details.retryAfterSeconds``, as the
  API server's priority-and-fairness filter does; 500, 503, 504), and the API server never sees the
  request.
- ``lose_answer(reset=True)``: the request IS forwarded and its answer read in full (the API server
  applied it), then the client's connection is reset (or closed) without a byte of the answer: a write
  whose outcome the client cannot know. ``cut_watches="pods"`` cuts the open pod watches at the same
  moment (so the watch does not tell either), ``refuse_reads=N`` answers 503 to the next N reads of the
  same object (a read-back that fails too).
- ``cut_watch(after_lines=N)``: the watch is forwarded and its first ``N`` events relayed, then the
  stream is cut (the connection reset in the middle of the chunked body).

Bounded: the proxy stops by itself after ``lifetime_s``, answers 503 to every request beyond
``max_requests`` (and counts them, so a test can assert it never got there), and ``close()`` ends every
connection it holds. ``injected`` records each fault played, in order, so a test proves that its faults
actually happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx2
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

_REASONS = {
    429: "TooManyRequests",
    500: "InternalError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_PHRASES = {
    200: "OK",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}
#: Not forwarded: the proxy speaks to the API server as the admin (its client certificate).
_DROPPED = _HOP_BY_HOP | {"authorization"}
_MAX_HEAD = 64 * 1024


@dataclass(frozen=True)
class Request:
    """A request as the proxy parsed it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    @property
    def watch(self) -> bool:
        return self.query.get("watch", [""])[0] in ("true", "1")

    def __str__(self) -> str:
        return f"{self.method} {self.path}" + ("?watch" if self.watch else "")


@dataclass(frozen=True)
class Fault:
    """What the proxy does to one request (see the module docstring)."""

    kind: str  # "answer", "lose_answer", "cut_watch"
    code: int = 0
    retry_after: int | None = None
    reset: bool = True
    after_lines: int = 0
    #: lose_answer: also cut every watch of this resource open at that moment (``pods``)
    cut_watches: str | None = None
    #: lose_answer: answer 503 to this many of the next reads of the same object (a binder's read-back)
    refuse_reads: int = 0

    def __str__(self) -> str:
        if self.kind == "answer":
            return f"{self.code}" + (
                f" Retry-After {self.retry_after}" if self.retry_after is not None else ""
            )
        if self.kind == "cut_watch":
            return f"cut after {self.after_lines} events"
        return "answer lost" + (" (reset)" if self.reset else " (closed)")


def answer(code: int, *, retry_after: int | None = None) -> Fault:
    return Fault("answer", code=code, retry_after=retry_after)


def lose_answer(*, reset: bool = True, cut_watches: str | None = None, refuse_reads: int = 0) -> Fault:
    return Fault("lose_answer", reset=reset, cut_watches=cut_watches, refuse_reads=refuse_reads)


def cut_watch(*, after_lines: int) -> Fault:
    return Fault("cut_watch", after_lines=after_lines)


# -- which requests --------------------------------------------------------------------------------------


def _subresource(request: Request, sub: str) -> bool:
    parts = request.path.rstrip("/").split("/")
    return request.method == "POST" and len(parts) >= 3 and parts[-1] == sub and parts[-3] == "pods"


def binds(request: Request) -> bool:
    """POST .../pods/<name>/binding."""
    return _subresource(request, "binding")


def evictions(request: Request) -> bool:
    """POST .../pods/<name>/eviction, dry runs excluded (they change nothing)."""
    return _subresource(request, "eviction") and b'"dryRun"' not in request.body


def watches(resource: str, *, fields: str | None = None) -> Callable[[Request], bool]:
    """GET of a ``resource`` collection (``pods``, ``nodes``) with ``watch=true`` (and, with ``fields``,
    a field selector that contains it: one informer of several on a resource)."""

    def match(request: Request) -> bool:
        if fields is not None and fields not in request.query.get("fieldSelector", [""])[0]:
            return False
        return request.method == "GET" and request.watch and request.path.rstrip("/").endswith("/" + resource)

    return match


@dataclass
class Rule:
    """``faults[i]`` for the i-th request ``match`` accepts (None: let it through); then none."""

    name: str
    match: Callable[[Request], bool]
    faults: Sequence[Fault | None]
    hits: int = 0

    def take(self, request: Request) -> Fault | None:
        if not self.match(request):
            return None
        index = self.hits
        self.hits += 1
        return self.faults[index] if index < len(self.faults) else None

    @property
    def used_up(self) -> bool:
        return self.hits >= len(self.faults)


@dataclass(frozen=True)
class Injected:
    rule: str
    request: str
    fault: Fault


@dataclass
class FaultProxy:
    """See the module docstring. ``upstream`` is the API server's URL (loopback), ``ca_file`` its CA and
    ``cert``/``key`` the admin's client certificate."""

    upstream: str
    ca_file: Path
    cert: Path
    key: Path
    rules: list[Rule] = field(default_factory=list)
    max_requests: int = 5000
    lifetime_s: float = 120.0
    requests: int = 0
    refused_over_budget: int = 0
    #: Watches cut by ``cut_watch`` (a fault is recorded when chosen; this counts the cuts made).
    watches_cut: int = 0
    injected: list[Injected] = field(default_factory=list)

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        if not ipaddress.ip_address(parts.hostname or "").is_loopback:
            raise ValueError(f"the proxy fronts a loopback API server only, not {self.upstream}")
        self._host = parts.hostname or ""
        self._port = parts.port or 443
        self._ssl = ssl.create_default_context(cafile=str(self.ca_file))
        self._ssl.load_cert_chain(certfile=str(self.cert), keyfile=str(self.key))
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        #: Open watch streams: the client's writer -> the path it watches and the upstream's writer.
        self._watching: dict[asyncio.StreamWriter, tuple[str, asyncio.StreamWriter]] = {}
        self._stopper: asyncio.TimerHandle | None = None
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    def for_controlplane(cls, controlplane: object, **options: object) -> FaultProxy:
        """A proxy in front of a ``gpufrac.local.controlplane.ControlPlane`` (its PKI holds the admin)."""
        ca = Path(controlplane.ca_file)  # type: ignore[attr-defined]
        return cls(
            upstream=controlplane.server,  # type: ignore[attr-defined]
            ca_file=ca,
            cert=ca.parent / "admin.crt",
            key=ca.parent / "admin.key",
            **options,  # type: ignore[arg-type]
        )

    @property
    def url(self) -> str:
        assert self._server is not None, "proxy not started"
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def faults_of(self, rule: str) -> list[Injected]:
        return [i for i in self.injected if i.rule == rule]

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, host="127.0.0.1", port=0, limit=_MAX_HEAD)
        # Stops by itself: a test that forgets to close it does not leave a proxy behind.
        self._stopper = asyncio.get_running_loop().call_later(self.lifetime_s, self._stop_by_itself)
        return self

    def _stop_by_itself(self) -> None:
        self._closing = asyncio.ensure_future(self.close())  # kept: a task nobody holds may vanish

    async def close(self) -> None:
        if self._stopper is not None:
            self._stopper.cancel()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            _abort(writer)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- serving ---------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                self.requests += 1
                if self.requests > self.max_requests:
                    self.refused_over_budget += 1
                    await _write_status(writer, 503, "the fault proxy's request budget is spent")
                    continue
                fault, rule = self._choose(request)
                if fault is not None:
                    self.injected.append(Injected(rule, str(request), fault))
                if fault is not None and fault.kind == "answer":
                    await _write_status(
                        writer,
                        fault.code,
                        f"injected by the fault proxy ({rule})",
                        retry_after=fault.retry_after,
                    )
                    continue
                if not await self._forward(request, writer, fault):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            return
        except asyncio.CancelledError:
            return  # close() ends the connections it holds; asyncio would log a cancelled callback
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    def _choose(self, request: Request) -> tuple[Fault | None, str]:
        for rule in self.rules:
            fault = rule.take(request)
            if fault is not None:
                return fault, rule.name
        return None, ""

    async def _forward(self, request: Request, writer: asyncio.StreamWriter, fault: Fault | None) -> bool:
        """Forward ``request`` and relay the answer; False when the client's connection is done."""
        up_reader, up_writer = await asyncio.open_connection(
            self._host, self._port, ssl=self._ssl, server_hostname=self._host, limit=_MAX_HEAD
        )
        try:
            target = request.path + ("?" + _query(request.query) if request.query else "")
            head = [
                f"{request.method} {target} HTTP/1.1",
                f"Host: {self._host}:{self._port}",
                "Connection: close",
            ]
            head += [f"{k}: {v}" for k, v in request.headers.items() if k not in _DROPPED]
            if request.body or request.method in ("POST", "PUT", "PATCH"):
                head.append(f"Content-Length: {len(request.body)}")
            up_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + request.body)
            await up_writer.drain()
            status_line, headers = await _read_head(up_reader)
            if fault is not None and fault.kind == "lose_answer":
                async for _ in _body(up_reader, headers):  # the API server finished the write
                    pass
                self._after_lost(request, fault)
                _abort(writer) if fault.reset else writer.close()
                return False
            if request.watch:
                self._watching[writer] = (request.path.rstrip("/"), up_writer)
            out = [status_line] + [f"{k}: {v}" for k, v in headers.items() if k not in _HOP_BY_HOP]
            if request.method == "HEAD" or status_line.split(" ")[1] in ("204", "304"):
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))  # no body, by definition
                await writer.drain()
                return True
            out.append("Transfer-Encoding: chunked")  # the answer is relayed as it arrives
            writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
            lines = 0
            async for piece in _body(up_reader, headers):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                lines += piece.count(b"\n")
                if fault is not None and fault.kind == "cut_watch" and lines >= fault.after_lines:
                    self.watches_cut += 1
                    _abort(writer)  # mid-body: no terminating chunk
                    return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            self._watching.pop(writer, None)
            _abort(up_writer)

    def _after_lost(self, request: Request, fault: Fault) -> None:
        if fault.cut_watches:
            for watcher, (path, upstream) in list(self._watching.items()):
                if path.endswith("/" + fault.cut_watches):
                    _abort(watcher)
                    _abort(upstream)
        if fault.refuse_reads:
            obj = request.path.rstrip("/").rsplit("/", 1)[0]  # .../pods/<name>/binding -> .../pods/<name>

            def same_object(r: Request) -> bool:
                return r.method == "GET" and not r.watch and r.path.rstrip("/") == obj

            self.rules.insert(0, Rule(f"read-back of {obj}", same_object, [answer(503)] * fault.refuse_reads))


def _query(query: dict[str, list[str]]) -> str:
    return urlencode([(k, v) for k, values in query.items() for v in values])


def _abort(writer: asyncio.StreamWriter) -> None:
    """Reset the connection (RST, not FIN): SO_LINGER 0, then close without flushing."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(Exception):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return
            piece = await reader.readexactly(size)
            await reader.readexactly(2)
            yield piece
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length:
            yield await reader.readexactly(length)
    else:
        while piece := await reader.read(65536):
            yield piece


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        request_line, headers = await _read_head(reader)
    except asyncio.IncompleteReadError:
        return None  # the client closed its connection between requests
    method, target, _ = request_line.split(" ", 2)
    body = b"".join([piece async for piece in _body(reader, headers)]) if _has_body(headers) else b""
    parts = urlsplit(target)
    return Request(method, parts.path, parse_qs(parts.query, keep_blank_values=True), headers, body)


def _has_body(headers: dict[str, str]) -> bool:
    return "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"


async def _write_status(
    writer: asyncio.StreamWriter, code: int, message: str, *, retry_after: int | None = None
) -> None:
    status: dict[str, object] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "InternalError"),
        "code": code,
    }
    if retry_after is not None:
        status["details"] = {"retryAfterSeconds": retry_after}
    body = json.dumps(status).encode()
    head = [f"HTTP/1.1 {code} {_PHRASES.get(code, 'Error')}", "Content-Type: application/json"]
    head.append(f"Content-Length: {len(body)}")
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()


def proxied_client(proxy: FaultProxy, *, timeout: float = 10.0) -> AsyncClient:
    """An asynchronous lightkube client whose every request goes through ``proxy`` (as the admin)."""
    return AsyncClient(
        config=KubeConfig.from_one(cluster=Cluster(server=proxy.url), user=User()),  # no credentials
        field_manager="gpufrac-fault-test",
        timeout=httpx2.Timeout(timeout),
        trust_env=False,
    )
