"""Properties of the contract over pods hypothesis makes up.

* Whatever annotations a user writes, parsing answers with a request or with the contract's own error,
  never with a crash (the webhook would answer 500 and, with failurePolicy Fail, block the pod).
* parse -> render -> parse is stable: a bound pod means what the scheduler booked, and re-rendering it
  changes nothing (a restarted scheduler rebuilds the same ledger).
* read_binding(render_binding(placement)) == placement: the node enforces exactly what was placed.
* The webhook's translation to per-container keys never changes what a pod asks for.
* No string at all, however long or in whatever script, makes the quantity parser or the pod parser
  raise anything but the contract's own errors.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.contract import keys as k
from gpufrac.contract.errors import ContractError, InvalidPodRequest, RuleViolation
from gpufrac.contract.parse import ContainerSpec, parse_pod
from gpufrac.contract.quantities import parse_bytes, parse_mib
from gpufrac.contract.render import BoundContainer, DeviceChoice, read_binding, render_binding
from gpufrac.contract.request import ComputeMode
from gpufrac.contract.translate import apply_translation, translate
from gpufrac.contract.writable import binder_keys
from gpufrac.mig.profiles import KNOWN_PROFILES

# The last name is the longest whose keys the scheduler can write in every mode (sm-sharing: 33).
NAMES = ["app", "side", "train", "trainer", "l" * 33]

_containers = st.lists(
    st.builds(
        ContainerSpec,
        name=st.sampled_from(NAMES),
        gpus=st.sampled_from([0, 0, 0, 1, 2]),
        mig=st.sampled_from(
            [(), (), (), (("1g.10gb", 1),), (("3g.40gb", 2), ("1g.5gb", 1)), (("9g.1gb", 1),)]
        ),
    ),
    max_size=3,
    unique_by=lambda c: c.name,
)
_suffixes = st.sampled_from(
    [
        *k.NVIDIA_CONTAINER_SUFFIXES,
        k.PORTION_LIMIT,
        k.WHOLE_GPUS,
        *k.MIG_SUFFIXES,
        "gpu-memory",
        "",
        "gpus.devices.x",
    ]
)
_key = st.one_of(
    st.builds(
        lambda prefix, container, suffix: f"{prefix}{container}.{suffix}",
        st.sampled_from(k.CONTAINER_PREFIXES),
        st.one_of(st.sampled_from([*NAMES, ""]), st.text(max_size=5)),
        st.one_of(_suffixes, st.text(max_size=8)),
    ),
    st.sampled_from(k.POD_LEVEL_KEYS),
    st.text(max_size=20),
)
_value = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "1",
            "-1",
            "0.5",
            "1.5",
            "NaN",
            "inf",
            "-inf",
            "1e308",
            "1e-308",
            "40Gi",
            "1000M",
            "4096",
            "0.99999999",
            "1e999",
            "sm-sharing",
            "time-slicing",
            "GPU-a,GPU-b",
            "GPU-a,,",
            "app",
            "side",
            "2",
            "257",
            "1_0",
            "٣",
            "1Ei",
            "9" * 400,
            "+0.5",
            ".5",
            "5.",
            "0x10",
            "1g.10gb",
            "7g.141gb",
        ]
    ),
    st.text(max_size=12),
)


@settings(max_examples=400, deadline=None)
@given(annotations=st.dictionaries(_key, _value, max_size=8), containers=_containers, user=st.booleans())
def test_arbitrary_annotations_raise_only_contract_errors(
    annotations: dict[str, str], containers: list[ContainerSpec], user: bool
) -> None:
    try:
        request = parse_pod(annotations, containers, user_written=user)
    except InvalidPodRequest as invalid:
        for violation in invalid.errors:
            assert violation.key in violation.message
            assert violation.message.endswith(".")
        return
    names = {c.name for c in containers}
    assert all(c.container in names for c in request.containers)
    try:
        translate(annotations, containers, whole_gpus=True)
    except ContractError as error:  # pragma: no cover - a valid pod must translate
        raise AssertionError(f"valid pod failed to translate: {error}") from error


def _quantity(mib: int, style: int) -> str:
    if style == 1 and mib % 1024 == 0:
        return f"{mib // 1024}Gi"
    if style == 2:
        return str(mib * (1 << 20))
    return f"{mib}Mi"


@st.composite
def valid_pods(draw: Any) -> tuple[dict[str, str], list[ContainerSpec]]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    kind = draw(st.sampled_from(["explicit", "fraction", "memory", "whole", "mig"]))
    annotations: dict[str, str] = {}
    gpus = dict.fromkeys(names, 0)
    mig: dict[str, tuple[tuple[str, int], ...]] = dict.fromkeys(names, ())
    fractional: list[str] = []
    if kind == "explicit":
        fractional = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
        for name in fractional:
            request = draw(st.integers(1, 200_000))
            extra = draw(st.one_of(st.none(), st.integers(0, 50_000)))
            style = draw(st.integers(0, 2))
            if extra is None or draw(st.booleans()):
                annotations[k.memory_request_key(name)] = _quantity(request, style)
            if extra is not None:
                annotations[k.memory_limit_key(name)] = _quantity(request + extra, style)
    elif kind in ("fraction", "memory"):
        target = draw(st.sampled_from(names))
        if target != names[0] or draw(st.booleans()):
            annotations[k.GPU_FRACTION_CONTAINER_NAME] = target
        fractional = [target]
        if kind == "fraction":
            percent = draw(st.integers(1, 98))
            annotations[k.GPU_FRACTION] = str(percent / 100)
            if draw(st.booleans()):
                limit_key = draw(st.sampled_from([k.GPU_FRACTION_LIMIT, k.portion_limit_key(target)]))
                annotations[limit_key] = str(draw(st.integers(percent + 1, 99)) / 100)
        else:
            memory = draw(st.integers(1, 100_000))
            annotations[k.GPU_MEMORY] = str(memory)
            if draw(st.booleans()):
                annotations[k.GPU_MEMORY_LIMIT] = f"{memory + draw(st.integers(0, 9999))}Mi"
    elif kind == "mig":
        for name in draw(st.lists(st.sampled_from(names), min_size=1, unique=True)):
            form = draw(st.sampled_from(["resource", "profile", "memory"]))
            count = draw(st.integers(1, 4))
            if form == "resource":
                mig[name] = ((draw(st.sampled_from(sorted(KNOWN_PROFILES))), count),)
            elif form == "profile":
                annotations[k.mig_key(name, k.MIG_PROFILE)] = draw(st.sampled_from(sorted(KNOWN_PROFILES)))
            else:
                annotations[k.mig_key(name, k.MIG_MEMORY)] = _quantity(draw(st.integers(1, 130_000)), 0)
            if form != "resource" and (count > 1 or draw(st.booleans())):
                annotations[k.mig_key(name, k.MIG_COUNT)] = str(count)
    else:
        for name in draw(st.lists(st.sampled_from(names), min_size=1, unique=True)):
            gpus[name] = draw(st.integers(1, 8))
            if draw(st.booleans()):
                annotations[k.whole_gpus_key(name)] = str(gpus[name])
                if draw(st.booleans()):
                    gpus[name] = 0
    if fractional and draw(st.booleans()):
        annotations[k.GPU_FRACTION_NUM_DEVICES] = str(draw(st.integers(1, 8)))
    for name in names:
        asks = name in fractional or gpus[name] or k.whole_gpus_key(name) in annotations
        if asks and draw(st.booleans()):
            annotations[k.compute_mode_key(name)] = draw(st.sampled_from(["time-slicing", "sm-sharing"]))
    return annotations, [ContainerSpec(name=n, gpus=gpus[n], mig=mig[n]) for n in names]


@settings(max_examples=300, deadline=None)
@given(pod=valid_pods(), gpu_mib=st.integers(1024, 196_608), data=st.data())
def test_parse_render_parse_is_stable(
    pod: tuple[dict[str, str], list[ContainerSpec]], gpu_mib: int, data: Any
) -> None:
    annotations, containers = pod
    first = parse_pod(annotations, containers, user_written=True)
    assert first.wants_gpu
    placements = []
    for container in first.containers:
        start = data.draw(st.integers(0, 16))
        devices = tuple(
            f"GPU-{container.container}-{i}" for i in range(start, start + container.device_count)
        )
        placements.append(DeviceChoice.on_gpu(container, devices, gpu_mib))

    rendered = render_binding(first, placements)
    assert all(key.startswith((k.NVIDIA_CONTAINER_PREFIX, k.GPUFRAC_CONTAINER_PREFIX)) for key in rendered)
    assert all(k.annotation_key_problem(key) is None for key in rendered)
    assert set(rendered) == {key for container in first.containers for key in binder_keys(container)}
    bound = {**annotations, **rendered}
    second = parse_pod(bound, containers)
    assert render_binding(second, placements) == rendered
    assert parse_pod({**bound, **render_binding(second, placements)}, containers) == second

    for before, after, placement in zip(first.containers, second.containers, placements, strict=True):
        assert after.container == before.container
        assert after.devices == placement.devices
        assert (after.mode, after.device_count, after.exclusive) == (
            before.mode,
            before.device_count,
            before.exclusive,
        )
        if before.mig is not None:  # slices: no memory of a shared GPU to compare
            assert after.mig == before.mig
            continue
        assert after.request_mib(gpu_mib) == before.request_mib(gpu_mib)
        assert after.limit_mib(gpu_mib) == max(before.request_mib(gpu_mib), before.limit_mib(gpu_mib))


@settings(max_examples=300, deadline=None)
@given(pod=valid_pods(), gpu_mib=st.integers(1024, 196_608), data=st.data())
def test_read_binding_is_the_inverse_of_render_binding(
    pod: tuple[dict[str, str], list[ContainerSpec]], gpu_mib: int, data: Any
) -> None:
    annotations, containers = pod
    # What the API server holds after our webhook (whole GPUs marked per container), then bound.
    stored, stored_containers = apply_translation(
        annotations, containers, translate(annotations, containers, whole_gpus=True)
    )
    request = parse_pod(stored, stored_containers)
    choices, placed = [], []
    for c in request.containers:
        start = data.draw(st.integers(0, 16))
        devices = tuple(f"GPU-{c.container}-{i}" for i in range(start, start + c.device_count))
        chosen = None
        if c.mode is ComputeMode.SM_SHARING:
            chosen = data.draw(st.one_of(st.none(), st.floats(1e-6, 1.0)))
        choices.append(DeviceChoice.on_gpu(c, devices, gpu_mib, compute_portion=chosen))
        portion = None
        if c.mode is ComputeMode.SM_SHARING:
            portion = chosen if chosen is not None else c.compute_portion_on(gpu_mib)
        if c.mig is not None:
            placed.append(BoundContainer(c.container, devices, c.mode, None, None, None, False, mig=True))
            continue
        placed.append(
            BoundContainer(
                container=c.container,
                devices=devices,
                mode=c.mode,
                request_mib=None if c.exclusive else c.request_mib(gpu_mib),
                limit_mib=None if c.exclusive else max(c.request_mib(gpu_mib), c.limit_mib(gpu_mib)),
                compute_portion=portion,
                exclusive=c.exclusive,
            )
        )
    bound = {**stored, **render_binding(request, choices)}
    assert read_binding(bound) == tuple(sorted(placed, key=lambda b: b.container))


@settings(max_examples=300, deadline=None)
@given(pod=valid_pods(), ours=st.booleans())
def test_translation_keeps_the_request(pod: tuple[dict[str, str], list[ContainerSpec]], ours: bool) -> None:
    annotations, containers = pod
    translation = translate(annotations, containers, whole_gpus=ours)
    stored, stored_containers = apply_translation(annotations, containers, translation)
    assert parse_pod(stored, stored_containers) == parse_pod(annotations, containers)
    assert k.GPU_MEMORY not in stored
    if ours:
        assert all(c.gpus == 0 and not c.mig for c in stored_containers)
    assert translate(stored, stored_containers, whole_gpus=ours).empty


# Strings that reach the numeric paths: long digit runs (past Python's 4,300-digit int limit), digits of
# other scripts, exponents, suffixes, and anything at all.
_any_text = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(categories=["Nd"]), min_size=1, max_size=8),
    st.builds(
        lambda sign, digits, dot, tail, suffix: f"{sign}{digits}{dot}{tail}{suffix}",
        st.sampled_from(["", "+", "-"]),
        st.integers(1, 6000).map(lambda n: "9" * n),
        st.sampled_from(["", "."]),
        st.sampled_from(["", "5", "0" * 5000]),
        st.sampled_from(["", "Gi", "Ei", "e9", "e-9", "m", "x", "\u0665"]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(text=_any_text)
def test_no_string_makes_the_quantity_parser_raise_anything_but_a_rule_violation(text: str) -> None:
    for parse in (parse_bytes, parse_mib):
        try:
            parse(text, key="nvidia.com/container.app.gpu-memory.request")
        except RuleViolation as violation:
            assert violation.message.startswith('nvidia.com/container.app.gpu-memory.request="')
            assert len(violation.message) < 1000


@settings(max_examples=300, deadline=None)
@given(
    annotations=st.dictionaries(_key, _any_text, max_size=6),
    names=st.lists(st.one_of(st.sampled_from(NAMES), st.text(max_size=70)), max_size=3, unique=True),
    gpus=st.lists(st.integers(0, 300), min_size=3, max_size=3),
    user=st.booleans(),
)
def test_no_strings_make_the_pod_parser_raise_anything_but_a_contract_error(
    annotations: dict[str, str], names: list[str], gpus: list[int], user: bool
) -> None:
    containers = [ContainerSpec(name=name, gpus=count) for name, count in zip(names, gpus, strict=False)]
    try:
        request = parse_pod(annotations, containers, user_written=user)
    except InvalidPodRequest as invalid:
        assert all(violation.message.endswith(".") for violation in invalid.errors)
        return
    assert {c.container for c in request.containers} <= set(names)
