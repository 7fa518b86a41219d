"""Annotations and containers of a pod -> one typed ``PodGpuRequest``, or every reason it is invalid.

The accepted forms, and how they combine (docs/user-guide.md says the same for users):

* Per-container NvFractions keys ``nvidia.com/container.<c>.gpu-memory.request|limit``: whole MiB per
  device by ceiling; a limit alone means request = limit; a request alone means limit = request.
* Pod-level KAI forms apply to ONE container, the *target*: the one named by
  ``gpu-fraction-container-name``, else the first container (as KAI does). ``gpu-fraction`` (a portion in
  (0,1)) with an optional limit (``gpu-fraction.limit`` or
  ``kai.scheduler/container.<target>.gpu-memory.portion.limit``), or legacy ``gpu-memory`` (MiB) with an
  optional ``gpu-memory.limit`` quantity.
* ``gpu-fraction-num-devices: N`` applies to every fractional container of the pod: the request holds on
  EACH of N GPUs of one node.
* KAI's ``mps: "true"`` makes every fractional container of the pod ``sm-sharing`` (KAI: the fraction's
  processes are clients of an MPS server); ``nvidia.com/container.<c>.gpu-compute.request`` is a
  container's own compute share, charged instead of the memory-proportional one on sm-sharing GPUs.
* Whole GPUs: a container's ``nvidia.com/gpu`` limit, or ``gpufrac.io/container.<c>.gpus`` (what the
  webhook turns the resource into for pods of our scheduler). Exclusive, never shared.
* MIG slices (docs/mig.md): a container's ``nvidia.com/mig-<profile>: N`` limit (the device plugin's
  ``mixed`` strategy), or ``gpufrac.io/container.<c>.mig.profile`` with an optional ``.mig.count`` (what
  the webhook turns the resource into for pods of our scheduler), or ``.mig.gpu-memory`` (the smallest
  slice with that much memory). Hardware-isolated: such a container asks for nothing else of a GPU.

Precedence is explicit per-container keys > ``gpu-fraction`` > ``gpu-memory``, with two guards so that a
pod never means two things at once: ``gpu-fraction`` and ``gpu-memory`` together are an error, and an
explicit request next to ``gpu-fraction`` is only accepted once the pod is placed (the binder writes the
resolved request next to the portion; before that the two are a conflict). ``gpu-memory`` next to
explicit keys must agree with them. Fractions and whole GPUs never mix in one pod. KAI's webhook stores
``gpu-fraction.limit`` next to the ``kai.scheduler/container.<c>.gpu-memory.portion.limit`` it adds: the
two are one limit when their values are equal, a conflict otherwise. A ``gpu-fraction-container-name``
that names a container without a request while another container holds one is refused, as KAI does.

What a binder writes is read by ``_binder_compute_portion``: one function holds which binder shapes the
node accepts (KAI's newest binder writes a compute portion on every fractional bind, in every mode).

Parsing never stops at the first problem: every violation of the pod is collected and raised together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gpufrac.contract import keys as k
from gpufrac.contract.changes import forbidden_changes
from gpufrac.contract.errors import (
    ConflictingRequests,
    DeviceCountMismatch,
    FractionWithWholeGpu,
    InvalidComputeMode,
    InvalidComputePortion,
    InvalidDeviceCount,
    InvalidDeviceList,
    InvalidFraction,
    InvalidFractionLimit,
    InvalidLegacyMemory,
    InvalidMigCount,
    InvalidMps,
    InvalidPodRequest,
    KeyWithoutRequest,
    LimitBelowRequest,
    MigMemoryTooLarge,
    MigWithOtherRequest,
    NotTheFractionTarget,
    NotTheRequestingContainer,
    QuantityNeedsUnit,
    RuleViolation,
    UnknownContainer,
    UnknownKey,
    UnknownMigProfile,
)
from gpufrac.contract.near_miss import closest_suffix
from gpufrac.contract.quantities import parse_bytes, parse_mib
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, GpuMemory, MigRequest, PodGpuRequest
from gpufrac.contract.writable import unwritable_keys
from gpufrac.mig.profiles import KNOWN_PROFILES, MIG_MODELS

MAX_DEVICE_COUNT = 256

# ASCII digits only, as Kubernetes: Python's \d matches every Unicode digit, and float() accepts them.
_DECIMAL = re.compile(r"\+?(\d+\.?\d*|\.\d+)([eE][+-]?\d{1,3})?", re.ASCII)
_WHOLE = re.compile(r"\d{1,6}", re.ASCII)
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/=-]*")


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """What parsing needs of a container: its name, its ``nvidia.com/gpu`` count (0 when none) and its
    ``nvidia.com/mig-<profile>`` counts, as (profile, count) pairs in resource-name order."""

    name: str
    gpus: int = 0
    mig: tuple[tuple[str, int], ...] = ()


class _Violations:
    """Collects violations; ``None`` from a helper means "invalid, already recorded"."""

    def __init__(self) -> None:
        self.found: list[RuleViolation] = []

    def add(self, violation: RuleViolation) -> None:
        if violation not in self.found:
            self.found.append(violation)

    def mib(self, key: str, value: str) -> int | None:
        try:
            return parse_mib(value, key=key)
        except RuleViolation as violation:
            self.add(violation)
            return None


def _decimal(text: str) -> float | None:
    value = text.strip()
    return float(value) if _DECIMAL.fullmatch(value) else None


def _strict_decimal(text: str) -> float | None:
    """A decimal as Go's ``strconv.ParseFloat`` reads a user's compute request: no surrounding blanks."""
    return _decimal(text) if text == text.strip() else None


def _fraction_detail(raw: str, fraction: float | None) -> str:
    """What to add to a refused ``gpu-fraction``, judged on the exact decimal the user wrote: a float
    reads ``1e-400`` as 0 and ``0.99999999999999999999`` as 1, neither of which the user asked for."""
    if fraction is None:
        return ""
    exact = Decimal(raw.strip())
    if exact >= 1:
        return "ask for whole GPUs with nvidia.com/gpu"
    if exact > 0:
        return f"it reads as {fraction:g}, too close to {fraction:g} to tell apart"
    return ""


def _whole(text: str) -> int | None:
    value = text.strip()
    return int(value) if _WHOLE.fullmatch(value) else None


@dataclass(slots=True)
class _PodLevel:
    """The pod-level KAI forms, parsed; each field None when absent or invalid."""

    target: str | None = None
    fraction: float | None = None
    fraction_limit: float | None = None
    fraction_limit_key: str | None = None
    memory_mib: int | None = None
    memory_limit_mib: int | None = None
    num_devices: int | None = None
    mps: bool = False

    @property
    def has_request(self) -> bool:
        return self.fraction is not None or self.memory_mib is not None


def parse_pod(
    annotations: Mapping[str, str],
    containers: Sequence[ContainerSpec],
    *,
    user_written: bool = False,
) -> PodGpuRequest:
    """The GPU request of a pod; raises ``InvalidPodRequest`` with every violation found.

    ``user_written`` marks annotations a user wrote (a manifest, a pod being created by anyone but the
    scheduler): binder-owned keys are violations there. Pods without any GPU ask give an empty request.
    """
    found = _Violations()
    names = [c.name for c in containers]
    per_container: dict[str, dict[tuple[str, str], str]] = {name: {} for name in names}
    if user_written:
        for violation in forbidden_changes({}, annotations, creating=True):
            found.add(violation)

    for key in sorted(annotations):
        value = annotations[key]
        split = k.split_container_key(key)
        if split is None:
            continue
        if split.prefix == k.KAI_CONTAINER_PREFIX and split.suffix != k.PORTION_LIMIT:
            continue  # KAI's namespace; only the portion limit is ours to read
        known = k.NVIDIA_CONTAINER_SUFFIXES if split.prefix == k.NVIDIA_CONTAINER_PREFIX else ()
        known = k.GPUFRAC_CONTAINER_SUFFIXES if split.prefix == k.GPUFRAC_CONTAINER_PREFIX else known
        if split.prefix != k.KAI_CONTAINER_PREFIX and split.suffix not in known:
            detail = f"after {split.prefix}<container>. the contract knows {', '.join(known)}"
            meant = closest_suffix(split.prefix, split.suffix)
            if meant is not None:
                detail += f'; did you mean "{split.prefix}{split.container}.{meant}"?'
            found.add(UnknownKey(key=key, value=value, detail=detail))
            continue
        if split.container not in per_container:
            found.add(UnknownContainer(key=key, value=value, detail=_containers_detail(names)))
            continue
        per_container[split.container][(split.prefix, split.suffix)] = value

    pod = _parse_pod_level(annotations, names, per_container, found)
    requests: list[ContainerGpuRequest] = []
    sources: dict[str, tuple[str, str]] = {}
    for spec in containers:
        parsed = _parse_container(spec, per_container[spec.name], pod, annotations, found, sources)
        if parsed is not None:
            requests.append(parsed)

    fractional = [r for r in requests if not r.exclusive and r.mig is None]
    exclusive = [r for r in requests if r.exclusive]
    if fractional and exclusive:
        key, value = sources[fractional[0].container]
        found.add(
            FractionWithWholeGpu(
                key=key, value=value, detail=f'container "{exclusive[0].container}" asks for whole GPUs'
            )
        )
    if pod.mps and not sources:
        found.add(
            KeyWithoutRequest(
                key=k.KAI_MPS, value=annotations[k.KAI_MPS], detail="MPS applies to a fractional request"
            )
        )
    _check_fraction_container_name(annotations, pod, holders=list(sources), found=found)
    pod_level_asks = k.GPU_FRACTION in annotations or k.GPU_MEMORY in annotations
    if pod.num_devices is not None and not sources and not pod_level_asks:
        found.add(
            KeyWithoutRequest(
                key=k.GPU_FRACTION_NUM_DEVICES,
                value=annotations[k.GPU_FRACTION_NUM_DEVICES],
                detail="it multiplies a fractional request; the pod has none",
            )
        )
    parsed = PodGpuRequest(containers=tuple(requests))
    for violation in unwritable_keys(parsed):  # the scheduler could never bind it: refuse it now
        found.add(violation)
    if found.found:
        raise InvalidPodRequest(found.found)
    return parsed


def pod_level_target(annotations: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The container the pod-level forms apply to: ``gpu-fraction-container-name``, else the first one.

    None when the named container does not exist or the pod has no containers.
    """
    if k.GPU_FRACTION_CONTAINER_NAME in annotations:
        named = annotations[k.GPU_FRACTION_CONTAINER_NAME].strip()
        return named if named in names else None
    return names[0] if names else None


