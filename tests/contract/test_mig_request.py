"""MIG requests in the contract: both forms parse to one ``MigRequest``, the webhook's rewrite keeps its
meaning, the binder writes only the MIG devices and the node reads them back; every refusal names the
key, the value and the rule."""

from __future__ import annotations

import pytest

from gpufrac.contract import keys as k
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.parse import ContainerSpec, parse_pod, parse_pod_manifest
from gpufrac.contract.render import DeviceChoice, read_binding, render_binding
from gpufrac.contract.request import MigRequest
from gpufrac.contract.resize import resize_refusals
from gpufrac.contract.translate import apply_translation, translate

PROFILE, COUNT, MEMORY = (k.mig_key("app", s) for s in (k.MIG_PROFILE, k.MIG_COUNT, k.MIG_MEMORY))
APP = [ContainerSpec("app")]


def _messages(annotations: dict[str, str], containers: list[ContainerSpec] = APP) -> list[str]:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod(annotations, containers, user_written=True)
    return raised.value.messages


def _manifest(resources: dict[str, object], annotations: dict[str, str] | None = None) -> dict[str, object]:
    return {
        "metadata": {"annotations": annotations or {}},
        "spec": {"containers": [{"name": "app", "resources": resources}]},
    }


@pytest.mark.parametrize(
    ("annotations", "containers", "wanted"),
    [
        ({PROFILE: "1g.10gb"}, APP, MigRequest(profile="1g.10gb")),
        ({PROFILE: " 3g.40gb ", COUNT: "2"}, APP, MigRequest(profile="3g.40gb", count=2)),
        ({MEMORY: "20Gi"}, APP, MigRequest(min_mib=20480)),
        ({MEMORY: "20G", COUNT: "3"}, APP, MigRequest(min_mib=19074, count=3)),
        ({}, [ContainerSpec("app", mig=(("1g.18gb", 2),))], MigRequest(profile="1g.18gb", count=2)),
        # both forms, agreeing: the resource's count holds where the annotation names none
        ({PROFILE: "1g.10gb"}, [ContainerSpec("app", mig=(("1g.10gb", 2),))], MigRequest("1g.10gb", count=2)),
    ],
)
def test_both_forms_parse_to_one_mig_request(annotations, containers, wanted) -> None:
    (container,) = parse_pod(annotations, containers, user_written=True).containers
    assert container.mig == wanted
    assert (container.request, container.limit, container.exclusive) == (None, None, False)
    assert container.device_count == wanted.count


def test_the_resource_form_is_read_from_a_manifest() -> None:
    (container,) = parse_pod_manifest(_manifest({"limits": {"nvidia.com/mig-2g.20gb": 1}})).containers
    assert container.mig == MigRequest(profile="2g.20gb")
    (container,) = parse_pod_manifest(_manifest({"requests": {"nvidia.com/mig-2g.20gb": "2"}})).containers
    assert container.mig == MigRequest(profile="2g.20gb", count=2)


@pytest.mark.parametrize("amount", ["0", "500m", "-1", "two"])
def test_a_resource_count_that_is_not_a_whole_number_from_1_is_refused(amount: str) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_pod_manifest(_manifest({"limits": {"nvidia.com/mig-1g.10gb": amount}}))
    assert raised.value.messages == [
        f'spec.containers[app].resources.limits.nvidia.com/mig-1g.10gb="{amount}" is invalid: a MIG slice'
        " count must be a whole number from 1 to 256."
    ]


ONE_FORM = "a container's GPU request must be given in one form only"
OTHER = "a container asks for MIG slices or for other GPU keys (fractions, compute, whole GPUs), not both"
PROFILES = "a MIG profile must be one that a supported GPU model has (the profiles are 1g.5gb, 1g.10gb"
LIMITS = "spec.containers[app].resources.limits."


@pytest.mark.parametrize(
    ("annotations", "containers", "expected"),
    [
        ({PROFILE: "1g.6gb"}, APP, f'{PROFILE}="1g.6gb" is invalid: {PROFILES}'),
        (
            {},
            [ContainerSpec("app", mig=(("1g.6gb", 1),))],
            f'{LIMITS}nvidia.com/mig-1g.6gb="1" is invalid: {PROFILES}',
        ),
        (
            {MEMORY: "141Gi"},
            APP,
            f'{MEMORY}="141Gi" is invalid: the memory must fit in the largest MIG slice',
        ),
        ({MEMORY: "lots"}, APP, f'{MEMORY}="lots" is invalid: the value must be a Kubernetes quantity'),
        ({PROFILE: "1g.10gb", COUNT: "1.5"}, APP, f'{COUNT}="1.5" is invalid: a MIG slice count must be'),
        ({COUNT: "2"}, APP, f'{COUNT}="2" is invalid: the key only applies together with a GPU request'),
        (
            {PROFILE: "1g.10gb", MEMORY: "10Gi"},
            APP,
            f'{MEMORY}="10Gi" is invalid: {ONE_FORM} ({PROFILE} is also set',
        ),
        (
            {PROFILE: "2g.20gb"},
            [ContainerSpec("app", mig=(("1g.10gb", 1),))],
            f'{PROFILE}="2g.20gb" is invalid: {ONE_FORM} (container "app" has nvidia.com/mig-1g.10gb: 1)',
        ),
        (
            {PROFILE: "1g.10gb", COUNT: "3"},
            [ContainerSpec("app", mig=(("1g.10gb", 2),))],
            f'{COUNT}="3" is invalid: {ONE_FORM}',
        ),
        (
            {},
            [ContainerSpec("app", mig=(("1g.10gb", 1), ("2g.20gb", 1)))],
            f'{LIMITS}nvidia.com/mig-2g.20gb="1" is invalid: {ONE_FORM} (nvidia.com/mig-1g.10gb is also set;',
        ),
        (
            {PROFILE: "1g.10gb", "gpu-fraction": "0.5"},
            APP,
            f'{PROFILE}="1g.10gb" is invalid: {OTHER} (gpu-fraction is',
        ),
        (
            {PROFILE: "1g.10gb"},
            [ContainerSpec("app", gpus=1)],
            f"{OTHER} ({LIMITS}nvidia.com/gpu is also set)",
        ),
        (
            {PROFILE: "1g.10gb", k.whole_gpus_key("app"): "1"},
            APP,
            f"{OTHER} (gpufrac.io/container.app.gpus is",
        ),
        (
            {MEMORY: "8Gi", k.compute_mode_key("app"): "sm-sharing"},
            APP,
            f"{OTHER} ({k.compute_mode_key('app')} is",
        ),
        (
            {PROFILE: "1g.10gb", k.compute_request_key("app"): "0.5"},
            APP,
            f"({k.compute_request_key('app')} is",
        ),
    ],
)
def test_each_refusal_names_the_key_the_value_and_the_rule(annotations, containers, expected) -> None:
    messages = _messages(annotations, containers)
    assert len(messages) == 1, messages
    assert expected in messages[0]


