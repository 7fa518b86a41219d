"""The lean HTTP path (``gpufrac.kube.lean_http``) against servers that misbehave the ways real ones do.

A local HTTP/1.1 server stands in for what the API server, a load balancer or a token rotation can do
to a kept-alive connection or a watch; the Binding semantics on the real API server are in
test_writes.py and the watch's (bookmarks, 410) in test_informer.py, which go through this path too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lightkube.config.client_adapter import BearerTokenFileAuth

from gpufrac.kube.lean_http import HttpStatusError, LeanHttp


@dataclass
class Server:
    """Answers each request with ``answer(request_head)``: the raw bytes to write, and whether to close."""

    answer: Callable[[str], tuple[bytes, bool]]
    connections: int = 0
    heads: list[str] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length")
                )
                await reader.readexactly(length)
                self.heads.append(head)
                raw, close = self.answer(head)
                writer.write(raw)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def created(body: bytes = b'{"kind":"Status","status":"Success","code":201}') -> bytes:
    return b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Server], asyncio.Future[LeanHttp]]]:
    servers: list[asyncio.Server] = []

    async def start(server: Server, **poster: object) -> LeanHttp:
        listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        servers.append(listening)
        port = listening.sockets[0].getsockname()[1]
        return LeanHttp(
            host="127.0.0.1", port=port, path_prefix="", ssl_context=None, timeout_s=5.0, **poster
        )  # type: ignore[arg-type]

    yield start  # type: ignore[misc]
    for listening in servers:
        listening.close()


async def test_posts_reuse_one_kept_alive_connection(serve) -> None:
    server = Server(lambda head: (created(), False))
    poster = await serve(server, auth=None)
    for i in range(5):
        answer = await poster.post(
            f"api/v1/namespaces/ns/pods/p{i}/binding", b"{}", params={"fieldManager": "x"}
        )
        assert answer.status == 201
        assert answer.status_object()["status"] == "Success"
    assert server.connections == 1
    assert server.heads[0].startswith("POST /api/v1/namespaces/ns/pods/p0/binding?fieldManager=x HTTP/1.1")


async def test_each_request_carries_its_own_path_and_parameters(serve) -> None:
    """Paths and query strings are built per request (plain paths as they are, others quoted, the same
    parameters encoded once): a request never goes out with another's."""
    server = Server(lambda head: (created(), False))
    poster = await serve(server, auth=None)
    asked = [
        ("api/v1/namespaces/ns/pods/p0/binding", {"fieldManager": "x"}),
        ("api/v1/namespaces/ns/pods/p1/binding", {"fieldManager": "y", "dryRun": "All"}),
        ("api/v1/namespaces/ns/pods/p 2/binding", {"fieldManager": "x"}),
        ("api/v1/namespaces/ns/events", None),
        ("api/v1/namespaces/ns/pods/p0/binding", {"fieldManager": "x"}),
    ]
    for path, params in asked:
        await poster.post(path, b"{}", params=params)
    assert [head.split(" ")[1] for head in server.heads] == [
        "/api/v1/namespaces/ns/pods/p0/binding?fieldManager=x",
        "/api/v1/namespaces/ns/pods/p1/binding?fieldManager=y&dryRun=All",
        "/api/v1/namespaces/ns/pods/p%202/binding?fieldManager=x",
        "/api/v1/namespaces/ns/events",
        "/api/v1/namespaces/ns/pods/p0/binding?fieldManager=x",
    ]


async def test_a_connection_the_server_closed_while_idle_is_not_reused(serve) -> None:
    server = Server(lambda head: (created(), False))
    poster = await serve(server, auth=None)
    assert (await poster.post("a", b"{}")).status == 201
    server.writers[0].close()  # the server (or a load balancer) drops the idle connection
    await asyncio.sleep(0)
    for _ in range(100):  # until the client's event loop has read the end of the stream
        if poster._idle and poster._idle[0].reader.at_eof():
            break
        await asyncio.sleep(0.01)
    assert (await poster.post("b", b"{}")).status == 201
    assert server.connections == 2


async def test_connection_close_and_chunked_answers(serve) -> None:
    chunked = (
        b"HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b'8\r\n{"code":\r\n5\r\n 409}\r\n0\r\n\r\n'
    )
    server = Server(lambda head: (chunked, True))
    poster = await serve(server, auth=None)
    first = await poster.post("a", b"{}")
    assert (first.status, first.status_object()) == (409, {"code": 409})
    await poster.post("b", b"{}")
    assert server.connections == 2  # "Connection: close" is honoured