def _check_fraction_container_name(
    annotations: Mapping[str, str],
    pod: _PodLevel,
    *,
    holders: Sequence[str],
    found: _Violations,
) -> None:
    """A ``gpu-fraction-container-name`` must name a container that holds the fractional request (KAI's
    ``GetFractionContainerRef`` refuses a name that differs from the container of its NvFractions keys);
    a name that misses while another container holds the request would otherwise be silently unused."""
    if k.GPU_FRACTION_CONTAINER_NAME not in annotations or pod.target is None or not holders:
        return
    if pod.target not in holders:
        found.add(
            NotTheRequestingContainer(
                key=k.GPU_FRACTION_CONTAINER_NAME,
                value=annotations[k.GPU_FRACTION_CONTAINER_NAME],
                detail=f'container "{holders[0]}" holds the request',
            )
        )


def _parse_pod_level(
    annotations: Mapping[str, str],
    names: list[str],
    per_container: dict[str, dict[tuple[str, str], str]],
    found: _Violations,
) -> _PodLevel:
    pod = _PodLevel(target=pod_level_target(annotations, names))
    if k.GPU_FRACTION_CONTAINER_NAME in annotations:
        raw = annotations[k.GPU_FRACTION_CONTAINER_NAME]
        if pod.target is None:
            found.add(
                UnknownContainer(
                    key=k.GPU_FRACTION_CONTAINER_NAME, value=raw, detail=_containers_detail(names)
                )
            )

    if k.GPU_FRACTION in annotations:
        raw = annotations[k.GPU_FRACTION]
        fraction = _decimal(raw)
        if fraction is None or not 0 < fraction < 1:
            found.add(InvalidFraction(key=k.GPU_FRACTION, value=raw, detail=_fraction_detail(raw, fraction)))
        else:
            pod.fraction = fraction

    if k.GPU_MEMORY in annotations:
        raw = annotations[k.GPU_MEMORY]
        mib = _whole(raw)
        if mib is None or mib == 0:
            found.add(InvalidLegacyMemory(key=k.GPU_MEMORY, value=raw))
        else:
            pod.memory_mib = mib

    if k.GPU_FRACTION_NUM_DEVICES in annotations:
        pod.num_devices = _device_count(
            k.GPU_FRACTION_NUM_DEVICES, annotations[k.GPU_FRACTION_NUM_DEVICES], found
        )

    if k.KAI_MPS in annotations:
        raw = annotations[k.KAI_MPS]
        if raw.strip() not in ("true", "false"):
            found.add(InvalidMps(key=k.KAI_MPS, value=raw))
        else:
            pod.mps = raw.strip() == "true"

    if k.GPU_FRACTION in annotations and k.GPU_MEMORY in annotations:
        found.add(
            ConflictingRequests(
                key=k.GPU_MEMORY,
                value=annotations[k.GPU_MEMORY],
                detail=f"gpu-fraction={annotations[k.GPU_FRACTION]} is also set; keep one of them",
            )
        )

    limit_keys: list[tuple[str, str]] = []
    if k.GPU_FRACTION_LIMIT in annotations:
        limit_keys.append((k.GPU_FRACTION_LIMIT, annotations[k.GPU_FRACTION_LIMIT]))
    for name, entries in per_container.items():
        if (k.KAI_CONTAINER_PREFIX, k.PORTION_LIMIT) in entries:
            key, value = k.portion_limit_key(name), entries[(k.KAI_CONTAINER_PREFIX, k.PORTION_LIMIT)]
            if pod.target is not None and name != pod.target:
                found.add(
                    NotTheFractionTarget(
                        key=key, value=value, detail=f'gpu-fraction applies to "{pod.target}"'
                    )
                )
                continue
            limit_keys.append((key, value))
    distinct_limits = {_decimal(value) for _, value in limit_keys}
    if len(limit_keys) > 1 and (len(distinct_limits) > 1 or None in distinct_limits):
        (first, _), (second, value) = limit_keys[0], limit_keys[1]
        found.add(
            ConflictingRequests(key=second, value=value, detail=f"{first} also sets the fraction limit")
        )
    elif limit_keys:  # one limit, or KAI's stored form: the same value under both keys
        key, raw = limit_keys[0]
        if k.GPU_FRACTION not in annotations:
            found.add(KeyWithoutRequest(key=key, value=raw, detail="set gpu-fraction"))
        else:
            limit = _decimal(raw)
            if limit is None or not 0 < limit < 1 or (pod.fraction is not None and limit <= pod.fraction):
                found.add(
                    InvalidFractionLimit(
                        key=key, value=raw, detail=f"gpu-fraction is {annotations[k.GPU_FRACTION]}"
                    )
                )
            else:
                pod.fraction_limit, pod.fraction_limit_key = limit, key

    if k.GPU_MEMORY_LIMIT in annotations:
        raw = annotations[k.GPU_MEMORY_LIMIT]
        if k.GPU_MEMORY not in annotations:
            found.add(KeyWithoutRequest(key=k.GPU_MEMORY_LIMIT, value=raw, detail="set gpu-memory"))
        elif _whole(raw) is not None:
            found.add(
                QuantityNeedsUnit(key=k.GPU_MEMORY_LIMIT, value=raw, detail=f"write {raw.strip()}Mi for MiB")
            )
        else:
            limit_mib = found.mib(k.GPU_MEMORY_LIMIT, raw)
            if limit_mib is not None and pod.memory_mib is not None and limit_mib < pod.memory_mib:
                found.add(
                    LimitBelowRequest(
                        key=k.GPU_MEMORY_LIMIT, value=raw, detail=f"gpu-memory is {pod.memory_mib} MiB"
                    )
                )
            elif limit_mib is not None:
                pod.memory_limit_mib = limit_mib

    if pod.target is None and (k.GPU_FRACTION in annotations or k.GPU_MEMORY in annotations):
        key = k.GPU_FRACTION if k.GPU_FRACTION in annotations else k.GPU_MEMORY
        if k.GPU_FRACTION_CONTAINER_NAME not in annotations:
            found.add(UnknownContainer(key=key, value=annotations[key], detail="it has none"))
    return pod


