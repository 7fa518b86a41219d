"""The webhook's decisions on AdmissionReviews, without a server: what a user creating a pod would see."""

from __future__ import annotations

import base64
import copy
import json

import pytest
from admission_reviews import apply_patch, binding_review, pod, review
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpufrac.admission.configuration import binding_match_expression, webhook_configurations
from gpufrac.admission.review import AdmissionPolicy, MalformedReview, mutate_review, validate_review
from gpufrac.contract import keys
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod, parse_pod_manifest

SCHEDULER = "system:serviceaccount:gpufrac-system:gpufrac-scheduler"
POLICY = AdmissionPolicy()
NV = "nvidia.com/container."
REQUIRES_GPUFRAC = '["gpufrac"]'


def mutated(obj: dict, policy: AdmissionPolicy = POLICY) -> dict:
    response = mutate_review(review(obj), policy)["response"]
    assert response["allowed"] is True and response["uid"] == "u-1"
    if "patch" not in response:
        return obj
    assert response["patchType"] == "JSONPatch"
    return apply_patch(obj, json.loads(base64.b64decode(response["patch"])))


def test_a_legacy_gpu_memory_pod_is_stored_with_per_container_keys() -> None:
    original = pod({"gpu-memory": "4096", "gpu-memory.limit": "8Gi", "gpu-fraction-container-name": "side"})
    stored = mutated(original)
    assert stored["metadata"]["annotations"] == {
        f"{NV}side.gpu-memory.request": "4096Mi",
        f"{NV}side.gpu-memory.limit": "8192Mi",
        keys.nri_required_plugins_key("side"): REQUIRES_GPUFRAC,
    }
    assert parse_pod_manifest(stored) == parse_pod_manifest(original)


def test_whole_gpus_of_our_pods_become_exclusive_requests_with_the_managed_toleration() -> None:
    stored = mutated(pod(gpus=2))
    app = stored["spec"]["containers"][0]
    assert app["resources"]["limits"] == {"cpu": "1"}
    assert stored["metadata"]["annotations"] == {
        "gpufrac.io/container.app.gpus": "2",
        keys.nri_required_plugins_key("app"): REQUIRES_GPUFRAC,
    }
    assert stored["spec"]["tolerations"] == [
        {"key": "gpufrac.io/managed", "operator": "Exists", "effect": "NoSchedule"}
    ]
    (container,) = parse_pod_manifest(stored).containers
    assert (container.container, container.exclusive, container.device_count) == ("app", True, 2)


def test_fractional_pods_of_our_scheduler_get_the_toleration_once() -> None:
    fractional = pod({"gpu-fraction": "0.5"})
    fractional["spec"]["tolerations"] = [{"key": "other", "operator": "Exists"}]
    stored = mutated(fractional)
    assert stored["spec"]["tolerations"][-1]["key"] == "gpufrac.io/managed"
    assert stored["metadata"]["annotations"] == {  # a portion stays as written
        "gpu-fraction": "0.5",
        keys.nri_required_plugins_key("app"): REQUIRES_GPUFRAC,
    }
    assert mutated(stored) == stored


def test_every_container_the_node_enforces_requires_the_gpufrac_nri_plugin_whatever_the_user_wrote() -> None:
    # NRI's validator in containerd then refuses these containers while the node agent is away.
    opted_out = pod({f"{NV}app.gpu-memory.request": "1Gi", keys.nri_required_plugins_key("app"): "[]"})
    stored = mutated(opted_out)["metadata"]["annotations"]
    assert stored[keys.nri_required_plugins_key("app")] == REQUIRES_GPUFRAC
    assert keys.nri_required_plugins_key("side") not in stored  # asks for no GPU: nothing required


def test_whole_gpu_pods_of_other_schedulers_are_left_to_the_device_plugin() -> None:
    other = pod(gpus=1, scheduler="default-scheduler")
    assert mutated(other) == other


def test_a_contract_pod_of_another_scheduler_requires_the_node_agent_too() -> None:
    stored = mutated(pod({f"{NV}app.gpu-memory.request": "4Gi"}, scheduler="kai-scheduler"))
    assert stored["metadata"]["annotations"][keys.nri_required_plugins_key("app")] == '["gpufrac"]'


