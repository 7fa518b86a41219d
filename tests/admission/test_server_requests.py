"""The webhook's own HTTP request path, written by hand over TLS: what a client sees of how a request is
read (request line, headers, keep-alive), how its JSON is decoded and how the answer is written.

The server reads plain HTTP/1.x headers itself and decodes and encodes JSON with msgspec
(``gpufrac.admission.server``): these tests hold it to what the standard library's parser and ``json``
answered, and to RFC 9112 where it is stricter (a header line that is not ``name: value`` is refused).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
from collections.abc import Iterator
from email.utils import parsedate_to_datetime

import pytest
from admission_reviews import pod, review

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.server import AdmissionServer


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls(tmp_path_factory.mktemp("tls"), hosts=["127.0.0.1"])


@pytest.fixture(scope="module")
def server(tls: TlsFiles) -> Iterator[AdmissionServer]:
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0, idle_timeout_s=5) as running:
        yield running


class Connection:
    """One TLS connection; ``ask`` sends raw bytes and reads one answer (status, headers, body)."""

    def __init__(self, tls: TlsFiles, server: AdmissionServer) -> None:
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        self.sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        self.pending = b""

    def read_answer(self) -> tuple[str, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.pending:
            chunk = self.sock.recv(65536)
            assert chunk, f"closed before an answer: {self.pending!r}"
            self.pending += chunk
        head, self.pending = self.pending.split(b"\r\n\r\n", 1)
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (x.partition(":") for x in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.pending) < length:
            self.pending += self.sock.recv(65536)
        body, self.pending = self.pending[:length], self.pending[length:]
        return status, headers, body

    def ask(self, raw: bytes) -> tuple[str, dict[str, str], bytes]:
        self.sock.sendall(raw)
        return self.read_answer()

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


@pytest.fixture
def connection(tls: TlsFiles, server: AdmissionServer) -> Iterator[Connection]:
    opened = Connection(tls, server)
    yield opened
    opened.sock.close()


def post(body: bytes, *, path: str = "/validate", version: str = "HTTP/1.1", extra: str = "") -> bytes:
    head = f"POST {path} {version}\r\nHost: webhook\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


DENIED = json.dumps(review(pod({"gpu-fraction": "2"}))).encode()


def test_an_answer_carries_its_status_line_date_type_and_length(connection: Connection) -> None:
    status, headers, body = connection.ask(post(DENIED))
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert parsedate_to_datetime(headers["date"]).year >= 2024
    answer = json.loads(body)
    assert answer["response"]["uid"] == "u-1" and answer["response"]["allowed"] is False
    assert answer["response"]["status"]["message"].startswith('gpu-fraction="2" is invalid')


def test_a_kept_alive_connection_answers_request_after_request(connection: Connection) -> None:
    for _ in range(3):
        assert connection.ask(post(DENIED))[0] == "HTTP/1.1 200 OK"
    assert connection.ask(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")[2] == b"ok"
    # Still open: the read times out. It waits 1 s, well inside the server's 5-s idle timeout; with the
    # connection's own 5 s the two timeouts raced and the server's could win on a loaded machine.
    connection.sock.settimeout(1)
    assert not connection.closed_by_server()


@pytest.mark.parametrize(
    ("version", "extra", "closes"),
    [
        ("HTTP/1.1", "Connection: close\r\n", True),
        ("HTTP/1.1", "Connection: Keep-Alive\r\n", False),
        ("HTTP/1.0", "", True),
        ("HTTP/1.0", "Connection: keep-alive\r\n", False),
    ],
)
def test_the_connection_header_and_version_decide_whether_the_connection_stays(
    tls: TlsFiles, server: AdmissionServer, version: str, extra: str, closes: bool
) -> None:
    connection = Connection(tls, server)
    connection.sock.settimeout(1)
    try:
        assert connection.ask(post(DENIED, version=version, extra=extra))[0].endswith(" 200 OK")
        assert connection.closed_by_server() is closes
    finally:
        connection.sock.close()


def test_expect_100_continue_gets_its_interim_answer(connection: Connection) -> None:
    connection.sock.sendall(post(b"", extra="Expect: 100-continue\r\n").replace(b"Length: 0", b"Length: 2"))
    assert connection.read_answer()[0] == "HTTP/1.1 100 Continue"
    connection.sock.sendall(b"{}")
    status, _, body = connection.read_answer()
    assert status.startswith("HTTP/1.1 400 ") and body.startswith(b"bad AdmissionReview: ")


@pytest.mark.parametrize(
    "line",
    ["Content-Length : 5", " folded-onto-the-previous", "no colon at all"],
    ids=["space-before-colon", "folded", "no-colon"],
)
def test_a_header_line_that_is_not_name_colon_value_is_refused(connection: Connection, line: str) -> None:
    """RFC 9112 section 5: whitespace before the colon must be refused, a folded line may be; the
    standard library's e-mail parser let both through."""
    status, headers, _ = connection.ask(post(DENIED, extra=f"X-Before: 1\r\n{line}\r\n"))
    assert status.startswith("HTTP/1.1 400 ")
    assert headers["connection"] == "close" and connection.closed_by_server()