def _containers_detail(names: Sequence[str]) -> str:
    return "names match exactly; the pod's containers are " + ", ".join(names) if names else "it has none"


def _device_count(key: str, raw: str, found: _Violations) -> int | None:
    count = _whole(raw)
    if count is None or not 1 <= count <= MAX_DEVICE_COUNT:
        found.add(InvalidDeviceCount(key=key, value=raw))
        return None
    return count


def _parse_container(
    spec: ContainerSpec,
    entries: Mapping[tuple[str, str], str],
    pod: _PodLevel,
    annotations: Mapping[str, str],
    found: _Violations,
    sources: dict[str, tuple[str, str]],
) -> ContainerGpuRequest | None:
    name = spec.name
    nv = {suffix: value for (prefix, suffix), value in entries.items() if prefix == k.NVIDIA_CONTAINER_PREFIX}
    placed = bool(nv.get(k.DEVICES, "").strip())
    request, limit, source = _memory(name, nv, pod, annotations, placed, found)
    fractional = request is not None or limit is not None or source is not None
    if source is not None:
        sources[name] = source

    whole = _whole_gpus(spec, entries, found)
    mig, mig_source = _mig(spec, entries, found)
    if mig_source is not None:
        others = [source[0]] if source is not None else []
        if whole is not None:
            marked = (k.GPUFRAC_CONTAINER_PREFIX, k.WHOLE_GPUS) in entries
            others.append(k.whole_gpus_key(name) if marked else _resource_key(name))
        others += [
            k.container_key(name, s)
            for s in (k.COMPUTE_MODE, k.COMPUTE_REQUEST, k.COMPUTE_PORTION)
            if s in nv
        ]
        if others:
            key, value = mig_source
            found.add(MigWithOtherRequest(key=key, value=value, detail=f"{others[0]} is also set"))
            return None
        if mig is None:
            return None
        return ContainerGpuRequest(
            container=name,
            request=None,
            limit=None,
            device_count=mig.count,
            devices=_devices(name, nv, True, mig.count, found),
            mig=mig,
        )
    if whole is not None and fractional:
        key, value = source if source is not None else (k.memory_request_key(name), "")
        found.add(
            FractionWithWholeGpu(
                key=key,
                value=value,
                detail=f'container "{name}" also asks for {whole} whole GPU{"s" if whole != 1 else ""}',
            )
        )
        return None
    asks = fractional or whole is not None

    mode = ComputeMode.SM_SHARING if pod.mps and fractional else ComputeMode.TIME_SLICING
    if k.COMPUTE_MODE in nv:
        raw = nv[k.COMPUTE_MODE]
        key = k.compute_mode_key(name)
        if raw.strip() not in (ComputeMode.TIME_SLICING.value, ComputeMode.SM_SHARING.value):
            found.add(
                InvalidComputeMode(
                    key=key, value=raw, detail="blank is not allowed" if not raw.strip() else ""
                )
            )
        elif not asks:
            found.add(KeyWithoutRequest(key=key, value=raw, detail=f'container "{name}" asks for no GPU'))
        elif pod.mps and fractional and raw.strip() != ComputeMode.SM_SHARING.value:
            found.add(
                ConflictingRequests(
                    key=k.KAI_MPS, value=annotations[k.KAI_MPS], detail=f"{key} is {raw.strip()}"
                )
            )
        else:
            mode = ComputeMode(raw.strip())

    device_count = whole if whole is not None else (pod.num_devices or 1)
    devices = _devices(name, nv, asks, device_count, found)
    portion = _binder_compute_portion(name, nv, asks, mode, found)
    compute_request = _compute_request(name, nv, asks, found)

    if not asks or (request is None and whole is None):
        return None
    return ContainerGpuRequest(
        container=name,
        request=request,
        limit=limit,
        mode=mode,
        device_count=device_count,
        exclusive=whole is not None,
        devices=devices,
        compute_portion=portion,
        compute_request=compute_request,
    )


