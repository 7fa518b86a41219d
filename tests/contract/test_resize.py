"""Resize requests (``gpufrac.io/container.<c>.resize.*``): parsed with creation's rules, refused where
nothing can be resized, and harmless to every reader of a bound pod."""

from __future__ import annotations

import pytest

from gpufrac.contract import keys as k
from gpufrac.contract.changes import forbidden_changes
from gpufrac.contract.errors import InvalidPodRequest
from gpufrac.contract.near_miss import near_miss_warnings
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.render import read_binding
from gpufrac.contract.resize import parse_resizes, resize_refusals

REQ, LIM, DEV = k.memory_request_key("app"), k.memory_limit_key("app"), k.devices_key("app")
R_REQ = k.resize_key("app", k.RESIZE_MEMORY_REQUEST)
R_LIM = k.resize_key("app", k.RESIZE_MEMORY_LIMIT)
R_FRAC = k.resize_key("app", k.RESIZE_FRACTION)
R_FRAC_LIM = k.resize_key("app", k.RESIZE_FRACTION_LIMIT)
R_COMPUTE = k.resize_key("app", k.RESIZE_COMPUTE_REQUEST)
BOUND = {REQ: "4096Mi", LIM: "4096Mi", DEV: "GPU-1"}


def messages(annotations: dict[str, str]) -> list[str]:
    with pytest.raises(InvalidPodRequest) as raised:
        parse_resizes(annotations)
    return raised.value.messages


def test_memory_asks_follow_creations_rules() -> None:
    (ask,) = parse_resizes({R_REQ: "8Gi", R_LIM: "12Gi"}).values()
    assert ask.resolve(81920) == (8192, 12288)
    (alone,) = parse_resizes({R_LIM: "1000M"}).values()  # a limit alone: request = limit, by ceiling
    assert alone.resolve(81920) == (954, 954)
    (request_only,) = parse_resizes({R_REQ: "6Gi"}).values()
    assert request_only.resolve(81920) == (6144, 6144)


def test_fraction_asks_resolve_on_the_pods_gpu() -> None:
    (ask,) = parse_resizes({R_FRAC: "0.25", R_FRAC_LIM: "0.5"}).values()
    assert ask.resolve(81559) == (20389, 40779)  # floor(portion x GPU MiB)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({R_REQ: "lots"}, f'{R_REQ}="lots" is invalid: the value must be a Kubernetes quantity'),
        ({R_REQ: "4096"}, f'{R_REQ}="4096" is invalid: the amount must be at least 1 MiB'),
        ({R_REQ: "8Gi", R_LIM: "4Gi"}, f'{R_LIM}="4Gi" is invalid: the limit must be at least the request'),
        ({R_FRAC: "1.5"}, f'{R_FRAC}="1.5" is invalid: a GPU fraction must be a number greater than 0'),
        ({R_FRAC: "0.5", R_FRAC_LIM: "0.4"}, f'{R_FRAC_LIM}="0.4" is invalid: a fraction limit must be'),
        ({R_FRAC_LIM: "0.4"}, f'{R_FRAC_LIM}="0.4" is invalid: the key only applies together with'),
        ({R_FRAC: "0.5", R_REQ: "1Gi"}, f'{R_FRAC}="0.5" is invalid: a container\'s GPU request must be'),
        ({R_COMPUTE: "1.5"}, f'{R_COMPUTE}="1.5" is invalid: a compute portion must be a number greater'),
        ({R_COMPUTE: "0", R_REQ: "1Gi"}, f'{R_COMPUTE}="0" is invalid: a compute portion must be'),
    ],
)
def test_invalid_asks_name_key_value_and_rule(annotations: dict[str, str], expected: str) -> None:
    (message,) = messages(annotations)
    assert message.startswith(expected), message


def test_resize_keys_are_contract_keys_the_node_and_the_parser_accept() -> None:
    annotations = {**BOUND, R_REQ: "8Gi"}
    (bound,) = read_binding(annotations)
    assert (bound.request_mib, bound.limit_mib) == (4096, 4096)  # the node reads the binding, not the ask
    parsed = parse_pod(annotations, [ContainerSpec("app")])
    assert parsed.containers[0].request is not None and parsed.containers[0].request.mib == 4096
    assert near_miss_warnings(annotations) == []
    with pytest.raises(InvalidPodRequest, match="did you mean"):
        parse_pod(
            {**BOUND, "gpufrac.io/container.app.resize.gpu-memory.requests": "8Gi"}, [ContainerSpec("app")]
        )


