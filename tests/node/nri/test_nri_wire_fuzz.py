"""Whatever a runtime sends on the NRI socket, the plugin stays up: it drops the connection and reconnects.

Property-based: hypothesis writes malformed frames at the plugin -- truncated mux headers, oversized
lengths, ttrpc messages of every type on both logical connections with random or broken protobuf, and
plain random bytes. Two levels:

- the readers alone (``Mux.run`` feeding the plugin's real ttrpc server and client): they end only with
  ``TrunkClosed``, never another exception, and never buffer more than one ttrpc message's limit;
- the whole plugin against a socket that plays a runtime: after each malformed session the plugin is
  still running and connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac._generated.ttrpc import request_pb2
from gpufrac.node.nri.mux import MAX_PAYLOAD, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux, TrunkClosed
from gpufrac.node.nri.plugin import NriPlugin
from gpufrac.node.nri.ttrpc import HEADER as TTRPC_HEADER
from gpufrac.node.nri.ttrpc import TYPE_DATA, TYPE_REQUEST, TYPE_RESPONSE, TtrpcClient, TtrpcServer

MUX_HEADER = struct.Struct(">II")


def mux_frame(conn_id: int, payload: bytes, *, length: int | None = None) -> bytes:
    return MUX_HEADER.pack(conn_id, len(payload) if length is None else length) + payload


def ttrpc_message(stream_id: int, kind: int, body: bytes, *, length: int | None = None) -> bytes:
    return TTRPC_HEADER.pack(len(body) if length is None else length, stream_id, kind, 0) + body


def _response(payload: bytes, code: int) -> bytes:
    response = request_pb2.Response(payload=payload)
    response.status.code = code
    return response.SerializeToString()


conn_ids = st.sampled_from([PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, 0, 3]) | st.integers(0, 2**32 - 1)
stream_ids = st.sampled_from([1, 3, 5]) | st.integers(0, 2**32 - 1)
kinds = st.sampled_from([TYPE_REQUEST, TYPE_RESPONSE, TYPE_DATA]) | st.integers(0, 255)
bodies = (
    st.binary(max_size=64)
    | st.builds(_response, st.binary(max_size=32), st.integers(0, 2**31 - 1))
    | st.builds(
        lambda b: request_pb2.Request(service="nri.pkg.api.v1alpha1.Plugin", method=b).SerializeToString(),
        st.sampled_from(["Configure", "Synchronize", "CreateContainer", "Nope"]),
    )
)
ttrpc_messages = st.builds(
    ttrpc_message,
    stream_ids,
    kinds,
    bodies,
    length=st.none() | st.sampled_from([0, 9, 4 << 20, (4 << 20) + 1, 2**32 - 1]),
)
frames = st.builds(
    mux_frame,
    conn_ids,
    ttrpc_messages | st.binary(max_size=64),
    length=st.none() | st.sampled_from([0, 3, MAX_PAYLOAD, MAX_PAYLOAD + 1, 2**32 - 1]),
)
#: A reply to the plugin's first call (RegisterPlugin: stream 1 on the runtime connection) whose body is
#: random bytes -- mostly an undecodable ttrpc Response.
replies = st.builds(
    lambda body: mux_frame(RUNTIME_SERVICE_CONN, ttrpc_message(1, TYPE_RESPONSE, body)),
    st.binary(min_size=1, max_size=24),
)
#: A session's worth of bytes from a broken or hostile runtime.
streams = st.lists(replies | frames | st.binary(min_size=1, max_size=16), min_size=1, max_size=6).map(
    b"".join
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def _read_all(data: bytes) -> BaseException | None:
    """Feed ``data`` then EOF to the plugin's readers; what ``Mux.run`` ended with."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    left, right = socket.socketpair()
    try:
        _, writer = await asyncio.open_connection(sock=left)

        async def echo(payload: bytes) -> bytes:
            return payload

        mux = Mux(reader=reader, writer=writer)
        server = TtrpcServer(mux=mux, conn_id=PLUGIN_SERVICE_CONN, methods={("s", "m"): echo})
        client = TtrpcClient(mux=mux, conn_id=RUNTIME_SERVICE_CONN)
        call = asyncio.create_task(client.call(service="s", method="m", payload=b"", timeout_s=30))
        await asyncio.sleep(0)  # the call has sent its request and waits for stream 1's reply
        try:
            await mux.run()
        except BaseException as exc:  # the property is about which exceptions
            ended: BaseException | None = exc
        else:
            ended = None
        client.fail_pending(TrunkClosed("test over"))
        with contextlib.suppress(Exception):
            await call
        await server.close()
        await mux.close()
        return ended
    finally:
        right.close()