def _memory(
    name: str,
    nv: Mapping[str, str],
    pod: _PodLevel,
    annotations: Mapping[str, str],
    placed: bool,
    found: _Violations,
) -> tuple[GpuMemory | None, GpuMemory | None, tuple[str, str] | None]:
    """Request, limit (defaulted: never None when there is a request) and the key that asked."""
    request_key, limit_key = k.memory_request_key(name), k.memory_limit_key(name)
    explicit_request = found.mib(request_key, nv[k.MEMORY_REQUEST]) if k.MEMORY_REQUEST in nv else None
    explicit_limit = found.mib(limit_key, nv[k.MEMORY_LIMIT]) if k.MEMORY_LIMIT in nv else None
    has_explicit = k.MEMORY_REQUEST in nv or k.MEMORY_LIMIT in nv
    is_target = name == pod.target
    pod_fraction = is_target and k.GPU_FRACTION in annotations
    pod_memory = is_target and k.GPU_MEMORY in annotations

    if has_explicit:
        source = (
            (request_key, nv[k.MEMORY_REQUEST]) if k.MEMORY_REQUEST in nv else (limit_key, nv[k.MEMORY_LIMIT])
        )
        if pod_fraction and not placed:
            found.add(
                ConflictingRequests(
                    key=source[0],
                    value=source[1],
                    detail=f'gpu-fraction also sets the request of container "{name}"; keep one of them',
                )
            )
        if explicit_request is not None and explicit_limit is not None and explicit_limit < explicit_request:
            found.add(
                LimitBelowRequest(
                    key=limit_key, value=nv[k.MEMORY_LIMIT], detail=f"the request is {explicit_request} MiB"
                )
            )
            return None, None, source
        effective_request = explicit_request if k.MEMORY_REQUEST in nv else explicit_limit
        effective_limit = explicit_limit if k.MEMORY_LIMIT in nv else effective_request
        if pod_memory and pod.memory_mib is not None and effective_request is not None:
            if pod.memory_mib != effective_request:
                found.add(
                    ConflictingRequests(
                        key=k.GPU_MEMORY,
                        value=annotations[k.GPU_MEMORY],
                        detail=f"{source[0]} asks for {effective_request} MiB",
                    )
                )
            elif pod.memory_limit_mib is not None and pod.memory_limit_mib != effective_limit:
                found.add(
                    ConflictingRequests(
                        key=k.GPU_MEMORY_LIMIT,
                        value=annotations[k.GPU_MEMORY_LIMIT],
                        detail=f"the limit of container {name} is {effective_limit} MiB",
                    )
                )
        if effective_request is None or effective_limit is None:
            return None, None, source
        return GpuMemory(mib=effective_request), GpuMemory(mib=effective_limit), source

    if pod_fraction:
        source = (k.GPU_FRACTION, annotations[k.GPU_FRACTION])
        if pod.fraction is None:
            return None, None, source
        limit = pod.fraction_limit if pod.fraction_limit is not None else pod.fraction
        return GpuMemory(portion=pod.fraction), GpuMemory(portion=limit), source
    if pod_memory:
        source = (k.GPU_MEMORY, annotations[k.GPU_MEMORY])
        if pod.memory_mib is None:
            return None, None, source
        limit_mib = pod.memory_limit_mib if pod.memory_limit_mib is not None else pod.memory_mib
        return GpuMemory(mib=pod.memory_mib), GpuMemory(mib=limit_mib), source
    return None, None, None


