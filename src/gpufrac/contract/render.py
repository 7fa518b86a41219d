"""From a placed request to what others read: the binder's annotations, and reading them back on the node.

The binder writes, per container: the devices, the request and limit in whole MiB exactly as the engine
booked them (a portion resolved on the chosen GPU as floor(portion x GPU MiB), by
``ContainerGpuRequest.request_mib``; ``render_binding`` resolves nothing itself), for sm-sharing the
compute portion, for whole GPUs the whole-GPU marker, and for MIG slices the MIG devices alone.
Writing the MiB for every fractional container, not only for portions, makes a bound pod
self-describing: the node agent never needs the GPU size, the pod's resources nor resolves a KAI
pod-level form, and a restarted scheduler, which reads a bound pod with ``read_binding`` too, books
exactly what the node enforces.

``read_binding`` is the exact inverse of ``render_binding`` and the node's only reader of a bound pod. It
reads the keys the binder wrote plus the few the user's request fixes (the compute mode, the whole-GPU
marker, the device count); its docstring lists what it accepts and refuses. The full parser
(``gpufrac.contract.parse``) is for what users write; the node does not run it.

``render -> parse`` is stable too: parsing a pod with the rendered keys and rendering again gives the
same keys (an explicit request wins over ``gpu-fraction`` once devices are assigned).
Every key rendered passes the API server's annotation-key rule (``keys.annotation_key_problem``). The
Binding that carries them is merged into the pod without that check, and a pod holding an invalid key
can never be updated again (not even to remove a finalizer), so an unwritable key is a ``ContractError``
here, and ``parse_pod`` refuses such a pod up front (``writable.unwritable_keys``): the webhook at creation,
``gpufrac validate`` on a manifest, the scheduler as an unschedulable pod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpufrac.contract import keys as k
from gpufrac.contract.errors import (
    DeviceCountMismatch,
    FractionWithWholeGpu,
    InvalidComputeMode,
    InvalidDeviceCount,
    InvalidDeviceList,
    InvalidLegacyMemory,
    InvalidMigCount,
    InvalidPodRequest,
    LimitBelowRequest,
    MigWithOtherRequest,
    NotPlaced,
    QuantityNeedsUnit,
    RuleViolation,
    UnknownKey,
)

# The value grammar (device names, decimals, whole numbers) is the parser's: one rule, one place.
from gpufrac.contract.parse import _DEVICE, MAX_DEVICE_COUNT, _binder_compute_portion, _Violations, _whole
from gpufrac.contract.quantities import format_mib, parse_mib
from gpufrac.contract.request import ComputeMode, ContainerGpuRequest, PodGpuRequest
from gpufrac.contract.writable import unwritable_key


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """The GPUs chosen for one container (``device_count`` of them) and the amounts booked for it, as the
    binder passes them to ``render_binding``, which writes them as they are: it resolves nothing, so what a
    pod's binding says is what the scheduler booked. (The engine's own answer is
    ``gpufrac.placement.ContainerPlacement``.)

    ``request_mib``/``limit_mib`` are the MiB per device (None for a whole-GPU container);
    ``compute_portion`` the sm-sharing share (None elsewhere, or to keep the one a bound pod holds).
    """

    container: str
    devices: tuple[str, ...]
    request_mib: int | None = None
    limit_mib: int | None = None
    compute_portion: float | None = None

    @classmethod
    def on_gpu(
        cls,
        container: ContainerGpuRequest,
        devices: tuple[str, ...],
        gpu_mib: int,
        *,
        compute_portion: float | None = None,
    ) -> DeviceChoice:
        """``container``'s request resolved on GPUs of ``gpu_mib`` by the contract's own rule
        (``ContainerGpuRequest.request_mib``), for a caller that places without the engine: the KAI
        compatibility suite and the contract's tests. ``compute_portion`` overrides the derived share."""
        if container.mig is not None:
            return cls(container.container, devices)
        portion = compute_portion if compute_portion is not None else container.compute_portion_on(gpu_mib)
        if container.exclusive:
            return cls(container.container, devices, compute_portion=portion)
        request = container.request_mib(gpu_mib)
        return cls(container.container, devices, request, max(request, container.limit_mib(gpu_mib)), portion)