@pytest.mark.parametrize(
    ("annotations", "other"),
    [
        ({k.memory_request_key("side"): "4Gi"}, ContainerSpec("side")),
        ({}, ContainerSpec("side", gpus=1)),
    ],
)
def test_a_mig_container_may_sit_beside_a_fractional_or_a_whole_gpu_container(annotations, other) -> None:
    request = parse_pod({PROFILE: "1g.10gb", **annotations}, [ContainerSpec("app"), other], user_written=True)
    app, side = request.containers
    assert (app.mig, side.mig) == (MigRequest(profile="1g.10gb"), None)
    assert side.exclusive == (other.gpus == 1)


def test_a_mig_container_has_no_memory_of_a_shared_gpu() -> None:
    (container,) = parse_pod({MEMORY: "20Gi"}, APP).containers
    with pytest.raises(ValueError, match="asks for MIG slices"):
        container.request_mib(81920)
    with pytest.raises(ValueError, match="asks for MIG slices"):
        container.limit_mib(81920)
    assert container.compute_portion_on(81920) is None


def test_mig_request_needs_exactly_one_of_profile_and_size() -> None:
    for bad in ({}, {"profile": "1g.10gb", "min_mib": 1}, {"profile": "1g.10gb", "count": 0}):
        with pytest.raises(ValueError):
            MigRequest(**bad)


def test_the_webhooks_rewrite_keeps_the_request_and_drops_the_resource() -> None:
    containers = [ContainerSpec("app", mig=(("3g.40gb", 2),)), ContainerSpec("one", mig=(("1g.10gb", 1),))]
    before = parse_pod({}, containers)
    translation = translate({}, containers, whole_gpus=True)
    assert translation.annotations == {
        PROFILE: "3g.40gb",
        COUNT: "2",
        k.mig_key("one", k.MIG_PROFILE): "1g.10gb",
    }
    assert translation.strip_mig_resource == ("app", "one")
    annotations, stripped = apply_translation({}, containers, translation)
    assert all(not c.mig for c in stripped)
    assert parse_pod(annotations, stripped) == before
    # not our scheduler's pod: the device plugin serves the resource as it is
    assert translate({}, containers, whole_gpus=False).empty


def test_the_binder_writes_the_mig_devices_and_the_node_reads_them_back() -> None:
    annotations = {PROFILE: "1g.10gb", COUNT: "2"}
    request = parse_pod(annotations, APP)
    written = render_binding(request, [DeviceChoice.on_gpu(request.containers[0], ("MIG-a", "MIG-b"), 81920)])
    assert written == {k.devices_key("app"): "MIG-a,MIG-b"}
    (bound,) = read_binding({**annotations, **written})
    assert (bound.devices, bound.mig, bound.exclusive) == (("MIG-a", "MIG-b"), True, False)
    assert (bound.request_mib, bound.limit_mib, bound.compute_portion) == (None, None, None)
    placed = parse_pod({**annotations, **written}, APP)
    assert placed.containers[0].devices == ("MIG-a", "MIG-b")


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({PROFILE: "1g.10gb"}, f'{k.devices_key("app")}="" is invalid: the container has no GPU assignment'),
        ({PROFILE: "1g.10gb", COUNT: "2", k.devices_key("app"): "MIG-a"}, "(1 assigned, 2 requested)"),
        (
            {MEMORY: "8Gi", k.devices_key("app"): "MIG-a", k.memory_limit_key("app"): "8Gi"},
            f'{MEMORY}="8Gi" is invalid: {OTHER} ({k.memory_limit_key("app")} is also set)',
        ),
    ],
)
def test_the_node_refuses_a_mig_binding_it_cannot_enforce(annotations, expected) -> None:
    with pytest.raises(InvalidPodRequest) as raised:
        read_binding(annotations)
    assert expected in raised.value.messages[0], raised.value.messages


def test_a_mig_container_is_not_resized() -> None:
    annotations = {PROFILE: "1g.10gb", k.resize_key("app", k.RESIZE_MEMORY_REQUEST): "2Gi"}
    request = parse_pod({PROFILE: "1g.10gb"}, APP)
    (refusal,) = resize_refusals(annotations, request, ["app"], bound=True)
    assert "holds MIG slices" in refusal.message