@FUZZ
@given(data=streams)
def test_the_readers_end_a_malformed_session_only_with_trunk_closed(data: bytes) -> None:
    ended = asyncio.run(_read_all(data))
    assert isinstance(ended, TrunkClosed), f"{type(ended).__name__}: {ended}"


def test_an_undecodable_reply_ends_the_session_with_trunk_closed() -> None:
    # The runtime's reply to RegisterPlugin (stream 1 on the runtime connection) with a broken protobuf:
    # before, the DecodeError escaped the reader and ended the plugin's run() -- the agent exited.
    garbage = mux_frame(RUNTIME_SERVICE_CONN, ttrpc_message(1, TYPE_RESPONSE, b"\x0a\xff\xff\xff"))
    ended = asyncio.run(_read_all(garbage))
    assert isinstance(ended, TrunkClosed) and "malformed data on NRI connection 2" in str(ended)


def test_an_oversized_frame_is_refused_without_waiting_for_it() -> None:
    ended = asyncio.run(_read_all(mux_frame(PLUGIN_SERVICE_CONN, b"", length=2**32 - 1) + b"x" * 100))
    assert isinstance(ended, TrunkClosed) and "exceeds" in str(ended)


# -- the whole plugin against a runtime that sends garbage ----------------------------------------------


class GarbageRuntime:
    """A unix socket that answers every connection with the next chunk of bytes, then hangs up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sessions = 0
        self.payload = b""
        self.served: list[bytes] = []
        self._accepted = asyncio.Condition()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def _serve(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        payload = self.payload
        writer.write(payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        async with self._accepted:
            self.sessions += 1
            self.served.append(payload)
            self._accepted.notify_all()

    async def wait_served(self, payload: bytes, *, after: int) -> None:
        """Until a connection accepted after the ``after``-th one was served ``payload``."""
        async with self._accepted:
            await asyncio.wait_for(self._accepted.wait_for(lambda: payload in self.served[after:]), 10)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _NoHandler:
    """The plugin never gets as far as calling its handler here; every method says so if it does."""

    def events(self):  # type: ignore[no-untyped-def]
        return ()

    async def configure(self, **_kw):  # type: ignore[no-untyped-def]
        return None

    async def synchronize(self, **_kw):  # type: ignore[no-untyped-def]
        return None

    async def create_container(self, **_kw):  # type: ignore[no-untyped-def]
        return None

    async def stop_container(self, **_kw):  # type: ignore[no-untyped-def]
        return None

    async def remove_container(self, **_kw):  # type: ignore[no-untyped-def]
        return None

    async def shutdown(self) -> None:
        return None


@pytest.fixture
async def garbage_runtime() -> AsyncIterator[tuple[GarbageRuntime, NriPlugin, asyncio.Task[None]]]:
    root = Path(tempfile.mkdtemp(prefix="nrifz", dir="/tmp"))
    runtime = GarbageRuntime(root / "nri.sock")
    await runtime.start()
    plugin = NriPlugin(
        handler=_NoHandler(),
        socket_path=str(runtime.path),
        registration_timeout_s=2,
        backoff_initial_s=0.001,
        backoff_max_s=0.002,
    )
    task = asyncio.create_task(plugin.run())
    yield runtime, plugin, task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await runtime.stop()
    with contextlib.suppress(OSError):
        runtime.path.unlink()
        root.rmdir()


async def test_the_plugin_outlives_every_malformed_session_and_reconnects(
    garbage_runtime: tuple[GarbageRuntime, NriPlugin, asyncio.Task[None]],
) -> None:
    runtime, plugin, task = garbage_runtime
    sessions: list[bytes] = []

    @FUZZ
    @given(data=streams)
    def collect(data: bytes) -> None:
        sessions.append(data)

    collect()  # hypothesis draws the sessions; the loop below plays them against one running plugin
    sessions.insert(0, mux_frame(RUNTIME_SERVICE_CONN, ttrpc_message(1, TYPE_RESPONSE, b"\x0a\xff\xff\xff")))
    for data in sessions:
        seen = runtime.sessions
        runtime.payload = data
        await runtime.wait_served(data, after=seen)  # the plugin connected (again) and got these bytes
        assert not task.done(), task.exception() if task.done() else None
    runtime.payload = b""
    await runtime.wait_served(b"", after=runtime.sessions)  # and it still connects after the last one
    # (Random bytes sometimes form a valid, empty RegisterPlugin reply; the plugin registers then, and
    # the session ends like any other when the runtime hangs up.)
    assert not task.done() and plugin.last_error is not None