def format_portion(portion: float) -> str:
    """A compute portion as written: the shortest text that parses back to the same float."""
    if not 0 < portion <= 1:
        raise ValueError(f"a compute portion must be in (0, 1], got {portion}")
    return repr(float(portion))


def render_binding(request: PodGpuRequest, placements: Iterable[DeviceChoice]) -> dict[str, str]:
    """The binder-owned (and resolved) annotations for ``request`` placed as ``placements``.

    Every container of the request needs exactly one placement with ``device_count`` devices; anything
    else is a bug in the caller and raises ``ValueError``. A key the API server would refuse raises
    ``InvalidPodRequest`` (``UnwritableKey``): the pod cannot be placed, and a Binding would store it.
    """
    by_name = {p.container: p for p in placements}
    wanted = {c.container for c in request.containers}
    if set(by_name) != wanted:
        raise ValueError(
            f"placements for {sorted(by_name)} do not match the request's containers {sorted(wanted)}"
        )
    rendered: dict[str, str] = {}
    problems: list[RuleViolation] = []
    for container in request.containers:
        written = _render_container(container, by_name[container.container])
        for key in written:
            problem = k.annotation_key_problem(key)
            if problem is not None:
                problems.append(unwritable_key(container.container, key, problem))
                break
        rendered.update(written)
    if problems:
        raise InvalidPodRequest(problems)
    return rendered


def _render_container(container: ContainerGpuRequest, placement: DeviceChoice) -> dict[str, str]:
    name = container.container
    if len(placement.devices) != container.device_count or len(set(placement.devices)) != len(
        placement.devices
    ):
        raise ValueError(
            f"container {name} needs {container.device_count} distinct devices, got {placement.devices}"
        )
    out = {k.devices_key(name): ",".join(placement.devices)}
    if container.mig is not None:
        return out  # the MIG devices' UUIDs; the slices' memory is their profile's, enforced by the hardware
    if container.exclusive:
        # The webhook's marker, written again: a pod that asked through ``nvidia.com/gpu`` alone (no webhook
        # on its way in) is still read as whole GPUs by the node, which sees no resources.
        out[k.whole_gpus_key(name)] = str(container.device_count)
    else:
        request_mib, limit_mib = placement.request_mib, placement.limit_mib
        if request_mib is None or limit_mib is None:
            raise ValueError(f"container {name}: the MiB booked for it are needed (request_mib, limit_mib)")
        if request_mib < 1:
            raise ValueError(f"container {name}: request_mib must be positive, got {request_mib}")
        out[k.memory_request_key(name)] = format_mib(request_mib)
        out[k.memory_limit_key(name)] = format_mib(max(request_mib, limit_mib))
    if container.mode is ComputeMode.SM_SHARING:
        portion = placement.compute_portion
        if portion is None:
            portion = container.compute_portion
        if portion is None:
            raise ValueError(f"container {name}: sm-sharing needs a compute portion")
        out[k.compute_portion_key(name)] = format_portion(portion)
    return out


@dataclass(frozen=True, slots=True)
class BoundContainer:
    """One container of a bound pod as its binder wrote it: what the node agent enforces.

    ``request_mib``/``limit_mib`` are None for an exclusive container (it owns whole GPUs, nothing to
    cap) and for a ``mig`` one (its ``devices`` are MIG devices, whose memory the hardware bounds);
    ``compute_portion`` is None unless sm-sharing.
    """

    container: str
    devices: tuple[str, ...]
    mode: ComputeMode
    request_mib: int | None
    limit_mib: int | None
    compute_portion: float | None
    exclusive: bool
    mig: bool = False