def _whole_gpus(
    spec: ContainerSpec, entries: Mapping[tuple[str, str], str], found: _Violations
) -> int | None:
    """Exclusive GPU count of a container (annotation or resource), None when it asks for none."""
    annotated: int | None = None
    marker = (k.GPUFRAC_CONTAINER_PREFIX, k.WHOLE_GPUS)
    if marker in entries:
        annotated = _device_count(k.whole_gpus_key(spec.name), entries[marker], found)
        if annotated is None:
            return None
        if spec.gpus and spec.gpus != annotated:
            found.add(
                ConflictingRequests(
                    key=k.whole_gpus_key(spec.name),
                    value=entries[marker],
                    detail=f'container "{spec.name}" has {k.GPU_RESOURCE}: {spec.gpus}',
                )
            )
            return None
    if annotated is not None:
        return annotated
    if spec.gpus:
        if spec.gpus > MAX_DEVICE_COUNT:
            found.add(InvalidDeviceCount(key=_resource_key(spec.name), value=str(spec.gpus)))
            return None
        return spec.gpus
    return None


def _resource_key(container: str, resource: str = k.GPU_RESOURCE) -> str:
    return f"spec.containers[{container}].resources.limits.{resource}"


def _profile_order(name: str) -> tuple[int, int]:
    compute, _, memory = name.partition("g.")
    return int(compute), int(memory.removesuffix("gb"))


