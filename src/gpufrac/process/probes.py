"""/healthz, /readyz and /metrics over plain HTTP, on the service's own event loop.

Three GET endpoints do not justify a web framework. The server runs on the same loop as the scheduler,
which is the point of a liveness probe: if the loop is wedged, /healthz stops answering. Readiness is
"informers synced and, with leader election, either leading or a synced standby", so a standby counts
as ready (it serves metrics and takes over at once) while a replica still listing does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


class ProbeServer:
    def __init__(
        self, *, host: str, port: int, registry: CollectorRegistry, healthy: Check, ready: Check
    ) -> None:
        self._host = host
        self._port = port
        self._registry = registry
        self._healthy = healthy
        self._ready = ready
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path, _, query = path.partition("?")
            status, content_type, body = self._answer(method, path, parse_qs(query).get("name[]", []))
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, method: str, path: str, names: list[str]) -> tuple[str, str, bytes]:
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/metrics":
            # ?name[]=a&name[]=b: only those families, as Prometheus's own client serves them. The
            # per-GPU families of a large cluster take a good part of a second to format, on this loop.
            registry = self._registry.restricted_registry(names) if names else self._registry
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
        if path in ("/healthz", "/livez", "/readyz"):
            ok, detail = self._ready() if path == "/readyz" else self._healthy()
            status = "200 OK" if ok else "503 Service Unavailable"
            return status, "text/plain", f"{'ok' if ok else 'not ok'}: {detail}\n".encode()
        return "404 Not Found", "text/plain", b"not found\n"