def read_binding(annotations: Mapping[str, str]) -> tuple[BoundContainer, ...]:
    """What a binder wrote on a bound pod, read back: the exact inverse of ``render_binding``.

    Returns one ``BoundContainer`` per placed container, in container-name order; raises
    ``InvalidPodRequest`` naming every key it cannot accept. This is the node's only reader of a bound
    pod (injection, the audit, and through the injection records the usage reporter), and the one place
    where the output of a binder, ours or another one, is accepted or refused. The rules:

    * A container is placed when ``nvidia.com/container.<c>.gpus.devices`` names its devices: distinct
      device names (GPU UUIDs or CDI names), comma-separated.
    * Whole GPUs: ``gpufrac.io/container.<c>.gpus: N`` (the webhook's marker, which our binder writes
      again) marks the container exclusive; it needs exactly N devices and no memory keys.
    * Otherwise the container is fractional: ``gpu-memory.request`` and ``gpu-memory.limit`` hold its MiB
      per device (any quantity, rounded up to whole MiB; one alone stands for both; the limit may not be
      below the request), and it needs exactly ``gpu-fraction-num-devices`` devices (default 1). A
      binder that wrote only devices is accepted for legacy ``gpu-memory: <MiB>`` (with an optional
      ``gpu-memory.limit`` quantity), which is already in MiB: it holds for the container
      ``gpu-fraction-container-name`` names or, with none named, for the only placed container. A
      fraction the binder did not resolve to MiB (devices next to ``gpu-fraction`` alone) is refused:
      the node never guesses a GPU's size.
    * MIG slices: ``gpufrac.io/container.<c>.mig.profile`` or ``.mig.gpu-memory`` (the user's, or the
      webhook's from ``nvidia.com/mig-<profile>``) marks the container ``mig``: it needs exactly
      ``.mig.count`` (default 1) devices, its MIG devices, and no memory, compute or whole-GPU keys.
    * ``gpu-compute.mode`` (the user's; default time-slicing) says how the devices are shared;
      ``gpu-compute.portion``, a number in (0, 1], is the sm-sharing compute share; on a time-slicing
      container (KAI Scheduler's newest binder writes one on every fractional bind) it is checked and not
      applied (``contract.parse._binder_compute_portion`` holds that rule for both readers).
    * A pod that asks for GPUs but is not placed is refused (fail-closed): memory keys or the whole-GPU
      marker on a container without devices, or a pod-level ``gpu-fraction``/``gpu-memory`` while no
      container has devices. Every container of such a pod is refused, not only the one asking.
    * An unknown key under ``nvidia.com/container.<c>.`` or ``gpufrac.io/container.<c>.`` is refused: a
      misspelt ``gpu-memory.limit`` must not quietly leave a container capped at its request.
    * Nothing else is read. The other pod-level forms (``gpu-fraction`` and its limits) are the user's
      side of the contract, which the binder resolved into the keys above; KAI Scheduler's own
      per-container keys are not a binding.
    """
    found = _Violations()
    violation = found.add

    per_container: dict[str, dict[tuple[str, str], str]] = {}
    for key, value in sorted(annotations.items()):
        split = k.split_container_key(key)
        if split is None or split.prefix == k.KAI_CONTAINER_PREFIX:
            continue
        known = (
            k.NVIDIA_CONTAINER_SUFFIXES
            if split.prefix == k.NVIDIA_CONTAINER_PREFIX
            else k.GPUFRAC_CONTAINER_SUFFIXES
        )
        if split.suffix not in known:
            detail = f"after {split.prefix}<container>. the contract knows {', '.join(known)}"
            violation(UnknownKey(key=key, value=value, detail=detail))
        elif split.container:
            per_container.setdefault(split.container, {})[(split.prefix, split.suffix)] = value

    placed = sorted(
        n for n, entries in per_container.items() if (k.NVIDIA_CONTAINER_PREFIX, k.DEVICES) in entries
    )
    legacy_target = None
    if k.GPU_MEMORY in annotations and placed:
        named = annotations.get(k.GPU_FRACTION_CONTAINER_NAME, "").strip()
        legacy_target = named if named else (placed[0] if len(placed) == 1 else None)
    bound = []
    for name in sorted(per_container):
        legacy = legacy_target == name
        container = _read_container(name, per_container[name], annotations, found, legacy=legacy)
        if container is not None:
            bound.append(container)
    if not placed:
        for key in (k.GPU_FRACTION, k.GPU_MEMORY):
            if key in annotations:
                violation(
                    NotPlaced(key=key, value=annotations[key], detail="no container has devices assigned")
                )
    if found.found:
        raise InvalidPodRequest(found.found)
    return tuple(bound)