#: Every MIG profile a supported model has, smallest first, as a refusal lists them.
KNOWN_PROFILES_TEXT = ", ".join(sorted(KNOWN_PROFILES, key=_profile_order))
#: The largest MIG slice of any supported model: a ``mig.gpu-memory`` above it fits nowhere.
_LARGEST_SLICE = max(
    ((p.memory_mib, p.name, m.model) for m in MIG_MODELS.values() for p in m.profiles), default=(0, "", "")
)


def _mig(
    spec: ContainerSpec, entries: Mapping[tuple[str, str], str], found: _Violations
) -> tuple[MigRequest | None, tuple[str, str] | None]:
    """A container's MIG request and the key that asked (None, None when it asks for no slice); a request
    of None next to a key: invalid, already recorded."""
    name = spec.name
    keyed = {
        suffix: value
        for (prefix, suffix), value in entries.items()
        if prefix == k.GPUFRAC_CONTAINER_PREFIX and suffix in k.MIG_SUFFIXES
    }
    if not keyed and not spec.mig:
        return None, None
    ok = True
    profile = min_mib = None
    count = 1
    resource = None
    for index, (wanted, amount) in enumerate(spec.mig):
        key = _resource_key(name, k.mig_resource(wanted))
        if index:
            first = k.mig_resource(spec.mig[0][0])
            detail = f"{first} is also set; a container takes slices of one profile"
            found.add(ConflictingRequests(key=key, value=str(amount), detail=detail))
            ok = False
        elif wanted not in KNOWN_PROFILES:
            found.add(
                UnknownMigProfile(
                    key=key, value=str(amount), detail=f"the profiles are {KNOWN_PROFILES_TEXT}"
                )
            )
            ok = False
        else:
            resource, profile, count = (key, str(amount)), wanted, amount
    source = resource

    if k.MIG_PROFILE in keyed:
        key, raw = k.mig_key(name, k.MIG_PROFILE), keyed[k.MIG_PROFILE]
        source = (key, raw)
        if raw.strip() not in KNOWN_PROFILES:
            found.add(UnknownMigProfile(key=key, value=raw, detail=f"the profiles are {KNOWN_PROFILES_TEXT}"))
            ok = False
        elif resource is not None and raw.strip() != profile:
            detail = f'container "{name}" has {k.mig_resource(profile or "")}: {count}'
            found.add(ConflictingRequests(key=key, value=raw, detail=detail))
            ok = False
        else:
            profile = raw.strip()
    if k.MIG_MEMORY in keyed:
        key, raw = k.mig_key(name, k.MIG_MEMORY), keyed[k.MIG_MEMORY]
        source = source or (key, raw)
        if k.MIG_PROFILE in keyed or resource is not None:
            other = (
                k.mig_key(name, k.MIG_PROFILE) if k.MIG_PROFILE in keyed else resource[0] if resource else ""
            )
            found.add(
                ConflictingRequests(key=key, value=raw, detail=f"{other} is also set; keep one of them")
            )
            ok = False
        else:
            min_mib = found.mib(key, raw)
            largest, largest_name, largest_model = _LARGEST_SLICE
            if min_mib is None:
                ok = False
            elif min_mib > largest:
                detail = f"the largest is {largest_name} of {largest_model}, {largest} MiB"
                found.add(MigMemoryTooLarge(key=key, value=raw, detail=detail))
                ok = False
    if k.MIG_COUNT in keyed:
        key, raw = k.mig_key(name, k.MIG_COUNT), keyed[k.MIG_COUNT]
        annotated = _whole(raw)
        if k.MIG_PROFILE not in keyed and k.MIG_MEMORY not in keyed:
            found.add(KeyWithoutRequest(key=key, value=raw, detail=f"set {k.mig_key(name, k.MIG_PROFILE)}"))
            ok = False
        elif annotated is None or not 1 <= annotated <= MAX_DEVICE_COUNT:
            found.add(InvalidMigCount(key=key, value=raw))
            ok = False
        elif resource is not None and annotated != count:
            detail = f'container "{name}" has {k.mig_resource(profile or "")}: {count}'
            found.add(ConflictingRequests(key=key, value=raw, detail=detail))
            ok = False
        else:
            count = annotated
    if source is None:  # only a count, or only refused resources
        first = spec.mig[0] if spec.mig else None
        source = (
            (_resource_key(name, k.mig_resource(first[0])), str(first[1]))
            if first is not None
            else (k.mig_key(name, k.MIG_COUNT), keyed.get(k.MIG_COUNT, ""))
        )
    if not ok:
        return None, source
    return MigRequest(profile=profile, min_mib=None if profile else min_mib, count=count), source


