"""``keys.annotation_key_problem`` agrees with a real kube-apiserver on every key of its table."""

from __future__ import annotations

import pytest
from lightkube import ApiError, Client, codecs
from test_keys import KEYS

pytestmark = pytest.mark.kube


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
