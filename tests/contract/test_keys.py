"""The API server's annotation-key rule, as ``keys.annotation_key_problem`` states it.

``test_the_api_server_accepts_exactly_the_keys_the_rule_accepts`` asks a real kube-apiserver about the
same keys, so this table cannot drift from what Kubernetes enforces.
"""

from __future__ import annotations

import pytest
from lightkube import ApiError, Client, codecs

from gpufrac.contract import keys as k

# (key, the API server accepts it): shared with the real-API-server test.
KEYS: list[tuple[str, bool]] = [
    (k.devices_key("app"), True),
    (k.memory_request_key("c" * 34), True),  # name part: exactly 63 characters
    (k.memory_request_key("c" * 35), False),  # 64
    (k.devices_key("c" * 40), True),
    (k.devices_key("c" * 41), False),
    (k.compute_portion_key("c" * 33), True),
    (k.compute_portion_key("c" * 34), False),
    ("gpu-fraction", True),
    ("a" * 63, True),
    ("a" * 64, False),
    ("Example.COM/My_Name.x-1", True),  # checked lower-cased: an upper-case prefix passes
    ("example.com/", False),
    ("/name", False),
    ("a/b/c", False),
    ("-name", False),
    ("name-", False),
    ("na me", False),
    ("exa_mple.com/name", False),
    ("-example.com/name", False),
    ("example..com/name", False),
    (("a" * 63 + ".") * 3 + "a" * 61 + "/name", True),  # prefix of 253 characters
    (("a" * 63 + ".") * 3 + "a" * 62 + "/name", False),  # 254
    ("", False),
    ("n\u00e4me", False),
    ("name\n", False),
]


@pytest.mark.parametrize(("key", "valid"), KEYS, ids=[f"{i}" for i in range(len(KEYS))])
def test_the_annotation_key_rule(key: str, valid: bool) -> None:
    assert (k.annotation_key_problem(key) is None) is valid


def test_the_problem_says_what_the_rule_is() -> None:
    assert k.annotation_key_problem(k.memory_request_key("c" * 35)) == (
        "the name part must be no more than 63 characters, it has 64"
    )
    assert (
        k.annotation_key_problem("exa_mple.com/x") == "the prefix part must be a lowercase DNS-1123 subdomain"
    )
    assert "start and end with an alphanumeric character" in (k.annotation_key_problem("x/-a") or "")


@pytest.mark.kube
def test_the_api_server_accepts_exactly_the_keys_the_rule_accepts(kube: Client, namespace: str) -> None:
    disagreements = []
    for index, (key, valid) in enumerate(KEYS):
        pod = codecs.from_dict(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"key-{index}", "annotations": {key: "x"}},
                "spec": {"containers": [{"name": "app", "image": "busybox"}]},
            }
        )
        try:
            kube.create(pod, namespace=namespace, dry_run=True)
            accepted = True
        except ApiError as error:
            assert error.status.code == 422, error.status.message
            assert "metadata.annotations" in (error.status.message or "")
            accepted = False
        if accepted is not valid:
            disagreements.append((key, accepted))
    assert disagreements == []
