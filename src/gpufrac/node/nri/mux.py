"""NRI's connection multiplexer (containerd/nri pkg/net/multiplex), the plugin's end, on asyncio.

One unix socket (the trunk) carries two logical connections: ``PLUGIN_SERVICE_CONN`` (1), on which the
runtime calls the plugin, and ``RUNTIME_SERVICE_CONN`` (2), on which the plugin calls the runtime. Each
frame on the trunk is an 8-byte header -- connection id and payload length, both big-endian uint32 --
followed by the payload. Opening a connection sends nothing: both ends simply use the ids.

Writing follows the Go side's framing on purpose. The runtime's ttrpc channel reads each logical
connection through a 4 KiB ``bufio.Reader``, and a Go mux connection refuses a ``Read`` whose buffer is
smaller than the pending frame (ENOMEM, which kills the trunk). A Go plugin never trips that because its
ttrpc writer is a 4 KiB ``bufio.Writer``: a message goes out as one frame of at most 4096 bytes, then the
rest of the message as one more frame, which the reader reads straight into the message buffer. ``send``
frames every ttrpc message exactly so. Reading needs no such care: frames are appended to a byte stream
per connection, so frame boundaries never matter here.

Whatever the runtime sends cannot take the agent down: a frame longer than the Go side ever writes, or
bytes a receiver cannot make sense of (a broken ttrpc header, an undecodable reply), end the session
with ``MalformedData`` -- a ``TrunkClosed`` -- so the plugin logs it, drops the socket and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2

HEADER = struct.Struct(">II")
#: The Go reader's buffer size (bufio default); no frame may be larger unless it ends a message.
FIRST_FRAME_MAX = 4096
#: ttrpc's largest message (10-byte header + 4 MiB); the Go mux splits anything longer.
MAX_PAYLOAD = 10 + (4 << 20)


class TrunkClosed(ConnectionError):
    """The runtime closed the socket (or it broke): every logical connection is gone."""


class MalformedData(TrunkClosed):
    """The runtime sent what NRI's protocol cannot carry; the session is over, as if the socket broke."""


class Mux:
    """Frames out and in over one trunk; ``run`` feeds each connection's bytes to its receiver."""

    def __init__(self, *, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._receivers: dict[int, Callable[[bytes], None]] = {}

    def open(self, conn_id: int, receiver: Callable[[bytes], None]) -> None:
        """Deliver the bytes arriving on ``conn_id`` to ``receiver`` (called in arrival order)."""
        if conn_id == 0:
            raise ValueError("connection id 0 is reserved by NRI's multiplexer")
        self._receivers[conn_id] = receiver

    def send(self, conn_id: int, message: bytes) -> None:
        """Queue one complete ttrpc message on ``conn_id``, framed as a Go plugin frames it."""
        if self._writer.is_closing():
            raise TrunkClosed("the NRI socket is closed")
        view = memoryview(message)
        head, rest = view[:FIRST_FRAME_MAX], view[FIRST_FRAME_MAX:]
        self._writer.write(HEADER.pack(conn_id, len(head)) + head)
        while rest:
            chunk, rest = rest[:MAX_PAYLOAD], rest[MAX_PAYLOAD:]
            self._writer.write(HEADER.pack(conn_id, len(chunk)) + chunk)

    async def drain(self) -> None:
        await self._writer.drain()

    async def run(self) -> None:
        """Read frames until the trunk closes; raises ``TrunkClosed`` then."""
        reader = self._reader
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                conn_id, length = HEADER.unpack(header)
                if length > MAX_PAYLOAD:
                    raise MalformedData(
                        f"NRI frame of {length} bytes on connection {conn_id} exceeds {MAX_PAYLOAD}"
                    )
                payload = await reader.readexactly(length) if length else b""
                receiver = self._receivers.get(conn_id)
                if receiver is None:  # frames for a connection nobody opened are dropped, as in Go
                    continue
                try:
                    receiver(payload)
                except Exception as exc:
                    raise MalformedData(
                        f"malformed data on NRI connection {conn_id}: {type(exc).__name__}: {exc}"
                    ) from exc
        except MalformedData:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise TrunkClosed(f"the NRI socket closed ({exc.__class__.__name__})") from exc

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):  # already broken: closing is all we asked
            await self._writer.wait_closed()