async def test_an_answer_cut_off_is_a_connection_error_not_a_retry(serve) -> None:
    server = Server(lambda head: (b"HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{", True))
    poster = await serve(server, auth=None)
    with pytest.raises(ConnectionError):
        await poster.post("a", b"{}")
    assert len(server.heads) == 1  # a POST may have taken effect: the caller finds out, not a blind retry


async def test_a_rotated_token_is_read_again_after_a_401(serve, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old\n")
    accepted = {"old"}

    def answer(head: str) -> tuple[bytes, bool]:
        if any(f"Authorization: Bearer {t}\r\n" in head for t in accepted):
            return created(), False
        return b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\n{}", False

    server = Server(answer)
    poster = await serve(server, auth=BearerTokenFileAuth(str(token)))
    assert (await poster.post("a", b"{}")).status == 201
    token.write_text("new\n")  # the kubelet rotates the projected token; the old one expires
    accepted = {"new"}
    assert (await poster.post("b", b"{}")).status == 201
    assert ["Bearer old" in h for h in server.heads] == [True, True, False]
    assert (await poster.post("c", b"{}")).status == 201  # the new header is kept, no 401 first
    assert len(server.heads) == 4


async def start_raw(handler) -> tuple[asyncio.Server, int]:
    listening = await asyncio.start_server(handler, "127.0.0.1", 0)
    return listening, listening.sockets[0].getsockname()[1]


def lean(port: int) -> LeanHttp:
    return LeanHttp(host="127.0.0.1", port=port, path_prefix="", ssl_context=None, auth=None, timeout_s=5.0)


async def test_a_watch_yields_whole_lines_whatever_the_chunking() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b'{"type":"ADD', b'ED"}\n{"type":"BOOKMARK"}\n', b'{"type":"MODIFIED"}\n'):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        writer.close()

    listening, port = await start_raw(handler)
    try:
        lines = [
            line
            async for line in lean(port).watch_lines(
                "api/v1/pods", params={"watch": "true"}, read_timeout_s=5
            )
        ]
    finally:
        listening.close()
    assert lines == [b'{"type":"ADDED"}', b'{"type":"BOOKMARK"}', b'{"type":"MODIFIED"}']


async def test_a_watch_reads_chunks_split_anywhere_and_many_in_one_write() -> None:
    """The framing itself split across the socket's reads (inside a size line, inside a chunk's data,
    between its data and its CRLF), several chunks in one write, then a stream cut in a chunk."""
    events = [b'{"type":"ADDED","n":%d}\n' % i for i in range(40)]
    stream = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    cuts = [1, 2, 7, 30, 31, 33, 400, len(stream) - 2]  # mid size line, mid data, before a CRLF, ...

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        last = 0
        for cut in [*cuts, len(stream)]:
            writer.write(stream[last:cut])
            await writer.drain()
            await asyncio.sleep(0.01)
            last = cut
        writer.write(b"20\r\n" + b'{"type":"DELETED"')  # a chunk that never ends
        await writer.drain()
        writer.close()

    listening, port = await start_raw(handler)
    lines: list[bytes] = []
    try:
        with pytest.raises(ConnectionError):
            async for line in lean(port).watch_lines("api/v1/pods", params={}, read_timeout_s=5):
                lines.append(line)
    finally:
        listening.close()
    assert lines == [e.rstrip(b"\n") for e in events]


async def test_a_watch_refused_carries_the_servers_status() -> None:
    body = b'{"kind":"Status","code":410,"reason":"Expired","message":"too old resource version"}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 410 Gone\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    listening, port = await start_raw(handler)
    try:
        with pytest.raises(HttpStatusError) as refused:
            async for _ in lean(port).watch_lines("api/v1/pods", params={}, read_timeout_s=5):
                pass
    finally:
        listening.close()
    assert refused.value.answer.status == 410
    assert refused.value.answer.status_object()["message"] == "too old resource version"


async def test_a_silent_watch_times_out_instead_of_hanging() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await release.wait()  # a dead connection: nothing more arrives
        writer.close()

    listening, port = await start_raw(handler)
    try:
        with pytest.raises(TimeoutError):
            async for _ in lean(port).watch_lines("api/v1/pods", params={}, read_timeout_s=0.2):
                pass
    finally:
        release.set()
        listening.close()
