"""ttrpc (containerd/ttrpc, PROTOCOL.md), unary calls only: what NRI uses, on one logical connection.

A message is a 10-byte header -- data length (uint32), stream id (uint32), type (uint8), flags (uint8),
big-endian -- and the data. A client opens a stream with a ``Request`` message (odd stream ids, growing
by two; flags 0 = unary) whose data is a ``ttrpc.Request`` envelope (service, method, payload, timeout);
the server ends it with one ``Response`` message whose ``ttrpc.Response`` carries the reply payload or a
``google.rpc.Status`` error. NRI needs nothing else: no streaming, no data messages.

``TtrpcServer`` answers the runtime's calls to the plugin service; ``TtrpcClient`` makes the plugin's
calls to the runtime service. Both sit on a ``Mux`` connection: they get bytes through ``feed`` and
send whole messages through the mux, which frames them. Envelopes are the classes generated from
ttrpc's own request.proto (scripts/gen-nri-protos).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable
from enum import IntEnum

from gpufrac._generated.ttrpc import request_pb2
from gpufrac.node.nri.mux import Mux

log = logging.getLogger(__name__)

HEADER = struct.Struct(">IIBB")
MESSAGE_LENGTH_MAX = 4 << 20

TYPE_REQUEST = 0x1
TYPE_RESPONSE = 0x2
TYPE_DATA = 0x3


class Code(IntEnum):
    """The gRPC status codes ttrpc carries (google.golang.org/grpc/codes)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class TtrpcError(Exception):
    """An error status, raised by a handler to answer with it or received from the other end."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


#: A unary method: request payload bytes in, reply payload bytes out (or ``TtrpcError``).
Method = Callable[[bytes], Awaitable[bytes]]


def encode_message(stream_id: int, kind: int, data: bytes, flags: int = 0) -> bytes:
    if len(data) > MESSAGE_LENGTH_MAX:
        raise TtrpcError(Code.INTERNAL, f"ttrpc message of {len(data)} bytes exceeds 4 MiB")
    return HEADER.pack(len(data), stream_id, kind, flags) + data


class _Deframer:
    """Cuts a logical connection's byte stream into ttrpc messages."""

    def __init__(self, on_message: Callable[[int, int, int, bytes], None]) -> None:
        self._buffer = bytearray()
        self._on_message = on_message

    def feed(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= HEADER.size:
            length, stream_id, kind, flags = HEADER.unpack_from(buffer)
            if length > MESSAGE_LENGTH_MAX:  # ttrpc refuses these; buffering it would only grow memory
                raise TtrpcError(
                    Code.RESOURCE_EXHAUSTED, f"ttrpc message of {length} bytes exceeds {MESSAGE_LENGTH_MAX}"
                )
            end = HEADER.size + length
            if len(buffer) < end:
                return
            body = bytes(buffer[HEADER.size : end])
            del buffer[:end]
            self._on_message(stream_id, kind, flags, body)


class TtrpcServer:
    """Serves unary methods on one logical connection; each request runs in its own task."""

    def __init__(self, *, mux: Mux, conn_id: int, methods: dict[tuple[str, str], Method]) -> None:
        self._mux = mux
        self._conn_id = conn_id
        self._methods = methods
        self._tasks: set[asyncio.Task[None]] = set()
        self._deframer = _Deframer(self._on_message)
        mux.open(conn_id, self._deframer.feed)

    def _on_message(self, stream_id: int, kind: int, flags: int, body: bytes) -> None:
        if kind != TYPE_REQUEST:
            log.debug("ttrpc: ignoring message of type %d on stream %d", kind, stream_id)
            return
        task = asyncio.get_running_loop().create_task(self._serve(stream_id, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, stream_id: int, body: bytes) -> None:
        response = request_pb2.Response()
        try:
            request = request_pb2.Request.FromString(body)
            method = self._methods.get((request.service, request.method))
            if method is None:
                raise TtrpcError(Code.UNIMPLEMENTED, f"{request.service}.{request.method} is not implemented")
            response.payload = await method(request.payload)
        except TtrpcError as exc:
            response.status.code = int(exc.code)
            response.status.message = exc.message
        except Exception as exc:  # a bug must answer the runtime, not leave it waiting for its timeout
            log.exception("ttrpc: handler failed")
            response.status.code = int(Code.INTERNAL)
            response.status.message = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(ConnectionError):  # the session ended meanwhile: nobody to answer
            self._mux.send(
                self._conn_id, encode_message(stream_id, TYPE_RESPONSE, response.SerializeToString())
            )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class TtrpcClient:
    """Makes unary calls on one logical connection."""

    def __init__(self, *, mux: Mux, conn_id: int) -> None:
        self._mux = mux
        self._conn_id = conn_id
        self._next_stream = 1
        self._pending: dict[int, asyncio.Future[request_pb2.Response]] = {}
        self._deframer = _Deframer(self._on_message)
        mux.open(conn_id, self._deframer.feed)

    def _on_message(self, stream_id: int, kind: int, flags: int, body: bytes) -> None:
        future = self._pending.pop(stream_id, None)
        if future is None or future.done():
            return
        if kind != TYPE_RESPONSE:
            future.set_exception(TtrpcError(Code.INTERNAL, f"unexpected ttrpc message type {kind}"))
            return
        try:
            response = request_pb2.Response.FromString(body)
        except Exception as exc:  # the caller learns now; the reader ends the session (mux.MalformedData)
            future.set_exception(TtrpcError(Code.DATA_LOSS, f"undecodable ttrpc reply: {exc}"))
            raise
        future.set_result(response)

    async def call(self, *, service: str, method: str, payload: bytes, timeout_s: float) -> bytes:
        stream_id = self._next_stream
        self._next_stream += 2
        future: asyncio.Future[request_pb2.Response] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        request = request_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=int(timeout_s * 1e9)
        )
        try:
            self._mux.send(
                self._conn_id, encode_message(stream_id, TYPE_REQUEST, request.SerializeToString())
            )
            await self._mux.drain()
            response = await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(stream_id, None)
        if response.HasField("status") and response.status.code != Code.OK:
            code = response.status.code
            known = Code(code) if code in Code._value2member_map_ else Code.UNKNOWN
            raise TtrpcError(known, response.status.message)
        return response.payload

    def fail_pending(self, exc: BaseException) -> None:
        """Wake every waiting call with ``exc`` (the trunk is gone)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._pending.clear()
