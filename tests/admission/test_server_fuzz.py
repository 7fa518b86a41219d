"""Property-based fuzzing of the webhook's HTTP input: whatever arrives, a 4xx or an AdmissionReview.

The API server only ever sends well-formed AdmissionReviews, but the webhook listens on the network,
and a 500 or a dropped connection from a crashed handler is what a failurePolicy-Fail webhook must
never answer. Hypothesis takes a valid review apart (fields deleted, replaced by any JSON value, given
huge values) and also posts raw bytes and pathological JSON; after every request the server must still
answer, with 400 and a message, or with an AdmissionReview whose response is a clear allow or deny.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from admission_reviews import binding_review, pod, review
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac.admission.certs import TlsFiles, generate_tls
from gpufrac.admission.review import AdmissionPolicy, MalformedReview, mutate_review, validate_review
from gpufrac.admission.server import AdmissionServer

_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_tls(tmp_path_factory.mktemp("tls"), hosts=["127.0.0.1"])


@pytest.fixture(scope="module")
def client(tls: TlsFiles) -> Iterator[httpx.Client]:
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0) as server:
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        with httpx.Client(base_url=server.url(), verify=context, timeout=10) as c:
            yield c


_json: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["9" * 5000 + "Gi", "x" * 300_000, "\u0661\u0660Gi", "0.5", "CREATE", "Pod"]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into ``value`` (dict keys and list indexes)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, sub in value.items():
            found += _paths(sub, (*prefix, key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            found += _paths(sub, (*prefix, index))
    return found


@st.composite
def broken_reviews(draw: st.DrawFn) -> Any:
    """A real AdmissionReview (pod CREATE or UPDATE, or a Binding) with one to three fields broken."""
    annotations = {"gpu-fraction": "0.5", "nvidia.com/container.app.gpu-memory.request": "1Gi"}
    document = draw(
        st.sampled_from(
            [
                review(pod(annotations)),
                review(pod(annotations), operation="UPDATE", old=pod({})),
                binding_review({"nvidia.com/container.app.gpus.devices": "GPU-1"}),
            ]
        )
    )
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(document)
        if not paths:
            break
        *parents, last = draw(st.sampled_from(paths))
        target = document
        for step in parents:
            target = target[step]
        if draw(st.booleans()) and isinstance(target, dict):
            del target[last]
        else:
            target[last] = draw(_json)
    return document


def _answered_clearly(client: httpx.Client, path: str, body: bytes) -> None:
    answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code in (200, 400, 413), (answer.status_code, answer.text[:300])
    if answer.status_code != 200:
        assert answer.text.startswith(("bad AdmissionReview: ", "bad body length")), answer.text[:300]
        return
    decoded = answer.json()
    assert decoded["apiVersion"] == "admission.k8s.io/v1" and decoded["kind"] == "AdmissionReview"
    response = decoded["response"]
    assert isinstance(response["allowed"], bool) and response["uid"]
    if not response["allowed"]:
        message = response["status"]["message"]
        assert message.endswith(".") and len(message) < 10_000


@_SETTINGS
@given(document=broken_reviews(), path=st.sampled_from(["/validate", "/mutate"]))
def test_a_broken_review_gets_a_client_error_or_a_clear_answer(
    client: httpx.Client, document: Any, path: str
) -> None:
    _answered_clearly(client, path, json.dumps(document).encode())
    assert client.get("/healthz").text == "ok"


@_SETTINGS
@given(document=_json, path=st.sampled_from(["/validate", "/mutate"]))
def test_any_json_document_gets_a_client_error_or_a_clear_answer(
    client: httpx.Client, document: Any, path: str
) -> None:
    _answered_clearly(client, path, json.dumps(document).encode())


@_SETTINGS
@given(body=st.binary(min_size=1, max_size=2000))
def test_any_bytes_get_a_client_error(client: httpx.Client, body: bytes) -> None:
    _answered_clearly(client, "/validate", body)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # deeper than the JSON parser's recursion limit
        b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": ' + b"[" * 50_000,
        b"\xff\xfe{}",
        b'{"apiVersion": NaN}',
    ],
    ids=["deep", "deep-request", "not-utf8", "nan"],
)
def test_pathological_json_gets_a_client_error(client: httpx.Client, body: bytes) -> None:
    answer = client.post("/validate", content=body)
    assert answer.status_code == 400 and answer.text.startswith("bad AdmissionReview: ")
    assert client.get("/healthz").text == "ok"


@pytest.mark.parametrize("length", ["two", "-5", ""])
def test_a_wrong_content_length_gets_a_client_error(tls: TlsFiles, length: str) -> None:
    """Written by hand over TLS: HTTP clients refuse to send a malformed Content-Length."""
    context = ssl.create_default_context(cafile=str(tls.ca_cert))
    with AdmissionServer(cert=tls.cert, key=tls.key, host="127.0.0.1", port=0) as server:
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as wrapped,
        ):
            wrapped.sendall(
                f"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: {length}\r\n\r\n{{}}".encode()
            )
            answer = b""
            while chunk := wrapped.recv(4096):  # the server closes: the body's length was unknown
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ") and answer.endswith(b"bad body length")
        with httpx.Client(base_url=server.url(), verify=context, timeout=10) as c:
            assert c.get("/healthz").text == "ok"


@settings(max_examples=500, deadline=None)
@given(document=broken_reviews())
def test_the_decisions_raise_nothing_but_a_malformed_review(document: Any) -> None:
    """The same documents straight into the decisions (many more of them than HTTP allows in CI time)."""
    for decide in (validate_review, mutate_review):
        try:
            answer = decide(document, AdmissionPolicy())
        except MalformedReview as malformed:
            assert str(malformed)
            continue
        assert isinstance(answer["response"]["allowed"], bool)
