"""The webhook's HTTPS server: ``/validate``, ``/mutate``, ``/healthz``, ``/readyz``.

The standard library's threading HTTP server is enough: an admission request is a small JSON document
answered from memory in microseconds, and the API server keeps a handful of connections. Two details
make it robust: the TLS handshake runs in the connection's own thread (a slow or broken client cannot
stall the accept loop), and every connection has a read timeout. A request that is not a readable
AdmissionReview (bad length, bad JSON, nesting too deep, a field of the wrong type) answers 400 with what
is wrong; property tests post arbitrary documents and check that nothing else comes back. Any other
failure inside a handler answers 500 rather than dropping the connection, so the API server reports a
clear error (and, with failurePolicy Fail, rejects only the GPU pod at hand, never ordinary pods: the
configuration's matchConditions keep those away).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpufrac.admission.review import AdmissionPolicy, MalformedReview, mutate_review, validate_review

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # an AdmissionReview holds the old and new object; etcd caps each near 1.5 MiB
CONNECTION_TIMEOUT_S = 30.0
_MAX_ERROR_CHARS = 500

Handler = Callable[[Mapping[str, Any], AdmissionPolicy], dict[str, Any]]
ROUTES: dict[str, Handler] = {"/validate": validate_review, "/mutate": mutate_review}


class _TlsHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], context: ssl.SSLContext, policy: AdmissionPolicy) -> None:
        self.context = context
        self.policy = policy
        self.ready = threading.Event()
        self.stopping = False
        self._connections: set[ssl.SSLSocket] = set()
        self._lock = threading.Lock()
        super().__init__(address, _RequestHandler)

    def track(self, connection: ssl.SSLSocket, *, open_: bool) -> None:
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(connection)

    def end_connections(self) -> None:
        """End every kept-alive connection: its reader sees end-of-file, a request in flight still
        gets its answer (only the read side is shut; ``SSLSocket.shutdown`` would drop the TLS state,
        so the plain socket's method is called)."""
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                socket.socket.shutdown(connection, socket.SHUT_RD)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = self.socket.accept()
        sock.settimeout(CONNECTION_TIMEOUT_S)
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        if self.stopping:
            log.debug("connection from %s ended while stopping", client_address, exc_info=True)
        else:
            log.warning("connection from %s failed", client_address, exc_info=True)


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _TlsHttpServer

    def setup(self) -> None:
        assert isinstance(self.request, ssl.SSLSocket)
        self.server.track(self.request, open_=True)
        self.request.do_handshake()
        super().setup()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.server.stopping:  # read after stop() began: refuse rather than answer from a stopped server
            self.close_connection = True
            self.send_error(503, "stopping")
            return False
        return True

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.request, open_=False)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, b"ok", "text/plain")
        elif path == "/readyz":
            ready = self.server.ready.is_set()
            self._send(200 if ready else 503, b"ok" if ready else b"not ready", "text/plain")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        handler = ROUTES.get(self.path.split("?", 1)[0])
        if handler is None:
            self._send(404, b"not found", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length <= 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # a body of unknown length may follow: do not read it as a request
            self._send(400 if length <= 0 else 413, b"bad body length", "text/plain")
            return
        try:
            review = json.loads(self.rfile.read(length))
        except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
            message = f"bad AdmissionReview: {type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]
            self._send(400, message.encode(), "text/plain")
            return
        try:
            answer = handler(review, self.server.policy)
        except MalformedReview as error:
            self._send(400, f"bad AdmissionReview: {error}".encode(), "text/plain")
            return
        except Exception:  # answer 500 so the API server reports it; the connection stays usable
            log.exception("admission handler %s failed", self.path)
            self._send(500, b"internal error", "text/plain")
            return
        response = answer["response"]
        log.info(
            "admission %s",
            "allowed" if response["allowed"] else "denied",
            extra={
                "path": self.path,
                "uid": response["uid"],
                "patched": "patch" in response,
                "reason": response.get("status", {}).get("message", ""),
            },
        )
        self._send(200, json.dumps(answer).encode())


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


class AdmissionServer:
    """The webhook server; ``start()`` serves in a background thread, ``serve_forever()`` in this one."""

    def __init__(
        self,
        *,
        cert: Path,
        key: Path,
        policy: AdmissionPolicy | None = None,
        host: str = "0.0.0.0",
        port: int = 8443,
    ) -> None:
        self._server = _TlsHttpServer((host, port), tls_context(cert, key), policy or AdmissionPolicy())
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._serving = False

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    def url(self, path: str = "", *, host: str | None = None) -> str:
        return f"https://{host or self.host}:{self.port}{path}"

    def serve_forever(self) -> None:
        self._serving = True
        self._server.ready.set()
        log.info("admission webhook serving", extra={"address": f"{self.host}:{self.port}"})
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._server.ready.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="gpufrac-admission", daemon=True)
        self._thread.start()
        self._server.ready.wait(5)

    def stop(self) -> None:
        """Stop accepting, then close the listening socket; in-flight requests finish in their threads."""
        if self._stopped:
            return
        self._stopped = True
        self._server.ready.clear()  # readiness drops first, so a Service stops routing here
        self._server.stopping = True
        if self._serving:  # shutdown() waits for serve_forever(), forever if it never ran
            self._server.shutdown()
        self._server.server_close()
        self._server.end_connections()  # kept-alive connections would otherwise keep being served
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> AdmissionServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