def test_scoped_required_plugin_lists_of_the_user_cannot_hide_the_node_agent() -> None:
    # NRI reads <key>/container.<c> first, then <key>/pod, then <key>: the container's own key, which the
    # webhook always writes, decides; a tenant's "[]" there is replaced, its other lists are left alone.
    stored = mutated(
        pod(
            {
                "gpu-fraction": "0.5",
                "required-plugins.noderesource.dev/container.app": "[]",
                "required-plugins.noderesource.dev/pod": "[audit]",
                "required-plugins.noderesource.dev": '["audit"]',
            }
        )
    )
    annotations = stored["metadata"]["annotations"]
    assert annotations["required-plugins.noderesource.dev/container.app"] == '["gpufrac"]'
    assert annotations["required-plugins.noderesource.dev/pod"] == "[audit]"
    assert mutated(stored) == stored


def test_a_renamed_node_agent_plugin_is_the_one_required() -> None:
    stored = mutated(pod({"gpu-fraction": "0.5"}), AdmissionPolicy(nri_plugins=("gpufrac-b",)))
    assert stored["metadata"]["annotations"][keys.nri_required_plugins_key("app")] == '["gpufrac-b"]'


def test_the_configured_plugins_are_all_required_of_every_enforced_container() -> None:
    """Where nodes run the agent's validator, GPU containers require it too (``--required-nri-plugin``):
    containerd then refuses them while the validator is away, not only while the agent is. A container
    the agent does not enforce requires nothing."""
    both = AdmissionPolicy(nri_plugins=(keys.NRI_PLUGIN_NAME, keys.NRI_VALIDATOR_PLUGIN_NAME))
    two = pod({"nvidia.com/container.app.gpu-memory.request": "1Gi"})
    two["spec"]["containers"].append({"name": "sidecar", "image": "x"})
    annotations = mutated(two, both)["metadata"]["annotations"]
    assert json.loads(annotations[keys.nri_required_plugins_key("app")]) == ["gpufrac", "gpufrac-validator"]
    assert keys.nri_required_plugins_key("sidecar") not in annotations


@pytest.mark.parametrize(
    "obj",
    [
        pod(),
        pod({"team": "a"}),
        pod({"gpu-fraction": "7"}),  # invalid: passed through, the validating webhook names the key
    ],
    ids=["no GPU", "unrelated annotation", "invalid"],
)
def test_pods_without_a_valid_gpu_ask_are_not_touched(obj: dict) -> None:
    response = mutate_review(review(obj), POLICY)["response"]
    assert response == {"uid": "u-1", "allowed": True}


def denied(answer: dict) -> tuple[int, str]:
    response = answer["response"]
    assert response["allowed"] is False
    return response["status"]["code"], response["status"]["message"]


def test_a_valid_pod_is_admitted() -> None:
    assert validate_review(review(pod({"gpu-fraction": "0.5"})), POLICY)["response"] == {
        "uid": "u-1",
        "allowed": True,
    }


def test_an_invalid_pod_is_rejected_with_every_contract_message() -> None:
    answer = validate_review(review(pod({"gpu-fraction": "1.5", f"{NV}app.gpu-compute.mode": ""})), POLICY)
    code, message = denied(answer)
    assert code == 422
    assert message == (
        'gpu-fraction="1.5" is invalid: a GPU fraction must be a number greater than 0 and less than 1 '
        "(ask for whole GPUs with nvidia.com/gpu). "
        'nvidia.com/container.app.gpu-compute.mode="" is invalid: the compute mode must be time-slicing or '
        "sm-sharing (blank is not allowed)."
    )


