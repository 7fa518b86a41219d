"""The webhook on resize requests: on a placed pod a user may write the resize keys of a fractional
container, nothing else of the contract; values are judged as at creation."""

from __future__ import annotations

from typing import Any

from admission_reviews import pod, review

from gpufrac.admission.review import DEFAULT_SCHEDULER_USER, AdmissionPolicy, validate_review
from gpufrac.contract import keys

POLICY = AdmissionPolicy()
REQ, LIM, DEV = keys.memory_request_key("app"), keys.memory_limit_key("app"), keys.devices_key("app")
R_REQ = keys.resize_key("app", keys.RESIZE_MEMORY_REQUEST)
BOUND = {REQ: "4096Mi", LIM: "4096Mi", DEV: "GPU-1"}


def placed(annotations: dict[str, str], node: str | None = "node-1") -> dict[str, Any]:
    manifest = pod(annotations)
    if node:
        manifest["spec"]["nodeName"] = node
    return manifest


def answer(
    new: dict[str, str], *, old: dict[str, str] = BOUND, node: str | None = "node-1", **kw: Any
) -> dict:
    reviewed = review(placed(new, node), operation="UPDATE", old=placed(old, node), **kw)
    return validate_review(reviewed, POLICY)["response"]


def test_a_user_may_set_change_and_remove_a_resize_request_on_a_placed_pod() -> None:
    assert answer({**BOUND, R_REQ: "8Gi"})["allowed"]
    assert answer({**BOUND, R_REQ: "6Gi"}, old={**BOUND, R_REQ: "8Gi"})["allowed"]
    assert answer(BOUND, old={**BOUND, R_REQ: "8Gi"})["allowed"]
    assert answer({**BOUND, keys.resize_key("app", keys.RESIZE_FRACTION): "0.5"})["allowed"]


def test_every_other_contract_key_stays_immutable_and_the_refusal_says_how_to_resize() -> None:
    grown = answer({**BOUND, REQ: "8Gi"})
    assert not grown["allowed"] and grown["status"]["code"] == 403
    assert f"to resize, set {R_REQ}" in grown["status"]["message"]
    mixed = answer({**BOUND, REQ: "8Gi", R_REQ: "8Gi"})
    assert not mixed["allowed"] and "cannot be changed" in mixed["status"]["message"]
    moved = answer({**BOUND, DEV: "GPU-2"})
    assert (
        not moved["allowed"] and "only the scheduler may set or change this key" in moved["status"]["message"]
    )
    mode = answer({**BOUND, keys.compute_mode_key("app"): "sm-sharing"})
    assert "compute mode and device count of a placed pod never change" in mode["status"]["message"]


def test_values_are_judged_as_at_creation() -> None:
    bad = answer({**BOUND, R_REQ: "4096"})
    assert not bad["allowed"] and bad["status"]["code"] == 422
    assert f'{R_REQ}="4096" is invalid: the amount must be at least 1 MiB' in bad["status"]["message"]
    below = answer({**BOUND, R_REQ: "8Gi", keys.resize_key("app", keys.RESIZE_MEMORY_LIMIT): "4Gi"})
    assert "the limit must be at least the request" in below["status"]["message"]


def test_nothing_to_resize_is_refused_clearly() -> None:
    pending = answer({REQ: "4Gi", R_REQ: "8Gi"}, old={REQ: "4Gi"}, node=None)
    assert not pending["allowed"] and "the pod is not placed yet" in pending["status"]["message"]
    side = answer({**BOUND, keys.resize_key("side", keys.RESIZE_MEMORY_REQUEST): "1Gi"})
    assert not side["allowed"] and 'container "side" asks for no GPU' in side["status"]["message"]
    whole_old = {keys.whole_gpus_key("app"): "1", DEV: "GPU-1"}
    whole = answer({**whole_old, R_REQ: "1Gi"}, old=whole_old)
    assert not whole["allowed"] and "holds whole GPUs" in whole["status"]["message"]
    created = validate_review(review(pod({REQ: "4Gi", R_REQ: "8Gi"})), POLICY)["response"]
    assert not created["allowed"] and "the pod is not placed yet" in created["status"]["message"]


def test_the_scheduler_writes_the_decided_amounts_and_clears_the_request() -> None:
    decided = {**BOUND, REQ: "8192Mi", LIM: "8192Mi"}
    assert answer(decided, old={**BOUND, R_REQ: "8Gi"}, user=DEFAULT_SCHEDULER_USER)["allowed"]


def test_a_compute_share_resize_is_allowed_only_on_an_sm_sharing_fraction() -> None:
    compute = keys.resize_key("app", keys.RESIZE_COMPUTE_REQUEST)
    sm = {**BOUND, keys.compute_mode_key("app"): "sm-sharing", keys.compute_portion_key("app"): "0.25"}
    assert answer({**sm, compute: "0.5"}, old=sm)["allowed"]
    refused = answer({**BOUND, compute: "0.5"})
    assert (
        not refused["allowed"]
        and "runs time-slicing, which reserves no compute share" in refused["status"]["message"]
    )
    invalid = answer({**sm, compute: "1.5"}, old=sm)
    assert (
        not invalid["allowed"]
        and "a compute portion must be a number greater than 0" in invalid["status"]["message"]
    )
