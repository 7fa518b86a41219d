"""The webhook's HTTPS server: ``/validate``, ``/mutate``, ``/healthz``, ``/readyz``, ``/metrics``.

The standard library's threading HTTP server is enough: an admission request is a small JSON document
answered from memory in microseconds, and the API server keeps a handful of connections. What makes it
robust against everything else that can reach the port:

* the TLS handshake runs in the connection's own thread, so a slow or broken client cannot stall the
  accept loop;
* at most ``max_connections`` connections are served at once (one thread each); beyond that a new
  connection is closed as soon as it is accepted, so idle connections cannot pile up threads and memory
  (1,500 idle connections once took 1,504 threads and 110 MB);
* every read (the handshake, an idle keep-alive waiting for its next request, a body) times out after
  ``idle_timeout_s``; the API server opens a new connection when it needs one;
* a connection that fails (handshake refused, timed out, reset) is one log line, never a traceback;
* the certificate is re-read every ``cert_poll_interval_s`` and new connections get a rotated one
  (``certs.ServingCertificate``), and ``/metrics`` says when the served one expires.

What an answer costs here (``bench/admission_latency.py``, docs/benchmarks.md): the API server makes
two calls per GPU pod create (mutate, then validate), so each call's fixed cost counts twice. Beyond the
decision itself a request is read, parsed and answered without the standard library's slow parts: the
headers of a plain HTTP/1.x request are read by ``_read_headers`` (``http.client.parse_headers`` runs
the e-mail parser, about 0.1 ms a request), the AdmissionReview is decoded and the answer encoded with
msgspec (``_decode_review``, ``_encode_answer``: the standard ``json`` as the fallback, so any document
it accepted is still answered alike), the answer leaves in one write (status line, headers and body:
one TLS record), and the per-request log line is written after the answer is sent.

A request that is not a readable
AdmissionReview (bad length, bad JSON, nesting too deep, a field of the wrong type) answers 400 with what
is wrong; property tests post arbitrary documents and check that nothing else comes back. Any other
failure inside a handler answers 500 rather than dropping the connection, so the API server reports a
clear error (and, with failurePolicy Fail, rejects only the GPU pod at hand, never ordinary pods: the
configuration's matchConditions keep those away).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpufrac.admission.certs import ServingCertificate
from gpufrac.admission.metrics import AdmissionMetrics
from gpufrac.admission.review import AdmissionPolicy, MalformedReview, mutate_review, validate_review

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # an AdmissionReview holds the old and new object; etcd caps each near 1.5 MiB
#: Far above what the API servers need (a few connections each, Go keeps up to 25 idle per host), far
#: below what memory allows (about 75 KB per connection and thread).
DEFAULT_MAX_CONNECTIONS = 256
#: Shorter than the API server's own idle timeout for kept-alive connections (90 s), so the server,
#: not a half-open client, decides when an idle connection ends; long enough for any one read.
DEFAULT_IDLE_TIMEOUT_S = 10.0
DEFAULT_CERT_POLL_INTERVAL_S = 5.0
CONNECTION_THREAD = "gpufrac-admission-connection"  # + "-<port>"
_MAX_ERROR_CHARS = 500
#: The limits ``http.client`` puts on a header line and on the number of header lines.
_MAX_HEADER_LINE = 65536
_MAX_HEADER_LINES = 100
_FAST_VERSIONS = ("HTTP/1.1", "HTTP/1.0")
_END_OF_HEADERS = (b"\r\n", b"\n", b"")


_IN_HANDSHAKE = "in the TLS handshake"


def _drop_reason(error: BaseException | None) -> tuple[str, str]:
    """The ``reason`` label and a few words for a connection that ended with ``error``."""
    where = " " + _IN_HANDSHAKE if _IN_HANDSHAKE in getattr(error, "__notes__", ()) else ""
    if isinstance(error, TimeoutError):
        return "timeout", f"timed out{where}"
    if isinstance(error, ssl.SSLError) and not isinstance(error, ssl.SSLEOFError):
        what = "TLS handshake failed" if where else "TLS error"
        return "tls_handshake", f"{what} ({error.reason or error})"
    if isinstance(error, OSError):
        return "reset", f"closed by the client{where} ({type(error).__name__})"
    return "error", f"{type(error).__name__}: {error}"


def _decode_review(body: bytes) -> Any:
    """The request's JSON document; raises ``ValueError`` or ``RecursionError`` (nesting too deep).

    msgspec decodes an AdmissionReview several times faster than ``json.loads``; it is stricter (NaN, a
    byte order mark, lone surrogates, numbers beyond a double), so a document it refuses is decoded by
    ``json.loads``, which answers as before: with the document, or with the error this server reports.
    """
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(body)


def _encode_answer(answer: Mapping[str, Any]) -> bytes:
    """The answer as JSON (msgspec; ``json.dumps`` for what it cannot encode, such as a lone surrogate
    that only ``json.loads`` let in)."""
    try:
        return msgspec.json.encode(answer)
    except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError
        return json.dumps(answer).encode()


_date = (0, "")  # (second, its HTTP date): formatting one costs more than the rest of the headers


def _http_date(handler: BaseHTTPRequestHandler) -> str:
    global _date
    now = int(time.time())
    second, text = _date
    if second != now:
        text = handler.date_time_string(now)
        _date = (now, text)
    return text


Handler = Callable[[Mapping[str, Any], AdmissionPolicy], dict[str, Any]]
ROUTES: dict[str, Handler] = {"/validate": validate_review, "/mutate": mutate_review}


class _TlsHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        *,
        certificate: ServingCertificate,
        policy: AdmissionPolicy,
        metrics: AdmissionMetrics,
        max_connections: int,
        idle_timeout_s: float,
    ) -> None:
        self.certificate = certificate
        self.policy = policy
        self.metrics = metrics
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.ready = threading.Event()
        self.stopping = False
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        super().__init__(address, _RequestHandler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a connection while fewer than ``max_connections`` are open; ``shutdown_request``, which
        runs for every accepted connection however it ends, gives the place back."""
        with self._lock:
            admitted = len(self._connections) < self.max_connections
            if admitted:
                self._connections.add(request)
        if not admitted:
            self.metrics.connections_dropped.labels("over_capacity").inc()
            log.warning(
                "connection from %s closed: %d connections open, the most this server serves at once",
                _peer(client_address),
                self.max_connections,
            )
        return admitted

    def process_request(self, request: Any, client_address: Any) -> None:
        """One named daemon thread per admitted connection (the cap bounds how many)."""
        threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"{CONNECTION_THREAD}-{self.server_address[1]}",
            daemon=True,
        ).start()

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            with self._lock:
                self._connections.discard(request)

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
        sock.settimeout(self.idle_timeout_s)
        # An answer leaves in two writes (headers, then body: two TLS records). With Nagle's algorithm
        # the body waits for the client's ACK of the headers, which a client delays up to 40 ms: every
        # admission call took 40+ ms at the API server for under 1 ms of work here
        # (bench/admission_latency.py, docs/benchmarks.md). Send each write at once.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = self.certificate.current.context  # read once: a rotation swaps it between accepts
        return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed: one line with the reason, never a traceback (a scanner, a client
        that gave up, a load balancer's TCP check are not bugs of this server)."""
        error = sys.exc_info()[1]
        if self.stopping:
            log.debug("connection from %s ended while stopping: %r", _peer(client_address), error)
            return
        self.dropped(client_address, error)

    def dropped(self, client_address: Any, error: BaseException | None, *, waiting: str = "") -> None:
        label, words = _drop_reason(error)
        if label == "error":  # not a network failure: a bug worth its traceback
            log.error("connection from %s failed", _peer(client_address), exc_info=error)
        else:
            log.warning("connection from %s dropped: %s%s", _peer(client_address), words, waiting)
        self.metrics.connections_dropped.labels(label).inc()


def _peer(client_address: Any) -> str:
    if isinstance(client_address, tuple) and len(client_address) >= 2:
        return f"{client_address[0]}:{client_address[1]}"
    return str(client_address)


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _TlsHttpServer

    def setup(self) -> None:
        assert isinstance(self.request, ssl.SSLSocket)
        self.answered = 0  # requests answered on this connection
        self.in_request = False
        try:
            self.request.do_handshake()
        except OSError as error:
            error.add_note(_IN_HANDSHAKE)  # handle_error words it so
            raise
        super().setup()

    def log_error(self, format: str, *args: Any) -> None:
        """``BaseHTTPRequestHandler`` reports a read that timed out here and closes the connection. An
        idle keep-alive connection that ends between requests is routine; one that timed out before its
        first request, or within one, is a dropped connection."""
        if args and isinstance(args[-1], TimeoutError):
            if self.answered and not self.in_request:
                log.debug("idle connection from %s closed", _peer(self.client_address))
            else:
                waiting = " (in a request)" if self.in_request else " (before its first request)"
                self.server.dropped(self.client_address, args[-1], waiting=waiting)
            return
        self.log_message(format, *args)

    def parse_request(self) -> bool:
        self.in_request = True
        if not self._parse_plain_request():
            return False
        if self.server.stopping:  # read after stop() began: refuse rather than answer from a stopped server
            self.close_connection = True
            self.send_error(503, "stopping")
            return False
        return True

    def _parse_plain_request(self) -> bool:
        """``BaseHTTPRequestHandler.parse_request`` for a request line ``METHOD PATH HTTP/1.1`` (or 1.0),
        with the headers read by ``_read_headers``; any other request line (HTTP/0.9, 2.0, malformed)
        goes to the standard parser, which has not read anything yet. Whether to go on; on failure the
        error answer has been sent."""
        self.command = None
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if len(words) != 3 or words[2] not in _FAST_VERSIONS:
            return bool(super().parse_request())
        self.request_version = words[2]
        self.command, self.path = words[0], words[1]
        if self.path.startswith("//"):  # as the standard parser: never an absolute URI without scheme
            self.path = "/" + self.path.lstrip("/")
        headers = self._read_headers()
        if headers is None:
            return False
        self.headers = headers
        connection = headers.get("Connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive"
        )
        if headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            return bool(self.handle_expect_100())
        return True

    def _read_headers(self) -> http.client.HTTPMessage | None:
        """The header lines up to the empty one, with ``http.client``'s limits (431 beyond them). A line
        that is not ``name: value`` (a folded continuation, whitespace before the colon, no colon)
        answers 400, as RFC 9112 section 5 asks of a server; None after an error answer."""
        headers = http.client.HTTPMessage()
        for count in range(1, _MAX_HEADER_LINES + 2):
            line = self.rfile.readline(_MAX_HEADER_LINE + 1)
            if len(line) > _MAX_HEADER_LINE:
                self.send_error(431, "Line too long", "header line")
                return None
            if count > _MAX_HEADER_LINES:
                self.send_error(431, "Too many headers", f"got more than {_MAX_HEADER_LINES} headers")
                return None
            if line in _END_OF_HEADERS:
                return headers
            name, colon, value = str(line, "iso-8859-1").partition(":")
            if not colon or not name or name != name.strip():
                self.send_error(400, "Bad header line", f"not a header field: {name[:80]!r}")
                return None
            headers[name] = value.strip()
        raise AssertionError("unreachable: the loop returns by its last line")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        """The whole answer in one write: one TLS record, one system call."""
        self.log_request(code, len(body))
        head = (
            f"{self.protocol_version} {code} {self.responses[code][0]}\r\n"
            f"Server: {self.version_string()}\r\nDate: {_http_date(self)}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        # HTTP/0.9 (a bare ``GET /path``, read by the standard parser) has no status line or headers
        self.wfile.write(body if self.request_version == "HTTP/0.9" else head.encode("latin-1") + body)
        self.answered += 1
        self.in_request = False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, b"ok", "text/plain")
        elif path == "/readyz":
            ready = self.server.ready.is_set()
            self._send(200 if ready else 503, b"ok" if ready else b"not ready", "text/plain")
        elif path == "/metrics":
            self._send(200, generate_latest(self.server.metrics.registry), CONTENT_TYPE_LATEST)
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
            review = _decode_review(self.rfile.read(length))
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
        self._send(200, _encode_answer(answer))
        response = answer["response"]  # logged once answered: the API server does not wait for the line
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


class AdmissionServer:
    """The webhook server; ``start()`` serves in a background thread, ``serve_forever()`` in this one.

    While it serves, a second thread re-reads the certificate files every ``cert_poll_interval_s``
    (``check_certificate``)."""

    def __init__(
        self,
        *,
        cert: Path,
        key: Path,
        policy: AdmissionPolicy | None = None,
        host: str = "0.0.0.0",
        port: int = 8443,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        cert_poll_interval_s: float = DEFAULT_CERT_POLL_INTERVAL_S,
    ) -> None:
        if max_connections < 1 or idle_timeout_s <= 0 or cert_poll_interval_s <= 0:
            raise ValueError("max_connections, idle_timeout_s and cert_poll_interval_s must be positive")
        self.certificate = ServingCertificate(cert=cert, key=key)
        self.metrics = AdmissionMetrics()
        self._server = _TlsHttpServer(
            (host, port),
            certificate=self.certificate,
            policy=policy or AdmissionPolicy(),
            metrics=self.metrics,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout_s,
        )
        self.metrics.follow(
            expiry=lambda: self.certificate.current.not_after.timestamp(),
            open_connections=self._server.open_connections,
        )
        self._cert_poll_interval_s = cert_poll_interval_s
        self._watching = threading.Event()  # set: stop watching the certificate
        self._watcher: threading.Thread | None = None
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

    def check_certificate(self) -> bool:
        """Serve the certificate files' new content to new connections if it changed and loads;
        whether it did. A pair that does not load keeps the current one (logged once)."""
        failures = self.certificate.failures
        changed = self.certificate.check()
        if changed:
            self.metrics.certificate_reloads.inc()
        self.metrics.certificate_reload_failures.inc(self.certificate.failures - failures)
        return changed

    def _watch_certificate(self) -> None:
        while not self._watching.wait(self._cert_poll_interval_s):
            try:
                self.check_certificate()
            except Exception:  # the watcher must outlive any surprise; the old certificate keeps serving
                log.exception("checking the certificate files failed")

    def serve_forever(self) -> None:
        self._serving = True
        self._watcher = threading.Thread(
            target=self._watch_certificate, name="gpufrac-admission-certificate", daemon=True
        )
        self._watcher.start()
        self._server.ready.set()
        log.info("admission webhook serving", extra={"address": f"{self.host}:{self.port}"})
        try:
            self._server.serve_forever(poll_interval=0.2)
        finally:
            self._server.ready.clear()
            self._watching.set()

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
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> AdmissionServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
