"""The webhook and MIG requests: a MIG resource of our scheduler's pod becomes gpufrac's MIG keys (so no
device plugin hands a slice out beside gpufrac), a pod of another scheduler keeps its resource, gpufrac's
own MIG keys send a pod to gpufrac's scheduler, and a bad MIG request is refused in one sentence."""

from __future__ import annotations

import base64
import json
from typing import Any

from admission_reviews import apply_patch, pod, review

from gpufrac.admission.review import AdmissionPolicy, mutate_review, validate_review
from gpufrac.contract import keys
from gpufrac.contract.parse import ContainerSpec, parse_pod, parse_pod_manifest
from gpufrac.contract.request import MigRequest

REQUIRES_GPUFRAC = '["gpufrac"]'
PROFILE, COUNT, MEMORY = (keys.mig_key("app", s) for s in (keys.MIG_PROFILE, keys.MIG_COUNT, keys.MIG_MEMORY))


def _mig_pod(resources: dict[str, Any], annotations: dict[str, str] | None = None, **kw: str) -> dict:
    manifest = pod(annotations, **kw)
    manifest["spec"]["containers"][0]["resources"] = resources
    return manifest


def _mutated(manifest: dict) -> dict:
    answer = mutate_review(review(manifest), AdmissionPolicy())["response"]
    assert answer["allowed"] is True
    patch = json.loads(base64.b64decode(answer["patch"])) if "patch" in answer else []
    return apply_patch(manifest, patch)


def test_a_mig_resource_of_our_pod_becomes_the_mig_keys_and_is_removed() -> None:
    original = _mig_pod(
        {"limits": {"nvidia.com/mig-3g.40gb": "2", "cpu": "1"}, "requests": {"nvidia.com/mig-3g.40gb": "2"}}
    )
    stored = _mutated(original)
    app = stored["spec"]["containers"][0]
    assert app["resources"] == {"limits": {"cpu": "1"}, "requests": {}}
    assert stored["metadata"]["annotations"] == {
        PROFILE: "3g.40gb",
        COUNT: "2",
        keys.nri_required_plugins_key("app"): REQUIRES_GPUFRAC,
    }
    assert any(t["key"] == keys.MANAGED_TAINT_KEY for t in stored["spec"]["tolerations"])
    (container,) = parse_pod_manifest(stored).containers
    assert container.mig == MigRequest(profile="3g.40gb", count=2)
    assert parse_pod_manifest(stored) == parse_pod_manifest(original)
    assert _mutated(stored) == stored


def test_a_mig_resource_of_another_schedulers_pod_is_left_to_the_device_plugin() -> None:
    for scheduler in ("default-scheduler", "kai-scheduler"):
        other = _mig_pod({"limits": {"nvidia.com/mig-1g.10gb": "1"}}, scheduler=scheduler)
        assert _mutated(other) == other


def test_gpufrac_mig_keys_send_a_pod_that_names_no_scheduler_to_ours() -> None:
    stored = _mutated(pod({MEMORY: "20Gi"}, scheduler="default-scheduler"))
    assert stored["spec"]["schedulerName"] == "gpufrac-scheduler"
    assert stored["metadata"]["annotations"][keys.nri_required_plugins_key("app")] == REQUIRES_GPUFRAC


def test_a_bad_mig_request_is_refused_with_the_key_the_value_and_the_rule() -> None:
    bad = _mig_pod({"limits": {"nvidia.com/mig-1g.10gb": "1"}}, {keys.memory_request_key("app"): "1Gi"})
    answer = validate_review(review(bad), AdmissionPolicy())["response"]
    assert answer["allowed"] is False
    assert answer["status"]["message"] == (
        'spec.containers[app].resources.limits.nvidia.com/mig-1g.10gb="1" is invalid: a container asks for'
        " MIG slices or for other GPU keys (fractions, compute, whole GPUs), not both"
        " (nvidia.com/container.app.gpu-memory.request is also set)."
    )
    unknown = validate_review(review(pod({PROFILE: "1g.6gb"})), AdmissionPolicy())["response"]
    assert unknown["allowed"] is False
    assert unknown["status"]["message"].startswith(
        'gpufrac.io/container.app.mig.profile="1g.6gb" is invalid: a MIG profile must be one that a'
        " supported GPU model has (the profiles are 1g.5gb, 1g.10gb,"
    )


def test_the_node_reads_what_the_webhook_stored_as_the_same_mig_request() -> None:
    """The node sees no resources: the stored annotations alone must carry the request."""
    stored = _mutated(_mig_pod({"limits": {"nvidia.com/mig-1g.18gb": "1"}}))
    annotations = stored["metadata"]["annotations"]
    (container,) = parse_pod(annotations, [ContainerSpec("app"), ContainerSpec("side")]).containers
    assert container.mig == MigRequest(profile="1g.18gb")