def test_headers_beyond_the_standard_librarys_limits_are_refused(
    tls: TlsFiles, server: AdmissionServer
) -> None:
    many = "".join(f"X-H{i}: {i}\r\n" for i in range(100))
    long = f"X-Long: {'a' * 70_000}\r\n"
    for extra in (many, long):
        connection = Connection(tls, server)
        try:
            assert connection.ask(post(DENIED, extra=extra))[0].startswith("HTTP/1.1 431 ")
        finally:
            connection.sock.close()
    connection = Connection(tls, server)  # 99 header lines are still fine
    try:
        status = connection.ask(post(DENIED, extra="".join(f"X-H{i}: {i}\r\n" for i in range(96))))[0]
        assert status == "HTTP/1.1 200 OK"
    finally:
        connection.sock.close()


@pytest.mark.parametrize(
    ("request_line", "code"),
    [("GET /healthz HTTP/2.0", b"505"), ("GET /healthz HTTP/1.1 extra", b"400"), ("GET /healthz", b"")],
)
def test_other_request_lines_are_answered_as_the_standard_parser_does(
    connection: Connection, request_line: str, code: bytes
) -> None:
    """Not ``METHOD PATH HTTP/1.x``: the standard parser answers, as HTTP/0.9 (a body, no status line),
    and closes."""
    connection.sock.sendall(f"{request_line}\r\nHost: webhook\r\n\r\n".encode())
    answer = b""
    while chunk := connection.sock.recv(65536):
        answer += chunk
    assert answer == b"ok" if not code else b"Error code: " + code in answer


def test_json_only_the_standard_parser_reads_is_answered_as_before(connection: Connection) -> None:
    """A NaN and a lone surrogate (the API server sends neither) are refused by msgspec; the request is
    still decoded and answered as ``json`` did, the surrogate in the uid echoed back."""
    document = review(pod({"gpu-fraction": "2"}, gpus=0))
    document["request"]["uid"] = "u-\ud800"
    body = json.dumps(document).replace('"name": "p"', '"name": "p", "generation": NaN').encode()
    status, _, answer = connection.ask(post(body))
    assert status == "HTTP/1.1 200 OK"
    decoded = json.loads(answer)["response"]
    assert decoded["uid"] == "u-\ud800" and decoded["allowed"] is False


def test_each_answer_is_logged_with_its_uid_and_reason(
    connection: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpufrac.admission")
    connection.ask(post(DENIED))
    connection.ask(post(b"{}"))  # a 400 is not an admission decision: no line
    connection.ask(b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n")  # the line is written after the answer
    lines = [r for r in caplog.records if r.getMessage().startswith("admission ")]
    assert [r.getMessage() for r in lines] == ["admission denied"]
    assert lines[0].__dict__["uid"] == "u-1" and lines[0].__dict__["path"] == "/validate"
    assert lines[0].__dict__["reason"].startswith('gpu-fraction="2" is invalid')