def test_only_the_scheduler_may_create_a_pod_with_binder_owned_keys() -> None:
    forged = pod({f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1"})
    code, message = denied(validate_review(review(forged, user="alice"), POLICY))
    assert (code, message) == (
        422,
        'nvidia.com/container.app.gpus.devices="GPU-1" is invalid: '
        "only the scheduler may set or change this key.",
    )
    assert validate_review(review(forged, user=SCHEDULER), POLICY)["response"]["allowed"] is True
    other = AdmissionPolicy(binder_users=frozenset({"kai"}))
    assert validate_review(review(forged, user="kai"), other)["response"]["allowed"] is True


def test_updates_may_not_change_the_request_and_only_the_scheduler_may_bind() -> None:
    created = pod({f"{NV}app.gpu-memory.request": "1Gi"})
    bound = pod({f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1"})
    grown = pod({f"{NV}app.gpu-memory.request": "2Gi"})

    code, message = denied(validate_review(review(bound, operation="UPDATE", old=created), POLICY))
    assert code == 403 and "only the scheduler may set or change this key" in message
    code, message = denied(validate_review(review(grown, operation="UPDATE", old=created), POLICY))
    assert code == 403 and "cannot be changed" in message
    code, message = denied(validate_review(review(created, operation="UPDATE", old=bound), POLICY))
    assert "it was removed" in message

    by_scheduler = review(bound, operation="UPDATE", old=created, user=SCHEDULER)
    assert validate_review(by_scheduler, POLICY)["response"]["allowed"] is True
    broken = pod({f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1,GPU-2"})
    assert denied(validate_review(review(broken, operation="UPDATE", old=created, user=SCHEDULER), POLICY))


def test_updates_that_leave_the_contract_alone_pass_even_for_old_invalid_pods() -> None:
    old = pod({"gpu-fraction": "7"})  # predates the webhook
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"x": "y"}
    relabelled["metadata"]["finalizers"] = []
    assert (
        validate_review(review(relabelled, operation="UPDATE", old=old), POLICY)["response"]["allowed"]
        is True
    )


def test_other_kinds_and_subresources_pass() -> None:
    other = review(pod({"gpu-fraction": "7"}))
    other["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    assert validate_review(other, POLICY)["response"]["allowed"] is True
    binding = review(pod({"gpu-fraction": "7"}))
    binding["request"]["subResource"] = "binding"
    assert validate_review(binding, POLICY)["response"]["allowed"] is True


def test_only_the_scheduler_may_bind_with_binder_owned_keys() -> None:
    devices = {f"{NV}app.gpus.devices": "GPU-1", "team": "a"}
    code, message = denied(validate_review(binding_review(devices, user="alice"), POLICY))
    assert (code, message) == (
        403,
        'nvidia.com/container.app.gpus.devices="GPU-1" is invalid: '
        "only the scheduler may set or change this key.",
    )
    assert validate_review(binding_review(devices, user=SCHEDULER), POLICY)["response"] == {
        "uid": "u-1",
        "allowed": True,
    }
    other = AdmissionPolicy(binder_users=frozenset({"kai"}))
    assert validate_review(binding_review(devices, user="kai"), other)["response"]["allowed"] is True
    assert denied(validate_review(binding_review(devices, user=SCHEDULER), other))


def test_a_binding_may_not_change_the_request_either() -> None:
    grown = {f"{NV}app.gpu-memory.request": "80Gi", f"{NV}app.gpu-compute.portion": "1"}
    code, message = denied(validate_review(binding_review(grown), POLICY))
    assert code == 403
    assert message == (
        'nvidia.com/container.app.gpu-compute.portion="1" is invalid: '
        "only the scheduler may set or change this key. "
        'nvidia.com/container.app.gpu-memory.request="80Gi" is invalid: '
        "the GPU request of an existing pod cannot be changed; create a new pod instead."
    )


@pytest.mark.parametrize("annotations", [None, {}, {"team": "a"}], ids=["none", "empty", "unrelated"])
def test_bindings_without_contract_keys_pass_whoever_binds(annotations: dict | None) -> None:
    answer = validate_review(binding_review(annotations, user="system:kube-scheduler"), POLICY)
    assert answer["response"] == {"uid": "u-1", "allowed": True}


def test_the_binding_webhook_sees_only_bindings_that_carry_contract_keys() -> None:
    _, validating = webhook_configurations(name="g", ca_bundle=b"ca", url="https://127.0.0.1:8443")
    pods, bindings = validating["webhooks"]
    assert pods["rules"][0]["resources"] == ["pods"]
    assert bindings["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": [resource],
            "scope": "Namespaced",
        }
        for resource in ("pods/binding", "bindings")  # both endpoints that create a Binding
    ]
    assert bindings["failurePolicy"] == "Fail"
    assert bindings["clientConfig"]["url"] == "https://127.0.0.1:8443/validate"
    assert bindings["matchConditions"] == [{"name": "gpu-bindings", "expression": binding_match_expression()}]
    expression = binding_match_expression()
    assert expression.startswith("(has(object.metadata.annotations) && object.metadata.annotations.exists(")
    assert "key.startsWith('nvidia.com/container.')" in expression


def namespaced_binding_review(annotations: dict[str, str], *, user: str) -> dict:
    """CREATE of the namespaced ``bindings`` resource (``POST /api/v1/namespaces/ns/bindings``): no
    subresource, resource ``bindings``."""
    answer = binding_review(annotations, user=user)
    answer["request"]["resource"] = {"group": "", "version": "v1", "resource": "bindings"}
    del answer["request"]["subResource"]
    return answer


def test_a_binding_posted_to_the_namespaced_bindings_endpoint_is_judged_as_one() -> None:
    devices = {f"{NV}app.gpus.devices": "GPU-1"}
    code, message = denied(validate_review(namespaced_binding_review(devices, user="alice"), POLICY))
    assert (code, message) == (
        403,
        'nvidia.com/container.app.gpus.devices="GPU-1" is invalid: '
        "only the scheduler may set or change this key.",
    )
    by_scheduler = namespaced_binding_review(devices, user=SCHEDULER)
    assert validate_review(by_scheduler, POLICY)["response"]["allowed"] is True


def status_review(obj: dict, *, old: dict, user: str) -> dict:
    """UPDATE of ``pods/status`` (a status patch), as the API server sends it: the whole pod, old and new."""
    answer = review(obj, operation="UPDATE", old=old, user=user)
    answer["request"]["subResource"] = "status"
    return answer


def test_a_status_write_may_not_change_contract_keys_except_by_the_scheduler() -> None:
    created = pod({f"{NV}app.gpu-memory.request": "1Gi"})
    forged = pod({f"{NV}app.gpu-memory.request": "1Gi", f"{NV}app.gpus.devices": "GPU-1"})
    grown = pod({f"{NV}app.gpu-memory.request": "300Gi"})
    code, message = denied(validate_review(status_review(forged, old=created, user="system:node:n1"), POLICY))
    assert (code, message) == (
        403,
        'nvidia.com/container.app.gpus.devices="GPU-1" is invalid: '
        "only the scheduler may set or change this key.",
    )
    code, message = denied(validate_review(status_review(grown, old=created, user="alice"), POLICY))
    assert code == 403 and "cannot be changed" in message
    assert validate_review(status_review(forged, old=created, user=SCHEDULER), POLICY)["response"]["allowed"]

    running = copy.deepcopy(created)
    running["status"] = {"phase": "Running"}
    assert validate_review(status_review(running, old=created, user="system:node:n1"), POLICY)["response"][
        "allowed"
    ]


def test_a_pod_whose_long_container_name_the_scheduler_could_not_write_is_refused_at_creation() -> None:
    name = "tokenizer-and-embedding-server-east"  # 35 characters: its request key would have 64
    long_named = pod({"gpu-fraction": "0.5"})
    long_named["spec"]["containers"][0]["name"] = name
    code, message = denied(validate_review(review(long_named), POLICY))
    assert code == 422
    assert message.startswith(f'spec.containers[{name}].name="{name}" is invalid: ')
    assert f"nvidia.com/container.{name}.gpu-memory.request" in message
    assert "the name part must be no more than 63 characters, it has 64" in message
    assert mutated(long_named) == long_named  # passed through untouched for the validating webhook

    whole = pod(gpus=1)
    whole["spec"]["containers"][0]["name"] = "a" * 49  # even the webhook's own gpufrac.io key would break
    code, message = denied(validate_review(review(mutated(whole)), POLICY))
    assert "at most 40 characters" in message


@pytest.mark.parametrize(
    ("document", "complaint"),
    [
        ([], "an AdmissionReview is a JSON object"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}, "expected apiVersion"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "request must be an object"),
        (
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 7}},
            "request.uid must be a string, got 7",
        ),
    ],
)
def test_a_malformed_review_is_refused_with_what_is_wrong(document: object, complaint: str) -> None:
    with pytest.raises(MalformedReview, match=complaint):
        validate_review(document, POLICY)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        (("spec", "containers"), "app", "request.object.spec.containers must be an array, got 'app'"),
        (("spec", "containers"), ["app"], "request.object.spec.containers[0] must be an object"),
        (
            ("metadata", "annotations"),
            {"gpu-fraction": 0.5},
            "annotations values must be strings (quote numbers in YAML), got 0.5",
        ),
        (("spec",), [], "request.object.spec must be an object, got []"),
    ],
)
def test_a_pod_of_the_wrong_shape_is_refused_not_crashed_on(
    path: tuple[str, ...], value: object, complaint: str
) -> None:
    document = review(pod({"gpu-fraction": "0.5"}))
    target = document["request"]["object"]
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    for answer in (validate_review, mutate_review):
        with pytest.raises(MalformedReview) as raised:
            answer(document, POLICY)
        assert complaint in str(raised.value)