def _read_container(
    name: str,
    entries: Mapping[tuple[str, str], str],
    annotations: Mapping[str, str],
    found: _Violations,
    *,
    legacy: bool,
) -> BoundContainer | None:
    violation = found.add
    nv = {suffix: value for (prefix, suffix), value in entries.items() if prefix == k.NVIDIA_CONTAINER_PREFIX}
    whole_raw = entries.get((k.GPUFRAC_CONTAINER_PREFIX, k.WHOLE_GPUS))
    memory_keys = [suffix for suffix in (k.MEMORY_REQUEST, k.MEMORY_LIMIT) if suffix in nv]
    mig = {s: v for (p, s), v in entries.items() if p == k.GPUFRAC_CONTAINER_PREFIX and s in k.MIG_SUFFIXES}
    if k.DEVICES not in nv:
        if memory_keys or whole_raw is not None or mig:
            violation(NotPlaced(key=k.devices_key(name), value="", detail="no devices are assigned"))
        return None
    if mig:
        return _read_mig_container(name, nv, whole_raw, mig, found)
    ok = True
    devices_raw = nv[k.DEVICES]
    devices = tuple(item.strip() for item in devices_raw.split(","))
    if not all(_DEVICE.fullmatch(d) for d in devices) or len(set(devices)) != len(devices):
        violation(InvalidDeviceList(key=k.devices_key(name), value=devices_raw))
        ok = False

    mode = ComputeMode.TIME_SLICING
    if k.COMPUTE_MODE in nv:
        raw = nv[k.COMPUTE_MODE]
        if raw.strip() in tuple(ComputeMode):
            mode = ComputeMode(raw.strip())
        else:
            detail = "blank is not allowed" if not raw.strip() else ""
            violation(InvalidComputeMode(key=k.compute_mode_key(name), value=raw, detail=detail))
            ok = False

    request_mib = limit_mib = None
    if whole_raw is not None:
        count = _count(k.whole_gpus_key(name), whole_raw, violation)
        if count is not None and memory_keys:
            suffix = memory_keys[0]
            violation(
                FractionWithWholeGpu(
                    key=k.container_key(name, suffix),
                    value=nv[suffix],
                    detail=f'container "{name}" also asks for {count} whole GPU{"s" if count != 1 else ""}',
                )
            )
            ok = False
    else:
        count = 1
        if k.GPU_FRACTION_NUM_DEVICES in annotations:
            count = _count(k.GPU_FRACTION_NUM_DEVICES, annotations[k.GPU_FRACTION_NUM_DEVICES], violation)
        if memory_keys:
            request_mib, limit_mib = _memory(name, nv, violation)
        elif legacy:
            request_mib, limit_mib = _legacy_memory(annotations, violation)
        else:
            violation(
                NotPlaced(
                    key=k.memory_request_key(name),
                    value="",
                    detail="the memory portion is not resolved to MiB",
                )
            )
        if request_mib is None or limit_mib is None:
            ok = False
    if count is None:
        ok = False
    elif ok and len(devices) != count:
        violation(
            DeviceCountMismatch(
                key=k.devices_key(name),
                value=devices_raw,
                detail=f"{len(devices)} assigned, {count} requested",
            )
        )
        ok = False

    before = len(found.found)
    portion = _binder_compute_portion(name, nv, True, mode, found)
    if len(found.found) != before:
        ok = False
    if not ok:
        return None
    return BoundContainer(
        container=name,
        devices=devices,
        mode=mode,
        request_mib=request_mib,
        limit_mib=limit_mib,
        compute_portion=portion,
        exclusive=whole_raw is not None,
    )