def _devices(
    name: str, nv: Mapping[str, str], asks: bool, device_count: int, found: _Violations
) -> tuple[str, ...]:
    if k.DEVICES not in nv:
        return ()
    raw, key = nv[k.DEVICES], k.devices_key(name)
    items = [item.strip() for item in raw.split(",")]
    if not all(_DEVICE.fullmatch(item) for item in items) or len(set(items)) != len(items):
        found.add(InvalidDeviceList(key=key, value=raw))
        return ()
    if not asks:
        found.add(KeyWithoutRequest(key=key, value=raw, detail=f'container "{name}" asks for no GPU'))
        return ()
    if len(items) != device_count:
        found.add(
            DeviceCountMismatch(key=key, value=raw, detail=f"{len(items)} assigned, {device_count} requested")
        )
        return ()
    return tuple(items)


def _binder_compute_portion(
    name: str, nv: Mapping[str, str], asks: bool, mode: ComputeMode, found: _Violations
) -> float | None:
    """The binder-written compute portion of a container: the binder shapes the node accepts.

    gpufrac's binder writes a portion on sm-sharing containers only; KAI Scheduler's newest binder
    writes one on every fractional bind, in every mode. The value is checked wherever it appears (a
    portion outside (0, 1] is a broken binding), but it applies to sm-sharing alone, as in NVIDIA's
    reference node agent: under time-slicing the portion would be a hard SM partition that keeps a lone
    tenant off an idle GPU, so it is accepted and not applied (None). A portion on a container that asks
    for no GPU is an error: the binder bound something the pod did not ask for.
    """
    if k.COMPUTE_PORTION not in nv:
        return None
    raw, key = nv[k.COMPUTE_PORTION], k.compute_portion_key(name)
    portion = _decimal(raw)
    if portion is None or not 0 < portion <= 1:
        found.add(InvalidComputePortion(key=key, value=raw))
        return None
    if not asks:
        found.add(KeyWithoutRequest(key=key, value=raw, detail=f'container "{name}" asks for no GPU'))
        return None
    return portion if mode is ComputeMode.SM_SHARING else None