def _mutated(manifest: dict, policy: AdmissionPolicy | None = None) -> tuple[dict, dict]:
    answer = mutate_review(review(manifest), policy or AdmissionPolicy())["response"]
    patch = json.loads(base64.b64decode(answer["patch"])) if "patch" in answer else []
    return apply_patch(manifest, patch), answer


def test_a_fraction_that_names_no_scheduler_gets_ours_unless_it_opts_out_or_names_another() -> None:
    stored, _ = _mutated(pod({"gpu-fraction": "0.5"}, scheduler="default-scheduler"))
    assert stored["spec"]["schedulerName"] == "gpufrac-scheduler"
    assert any(t["key"] == "gpufrac.io/managed" for t in stored["spec"]["tolerations"])
    opted_out = {"gpu-fraction": "0.5", "gpufrac.io/keep-scheduler-name": "true"}
    for manifest, policy in (
        (pod(opted_out, scheduler="default-scheduler"), None),
        (pod({"gpu-fraction": "0.5"}, scheduler="kai-scheduler"), None),
        (
            pod({"gpu-fraction": "0.5"}, scheduler="default-scheduler"),
            AdmissionPolicy(set_scheduler_name=False),
        ),
        (pod(None, gpus=1, scheduler="default-scheduler"), None),  # whole GPUs: the device plugin's
    ):
        stored, _ = _mutated(manifest, policy)
        assert stored["spec"]["schedulerName"] == manifest["spec"]["schedulerName"]


