"""The webhook over real HTTPS with a locally generated CA, as the API server would call it."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from admission_reviews import pod, review

from gpufrac.admission.certs import covers, ensure_tls, generate_tls, service_hosts
from gpufrac.admission.server import AdmissionServer


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return generate_tls(tmp_path_factory.mktemp("tls"), hosts=["127.0.0.1", "localhost"])


@pytest.fixture
def server(tls) -> Iterator[AdmissionServer]:  # type: ignore[no-untyped-def]
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0) as running:
        yield running


@pytest.fixture
def client(tls, server: AdmissionServer) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=server.url(), verify=ssl.create_default_context(cafile=str(tls.ca_cert))) as c:
        yield c


def test_health_and_readiness(client: httpx.Client) -> None:
    assert client.get("/healthz").text == "ok"
    assert client.get("/readyz").status_code == 200
    assert client.get("/nope").status_code == 404


def test_validate_and_mutate_over_https(client: httpx.Client) -> None:
    denied = client.post("/validate", json=review(pod({"gpu-fraction": "2"}))).json()
    assert denied["response"]["allowed"] is False
    assert denied["response"]["status"]["message"].startswith('gpu-fraction="2" is invalid')
    patched = client.post("/mutate", json=review(pod({"gpu-memory": "100"}))).json()
    assert patched["response"]["patchType"] == "JSONPatch"


def test_malformed_requests_get_a_client_error(client: httpx.Client) -> None:
    assert client.post("/validate", content=b"{not json").status_code == 400
    assert client.post("/validate", content=b"[1]").status_code == 400
    assert client.post("/validate", content=b"").status_code == 400


def test_a_client_that_never_finishes_its_handshake_does_not_block_others(
    client: httpx.Client, server: AdmissionServer
) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        idle.sendall(b"\x16")  # a TLS record header, then silence
        assert client.get("/healthz").status_code == 200


def test_the_certificate_is_checked_by_name(tls, server: AdmissionServer) -> None:  # type: ignore[no-untyped-def]
    context = ssl.create_default_context(cafile=str(tls.ca_cert))
    with (
        pytest.raises(ssl.SSLCertVerificationError),
        socket.create_connection(("127.0.0.1", server.port)) as raw,
        context.wrap_socket(raw, server_hostname="not-the-webhook.example"),
    ):
        pass


def test_stop_closes_the_port(tls) -> None:  # type: ignore[no-untyped-def]
    server = AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0)
    server.start()
    port = server.port
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_local_tls_is_reused_while_it_covers_the_hosts(tmp_path: Path) -> None:
    hosts = ["127.0.0.1", *service_hosts("gpufrac-admission", "gpufrac-system")]
    first = ensure_tls(tmp_path, hosts=hosts)
    assert covers(first, hosts)
    assert first.key.stat().st_mode & 0o777 == 0o600
    pem = first.cert.read_bytes()
    assert ensure_tls(tmp_path, hosts=hosts).cert.read_bytes() == pem
    assert ensure_tls(tmp_path, hosts=[*hosts, "10.0.0.7"]).cert.read_bytes() != pem


def test_stop_also_ends_kept_alive_connections(tls) -> None:  # type: ignore[no-untyped-def]
    server = AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0)
    server.start()
    context = ssl.create_default_context(cafile=str(tls.ca_cert))
    with httpx.Client(base_url=server.url(), verify=context, timeout=3) as kept_alive:
        assert kept_alive.get("/healthz").status_code == 200
        server.stop()
        try:
            after = kept_alive.get("/healthz").status_code
        except httpx.TransportError:
            after = None
        assert after in (None, 503)