def _compute_request(name: str, nv: Mapping[str, str], asks: bool, found: _Violations) -> float | None:
    """KAI's user-settable compute share: a portion in (0, 1], read as KAI reads it (no blanks)."""
    if k.COMPUTE_REQUEST not in nv:
        return None
    raw, key = nv[k.COMPUTE_REQUEST], k.compute_request_key(name)
    share = _strict_decimal(raw)
    if share is None or not 0 < share <= 1:
        found.add(InvalidComputePortion(key=key, value=raw))
        return None
    if not asks:
        found.add(KeyWithoutRequest(key=key, value=raw, detail=f'container "{name}" asks for no GPU'))
        return None
    return share


# -- raw Kubernetes objects ------------------------------------------------------------------------------


def container_specs(pod_spec: Mapping[str, Any]) -> list[ContainerSpec]:
    """The ``ContainerSpec`` of each regular container of a raw pod spec.

    The ``nvidia.com/gpu`` and ``nvidia.com/mig-<profile>`` counts are the limit, or the request when no
    limit is given. A count that is not a whole number (or a MIG count below 1) raises
    ``InvalidPodRequest`` (the API server rejects those too, but ``validate``
    reads files that never met it).
    """
    found = _Violations()
    specs: list[ContainerSpec] = []
    for container in pod_spec.get("containers") or []:
        name = str(container.get("name", ""))
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        raw = limits.get(k.GPU_RESOURCE)
        if raw is None:
            raw = requests.get(k.GPU_RESOURCE)
        gpus = 0
        if raw is not None:
            count = _gpu_count(str(raw))
            if count is None:
                found.add(InvalidDeviceCount(key=_resource_key(name), value=str(raw)))
            else:
                gpus = count
        mig: list[tuple[str, int]] = []
        for resource in sorted(
            {str(r) for r in (*limits, *requests) if str(r).startswith(k.MIG_RESOURCE_PREFIX)}
        ):
            raw = limits.get(resource, requests.get(resource))
            count = _gpu_count(str(raw))
            if count is None or not 1 <= count <= MAX_DEVICE_COUNT:
                found.add(InvalidMigCount(key=_resource_key(name, resource), value=str(raw)))
            else:
                mig.append((resource.removeprefix(k.MIG_RESOURCE_PREFIX), count))
        specs.append(ContainerSpec(name=name, gpus=gpus, mig=tuple(mig)))
    if found.found:
        raise InvalidPodRequest(found.found)
    return specs


def _gpu_count(raw: str) -> int | None:
    """A ``nvidia.com/gpu`` quantity as a whole count: ``2``, or ``2000m`` as a file may spell it (the API
    server stores the canonical ``2``); None for a fraction such as ``500m`` or anything else."""
    count = _whole(raw)
    if count is not None:
        return count
    try:
        amount = parse_bytes(raw, key=k.GPU_RESOURCE)
    except RuleViolation:
        return None
    return int(amount) if amount.denominator == 1 else None


def parse_pod_manifest(pod: Mapping[str, Any], *, user_written: bool = False) -> PodGpuRequest:
    """``parse_pod`` for a raw Pod (a dict as in YAML/JSON); see ``parse_pod``."""
    metadata = pod.get("metadata") or {}
    annotations = {str(key): str(value) for key, value in (metadata.get("annotations") or {}).items()}
    return parse_pod(annotations, container_specs(pod.get("spec") or {}), user_written=user_written)
