"""The webhook bounds its connections: a cap on how many it serves, idle timeouts, one line per failure.

Each admitted connection holds one thread, so idle connections from anyone who can reach the port once
cost a thread and ~75 KB each without bound (1,500 took 1,504 threads). Here connections beyond the cap
are closed at once and take no thread, a silent connection is closed after the idle timeout, and a
connection that fails is one log line without a traceback.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.server import CONNECTION_THREAD, AdmissionServer

CAP = 3


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def trusted(tls: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls.ca_cert))


def connection_threads(server: AdmissionServer) -> int:
    name = f"{CONNECTION_THREAD}-{server.port}"
    return sum(1 for thread in threading.enumerate() if thread.name == name)


def metric(server: AdmissionServer, trusted: ssl.SSLContext, name: str, **labels: str) -> float:
    with httpx.Client(verify=trusted) as client:
        text = client.get(server.url("/metrics")).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels == labels
    )


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 15
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (end of file, or a reset) within the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def capped(tls: TlsFiles) -> Iterator[AdmissionServer]:
    with AdmissionServer(
        cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, max_connections=CAP, idle_timeout_s=60
    ) as server:
        yield server


def test_idle_connections_beyond_the_cap_are_closed_at_once_and_take_no_thread(
    capped: AdmissionServer, trusted: ssl.SSLContext, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpufrac.admission")
    extra = 4
    idle = [socket.create_connection(("127.0.0.1", capped.port), timeout=10) for _ in range(CAP + extra)]
    try:
        # The first CAP wait in their TLS handshake (for 60 s); the rest are closed as they are accepted.
        assert [closed_by_server(sock) for sock in idle[CAP:]] == [True] * extra
        assert connection_threads(capped) == CAP
        refusals = [r for r in caplog.records if "connections open, the most this server serves" in r.message]
        assert len(refusals) == extra
        assert all(r.exc_info is None for r in refusals)
    finally:
        for sock in idle:
            sock.close()
    # Closing the idle ones gives their places back: a real client is served again.
    wait_for(lambda: connection_threads(capped) == 0, "the idle connections' threads ended")
    assert (
        metric(capped, trusted, "gpufrac_admission_connections_dropped_total", reason="over_capacity")
        == extra
    )
    with httpx.Client(verify=trusted) as client:
        assert client.get(capped.url("/healthz")).text == "ok"


def test_a_silent_connection_is_closed_after_the_idle_timeout(tls: TlsFiles) -> None:
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, idle_timeout_s=0.2) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as silent:
            assert closed_by_server(silent)
        wait_for(lambda: connection_threads(server) == 0, "the silent connection's thread ended")


def test_a_kept_alive_connection_that_goes_idle_is_closed_quietly(
    tls: TlsFiles, trusted: ssl.SSLContext, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpufrac.admission")
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, idle_timeout_s=1.0) as server:
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        with trusted.wrap_socket(raw, server_hostname="127.0.0.1") as kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                answer += kept.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            assert kept.recv(1) == b""  # the server ends the idle keep-alive connection
        wait_for(lambda: connection_threads(server) == 0, "the connection's thread ended")
    assert [r.message for r in caplog.records if r.levelno >= logging.WARNING] == []


def _plain_http(sock: socket.socket) -> None:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")  # HTTP on the HTTPS port
    closed_by_server(sock)


def _reset_in_handshake(sock: socket.socket) -> None:
    sock.sendall(b"\x16\x03\x01\x00\x40")  # the header of a ClientHello record, then a reset
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _silent(sock: socket.socket) -> None:
    closed_by_server(sock)


@pytest.mark.parametrize(
    ("client", "idle_timeout_s", "words", "reason"),
    [
        (_plain_http, 60, "dropped: TLS handshake failed (", "tls_handshake"),
        (_reset_in_handshake, 60, "dropped: closed by the client in the TLS handshake", "reset"),
        (_silent, 0.3, "dropped: timed out in the TLS handshake", "timeout"),
    ],
    ids=["plain-http", "reset", "timeout"],
)
def test_a_dropped_connection_is_one_log_line_without_a_traceback(
    tls: TlsFiles,
    trusted: ssl.SSLContext,
    caplog: pytest.LogCaptureFixture,
    client: Callable[[socket.socket], None],
    idle_timeout_s: float,
    words: str,
    reason: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpufrac.admission")
    with AdmissionServer(
        cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, idle_timeout_s=idle_timeout_s
    ) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        peer = f"127.0.0.1:{sock.getsockname()[1]}"
        # A connection reset before it is accepted never reaches the server: wait until it is served.
        wait_for(lambda: connection_threads(server) == 1, "the server took the connection")
        client(sock)
        sock.close()

        def about_peer() -> list[logging.LogRecord]:
            return [r for r in caplog.records if peer in r.getMessage()]

        wait_for(lambda: bool(about_peer()), "the server logged the connection")
        wait_for(lambda: connection_threads(server) == 0, "the connection's thread ended")
        about = about_peer()
        assert len(about) == 1, [r.getMessage() for r in about]
        assert words in about[0].getMessage()
        assert about[0].levelno == logging.WARNING
        assert about[0].exc_info is None
        assert metric(server, trusted, "gpufrac_admission_connections_dropped_total", reason=reason) == 1