def test_who_may_write_resize_keys() -> None:
    # At creation nothing is placed: a resize key is refused.
    (created,) = forbidden_changes({}, {REQ: "1Gi", R_REQ: "2Gi"}, creating=True)
    assert "a resize applies only to a fractional GPU container of a pod that is already placed" in str(
        created
    )
    # On a placed pod the user may add, change and remove them; the bound keys stay immutable, and the
    # refusal says how to resize.
    assert forbidden_changes(BOUND, {**BOUND, R_REQ: "8Gi"}, creating=False, bound=True) == []
    assert forbidden_changes({**BOUND, R_REQ: "8Gi"}, BOUND, creating=False, bound=True) == []
    (grown,) = forbidden_changes(BOUND, {**BOUND, REQ: "8Gi"}, creating=False, bound=True)
    assert f"to resize, set {R_REQ}" in str(grown)
    (mode,) = forbidden_changes(
        BOUND, {**BOUND, k.compute_mode_key("app"): "sm-sharing"}, creating=False, bound=True
    )
    assert "the device list, compute mode and device count of a placed pod never change" in str(mode)
    (pending,) = forbidden_changes({REQ: "1Gi"}, {REQ: "1Gi", R_REQ: "2Gi"}, creating=False)
    assert "the pod is not placed yet" in str(pending)


def test_resize_refusals_name_what_cannot_be_resized() -> None:
    specs = [ContainerSpec("app"), ContainerSpec("side"), ContainerSpec("whole", gpus=1)]
    annotations = {
        **BOUND,
        R_REQ: "8Gi",
        k.resize_key("side", k.RESIZE_MEMORY_REQUEST): "1Gi",
        k.resize_key("whole", k.RESIZE_MEMORY_REQUEST): "1Gi",
        k.resize_key("nope", k.RESIZE_MEMORY_REQUEST): "1Gi",
    }
    request = parse_pod({REQ: "1Gi"}, [ContainerSpec("app"), ContainerSpec("side")])
    shown = [str(v) for v in resize_refusals(annotations, request, [s.name for s in specs], bound=True)]
    assert any('container "side" asks for no GPU' in m for m in shown)
    assert any("the pod has no container of that name" in m for m in shown)
    assert not any(R_REQ + "=" in m for m in shown)
    exclusive = parse_pod({}, [ContainerSpec("whole", gpus=1)])
    (whole,) = resize_refusals(
        {k.resize_key("whole", k.RESIZE_MEMORY_REQUEST): "1Gi"}, exclusive, ["whole"], bound=True
    )
    assert "holds whole GPUs" in str(whole)


def test_a_compute_ask_stands_alone_or_beside_a_memory_form() -> None:
    (alone,) = parse_resizes({R_COMPUTE: "0.5"}).values()
    assert (alone.compute, alone.resolve(81920)) == (0.5, None)  # the memory stays as bound
    (both,) = parse_resizes({R_COMPUTE: "1", R_FRAC: "0.25"}).values()
    assert (both.compute, both.resolve(81920)) == (1.0, (20480, 20480))


def test_a_compute_ask_needs_an_sm_sharing_container() -> None:
    shared = parse_pod({REQ: "1Gi"}, [ContainerSpec("app")])
    (refused,) = resize_refusals({R_COMPUTE: "0.5"}, shared, ["app"], bound=True)
    assert "runs time-slicing, which reserves no compute share" in str(refused)
    sm = parse_pod({REQ: "1Gi", k.compute_mode_key("app"): "sm-sharing"}, [ContainerSpec("app")])
    assert resize_refusals({R_COMPUTE: "0.5"}, sm, ["app"], bound=True) == []
    (edited,) = forbidden_changes(
        BOUND, {**BOUND, k.compute_request_key("app"): "0.5"}, creating=False, bound=True
    )
    assert f"set {R_COMPUTE} and the scheduler decides" in str(edited)