def _read_mig_container(
    name: str, nv: Mapping[str, str], whole_raw: str | None, mig: Mapping[str, str], found: _Violations
) -> BoundContainer | None:
    """A MIG container of a bound pod: its devices (MIG device UUIDs), ``mig.count`` of them."""
    suffix, value = next((s, mig[s]) for s in (k.MIG_PROFILE, k.MIG_MEMORY, k.MIG_COUNT) if s in mig)
    others = [k.container_key(name, s) for s in (k.MEMORY_REQUEST, k.MEMORY_LIMIT, k.COMPUTE_MODE) if s in nv]
    others += [k.container_key(name, k.COMPUTE_PORTION)] if k.COMPUTE_PORTION in nv else []
    others += [k.whole_gpus_key(name)] if whole_raw is not None else []
    if others:
        detail = f"{others[0]} is also set"
        found.add(MigWithOtherRequest(key=k.mig_key(name, suffix), value=value, detail=detail))
        return None
    devices_raw = nv[k.DEVICES]
    devices = tuple(item.strip() for item in devices_raw.split(","))
    if not all(_DEVICE.fullmatch(d) for d in devices) or len(set(devices)) != len(devices):
        found.add(InvalidDeviceList(key=k.devices_key(name), value=devices_raw))
        return None
    count = 1
    if k.MIG_COUNT in mig:
        count = _whole(mig[k.MIG_COUNT])
        if count is None or not 1 <= count <= MAX_DEVICE_COUNT:
            found.add(InvalidMigCount(key=k.mig_key(name, k.MIG_COUNT), value=mig[k.MIG_COUNT]))
            return None
    if len(devices) != count:
        detail = f"{len(devices)} assigned, {count} requested"
        found.add(DeviceCountMismatch(key=k.devices_key(name), value=devices_raw, detail=detail))
        return None
    return BoundContainer(
        container=name,
        devices=devices,
        mode=ComputeMode.TIME_SLICING,
        request_mib=None,
        limit_mib=None,
        compute_portion=None,
        exclusive=False,
        mig=True,
    )


def _count(key: str, raw: str, violation: Callable[[RuleViolation], None]) -> int | None:
    count = _whole(raw)
    if count is None or not 1 <= count <= MAX_DEVICE_COUNT:
        violation(InvalidDeviceCount(key=key, value=raw))
        return None
    return count


def _legacy_memory(
    annotations: Mapping[str, str], violation: Callable[[RuleViolation], None]
) -> tuple[int | None, int | None]:
    """Legacy ``gpu-memory`` (whole MiB) and its optional ``gpu-memory.limit`` (a quantity with a unit)."""
    raw = annotations[k.GPU_MEMORY]
    request = _whole(raw)
    if request is None or request == 0:
        violation(InvalidLegacyMemory(key=k.GPU_MEMORY, value=raw))
        return None, None
    if k.GPU_MEMORY_LIMIT not in annotations:
        return request, request
    raw = annotations[k.GPU_MEMORY_LIMIT]
    if _whole(raw) is not None:
        violation(
            QuantityNeedsUnit(key=k.GPU_MEMORY_LIMIT, value=raw, detail=f"write {raw.strip()}Mi for MiB")
        )
        return None, None
    try:
        limit = parse_mib(raw, key=k.GPU_MEMORY_LIMIT)
    except RuleViolation as rule:
        violation(rule)
        return None, None
    if limit < request:
        violation(LimitBelowRequest(key=k.GPU_MEMORY_LIMIT, value=raw, detail=f"gpu-memory is {request} MiB"))
        return None, None
    return request, limit


def _memory(
    name: str, nv: Mapping[str, str], violation: Callable[[RuleViolation], None]
) -> tuple[int | None, int | None]:
    """Request and limit MiB (one alone stands for both); None where unreadable or absent."""
    read: dict[str, int | None] = {}
    for suffix in (k.MEMORY_REQUEST, k.MEMORY_LIMIT):
        if suffix in nv:
            try:
                read[suffix] = parse_mib(nv[suffix], key=k.container_key(name, suffix))
            except RuleViolation as rule:
                violation(rule)
                read[suffix] = None
    if not read:
        return None, None
    request = read.get(k.MEMORY_REQUEST, read.get(k.MEMORY_LIMIT))
    limit = read.get(k.MEMORY_LIMIT, read.get(k.MEMORY_REQUEST))
    if request is not None and limit is not None and limit < request:
        violation(
            LimitBelowRequest(
                key=k.memory_limit_key(name), value=nv[k.MEMORY_LIMIT], detail=f"the request is {request} MiB"
            )
        )
        return None, None
    return request, limit
