"""The webhook as the chart's "KAI schedules" mode configures it: KAI's binder is the scheduler, and
``gpu-memory`` stays as written, since KAI's other sharing modes read it."""

from __future__ import annotations

import base64
import json

from admission_reviews import apply_patch, pod, review

from gpufrac.admission.review import AdmissionPolicy, mutate_review, validate_review
from gpufrac.contract import keys

KAI_BINDER = "system:serviceaccount:kai-scheduler:binder"
KAI = AdmissionPolicy(binder_users=frozenset({KAI_BINDER}), translate_legacy=False)
NV = "nvidia.com/container."
CDI = "k8s.device-plugin.nvidia.com/gpu=GPU-8f3c6a2e-0000-4000-8000-00000000000a"


def stored(obj: dict, policy: AdmissionPolicy) -> dict:
    response = mutate_review(review(obj), policy)["response"]
    if "patch" not in response:
        return obj
    return apply_patch(obj, json.loads(base64.b64decode(response["patch"])))


def test_gpu_memory_is_left_as_written_for_kai() -> None:
    original = pod({"gpu-memory": "4096", "gpu-memory.limit": "8Gi"}, scheduler="kai-scheduler")
    kept = stored(original, KAI)
    # Only NRI's required-plugin mark is added (the node agent still decides on the container).
    assert kept["metadata"]["annotations"] == {
        **original["metadata"]["annotations"],
        keys.nri_required_plugins_key("app"): '["gpufrac"]',
    }
    assert {**kept, "metadata": original["metadata"]} == original
    translated = stored(original, AdmissionPolicy())
    assert "gpu-memory" not in translated["metadata"]["annotations"]  # the default still translates


def test_kais_binder_may_bind_with_the_newer_binders_keys_and_nobody_else_may() -> None:
    created = pod({"gpu-fraction": "0.5"}, scheduler="kai-scheduler")
    bound = pod(
        {
            "gpu-fraction": "0.5",
            f"{NV}app.gpu-memory.request": "40779Mi",
            f"{NV}app.gpus.devices": CDI,
            f"{NV}app.gpu-compute.portion": "0.5",
        },
        scheduler="kai-scheduler",
    )
    by_kai = validate_review(review(bound, operation="UPDATE", old=created, user=KAI_BINDER), KAI)
    assert by_kai["response"]["allowed"] is True
    by_tenant = validate_review(review(bound, operation="UPDATE", old=created, user="alice"), KAI)
    assert by_tenant["response"]["allowed"] is False
    assert "only the scheduler may set or change this key" in by_tenant["response"]["status"]["message"]