def test_a_misspelled_key_gets_an_admission_warning_naming_the_key_meant() -> None:
    _, answer = _mutated(pod({"gpu-fraction-num-device": "2", "gpu-fraction": "0.5"}))
    assert answer["allowed"] is True
    assert answer["warnings"] == [
        'annotation "gpu-fraction-num-device" is not a key gpufrac reads (it is ignored): '
        'did you mean "gpu-fraction-num-devices"?'
    ]
    _, answer = _mutated(pod({"gpu-fraction": "0.5"}))
    assert "warnings" not in answer


@st.composite
def gpu_pods(draw: st.DrawFn) -> dict:
    """Pods of two containers in the request forms the mutating webhook rewrites: per-container MiB and
    the whole-GPU marker, MIG profiles, pod-level fractions and legacy MiB, ``nvidia.com/gpu`` resources."""
    annotations: dict[str, str] = {}
    manifest = pod(
        annotations,
        gpus=draw(st.sampled_from([0, 0, 1, 2])),
        scheduler=draw(st.sampled_from(["gpufrac-scheduler", "default-scheduler", "other"])),
    )
    pod_level = draw(st.sampled_from(["none", "gpu-fraction", "gpu-memory"]))
    if pod_level == "gpu-fraction":
        annotations["gpu-fraction"] = "0.5"
    elif pod_level == "gpu-memory":
        annotations["gpu-memory"] = "4096"
    if pod_level != "none" and draw(st.booleans()):
        annotations["gpu-fraction-container-name"] = draw(st.sampled_from(["app", "side"]))
    for name in ("app", "side"):
        form = draw(st.sampled_from(["none", "none", "mib", "marker", "mig"]))
        if form == "mib":
            annotations[keys.memory_request_key(name)] = "2Gi"
        elif form == "marker":
            annotations[keys.whole_gpus_key(name)] = "1"
        elif form == "mig":
            annotations[keys.mig_key(name, keys.MIG_PROFILE)] = "1g.10gb"
    return manifest


@settings(max_examples=300, deadline=None)
@given(original=gpu_pods())
def test_the_plugins_are_required_of_exactly_the_containers_the_node_will_enforce(original: dict) -> None:
    """The mutating webhook parses a pod once and derives the NRI requirement from that parse; the node
    parses the stored annotations alone (it sees no resources). Both must name the same containers."""
    try:
        parse_pod_manifest(original)
    except InvalidPodRequest:
        assume(False)  # the validating webhook refuses it; the mutating one leaves it alone
    stored = mutated(original)
    annotations = stored["metadata"].get("annotations") or {}
    required = {name for name in ("app", "side") if keys.nri_required_plugins_key(name) in annotations}
    on_node = parse_pod(annotations, [ContainerSpec("app"), ContainerSpec("side")])
    assert required == {c.container for c in on_node.containers}
