"""A resize request of a running fraction: the ``gpufrac.io/container.<c>.resize.*`` keys, parsed.

Why a separate request and not an edit of the pod's own keys: on a bound pod the binder has already
written the resolved MiB into ``nvidia.com/container.<c>.gpu-memory.request``/``.limit``, and those are the
node's only source (``gpufrac.contract.render.read_binding``). A user edit there would reach the node
before the scheduler decided whether the new amount fits beside the GPU's other tenants. So the user
writes the new amounts under our own prefix; the scheduler decides (``gpufrac.scheduler.resize``) and, if
they fit, writes the new resolved MiB and removes the request in one patch.

The forms follow creation's rules, one per container, never mixed:

* ``resize.gpu-memory.request`` / ``resize.gpu-memory.limit``: Kubernetes quantities, whole MiB by
  ceiling; the limit must be at least the request; a limit alone means request = limit, a request alone
  means limit = request.
* ``resize.gpu-fraction`` (in (0, 1)) with an optional ``resize.gpu-fraction.limit`` (greater than the
  fraction, below 1): portions of the pod's own GPU, resolved there as floor(portion x GPU MiB).

* ``resize.gpu-compute.request``: the new compute share of an ``sm-sharing`` container, a portion in
  (0, 1] read as creation reads ``gpu-compute.request``; alone or beside either memory form. The
  scheduler answers by rewriting the binder-owned ``gpu-compute.portion``. Without it the compute share
  stays as bound.

Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gpufrac.contract import keys as k
from gpufrac.contract.errors import (
    ConflictingRequests,
    InvalidComputePortion,
    InvalidFraction,
    InvalidFractionLimit,
    InvalidPodRequest,
    KeyWithoutRequest,
    LimitBelowRequest,
    ResizeNotAllowed,
    RuleViolation,
    UnknownContainer,
)
from gpufrac.contract.parse import _decimal, _fraction_detail, _strict_decimal, _Violations
from gpufrac.contract.request import ComputeMode, GpuMemory, PodGpuRequest


@dataclass(frozen=True, slots=True)
class ResizeAsk:
    """The new amounts one container asks for, per device; ``source`` is the key (and value) that asked.
    ``request``/``limit`` are None when only the compute share changes, ``compute`` None when it stays."""

    container: str
    request: GpuMemory | None
    limit: GpuMemory | None
    source: tuple[str, str]
    compute: float | None = None

    def resolve(self, gpu_mib: int) -> tuple[int, int] | None:
        """(request, limit) in whole MiB on a GPU of ``gpu_mib`` (the limit never below the request); None
        when the memory stays as bound."""
        if self.request is None or self.limit is None:
            return None
        request = self.request.resolve(gpu_mib)
        return request, max(request, self.limit.resolve(gpu_mib))

    def describe(self) -> str:
        """The ask as the user wrote it, for messages (``8Gi``, ``fraction 0.5``)."""
        return f"{self.source[0].rpartition('.resize.')[2]}={self.source[1]}"


def resize_keys(annotations: Mapping[str, str]) -> dict[str, str]:
    """The resize request keys of ``annotations``."""
    return {key: value for key, value in annotations.items() if k.is_resize_key(key)}


def cleared(asks: Mapping[str, str]) -> dict[str, None]:
    """The merge-patch entries that remove every key of ``asks`` (a resize request decided)."""
    return dict.fromkeys(asks)


def parse_resizes(annotations: Mapping[str, str]) -> dict[str, ResizeAsk]:
    """The resize asks of a pod by container; raises ``InvalidPodRequest`` with every violation found."""
    found = _Violations()
    by_container: dict[str, dict[str, str]] = {}
    for key, value in sorted(resize_keys(annotations).items()):
        split = k.split_container_key(key)
        assert split is not None
        by_container.setdefault(split.container, {})[split.suffix] = value
    asks = {}
    for container, entries in by_container.items():
        ask = _parse_container(container, entries, found)
        if ask is not None:
            asks[container] = ask
    if found.found:
        raise InvalidPodRequest(found.found)
    return asks


def _parse_container(name: str, entries: Mapping[str, str], found: _Violations) -> ResizeAsk | None:
    memory = dict(entries)
    raw_compute = memory.pop(k.RESIZE_COMPUTE_REQUEST, None)
    compute = None
    if raw_compute is not None:
        compute = _strict_decimal(raw_compute)
        if compute is None or not 0 < compute <= 1:
            key = k.resize_key(name, k.RESIZE_COMPUTE_REQUEST)
            found.add(InvalidComputePortion(key=key, value=raw_compute))
            return None
    if not memory:
        assert raw_compute is not None
        source = (k.resize_key(name, k.RESIZE_COMPUTE_REQUEST), raw_compute)
        return ResizeAsk(name, None, None, source, compute=compute)
    ask = _parse_memory(name, memory, found)
    return ask if ask is None or compute is None else replace(ask, compute=compute)


def _parse_memory(name: str, entries: Mapping[str, str], found: _Violations) -> ResizeAsk | None:
    key = lambda suffix: k.resize_key(name, suffix)  # noqa: E731
    memory = [s for s in (k.RESIZE_MEMORY_REQUEST, k.RESIZE_MEMORY_LIMIT) if s in entries]
    fraction = [s for s in (k.RESIZE_FRACTION, k.RESIZE_FRACTION_LIMIT) if s in entries]
    if memory and fraction:
        found.add(
            ConflictingRequests(
                key=key(fraction[0]),
                value=entries[fraction[0]],
                detail=f"{key(memory[0])} is also set; keep one form",
            )
        )
        return None
    if memory:
        request = (
            found.mib(key(k.RESIZE_MEMORY_REQUEST), entries[k.RESIZE_MEMORY_REQUEST])
            if (k.RESIZE_MEMORY_REQUEST in entries)
            else None
        )
        limit = (
            found.mib(key(k.RESIZE_MEMORY_LIMIT), entries[k.RESIZE_MEMORY_LIMIT])
            if (k.RESIZE_MEMORY_LIMIT in entries)
            else None
        )
        if k.RESIZE_MEMORY_REQUEST in entries and request is None:
            return None
        if k.RESIZE_MEMORY_LIMIT in entries and limit is None:
            return None
        if request is not None and limit is not None and limit < request:
            found.add(
                LimitBelowRequest(
                    key=key(k.RESIZE_MEMORY_LIMIT),
                    value=entries[k.RESIZE_MEMORY_LIMIT],
                    detail=f"the request is {request} MiB",
                )
            )
            return None
        first = memory[0]
        mib_request = request if request is not None else limit
        mib_limit = limit if limit is not None else request
        assert mib_request is not None and mib_limit is not None
        return ResizeAsk(
            name, GpuMemory(mib=mib_request), GpuMemory(mib=mib_limit), (key(first), entries[first])
        )
    if k.RESIZE_FRACTION not in entries:
        raw = entries[k.RESIZE_FRACTION_LIMIT]
        found.add(
            KeyWithoutRequest(
                key=key(k.RESIZE_FRACTION_LIMIT), value=raw, detail=f"set {key(k.RESIZE_FRACTION)}"
            )
        )
        return None
    raw = entries[k.RESIZE_FRACTION]
    portion = _decimal(raw)
    if portion is None or not 0 < portion < 1:
        found.add(
            InvalidFraction(key=key(k.RESIZE_FRACTION), value=raw, detail=_fraction_detail(raw, portion))
        )
        return None
    limit_portion = portion
    if k.RESIZE_FRACTION_LIMIT in entries:
        raw_limit = entries[k.RESIZE_FRACTION_LIMIT]
        read = _decimal(raw_limit)
        if read is None or not portion < read < 1:
            found.add(
                InvalidFractionLimit(
                    key=key(k.RESIZE_FRACTION_LIMIT),
                    value=raw_limit,
                    detail=f"{key(k.RESIZE_FRACTION)} is {raw}",
                )
            )
            return None
        limit_portion = read
    return ResizeAsk(
        name, GpuMemory(portion=portion), GpuMemory(portion=limit_portion), (key(k.RESIZE_FRACTION), raw)
    )


def resize_refusals(
    annotations: Mapping[str, str], request: PodGpuRequest, containers: Sequence[str], *, bound: bool
) -> list[RuleViolation]:
    """Why the resize keys of ``annotations`` cannot apply to this pod: a container that does not exist,
    asks for no GPU or holds whole GPUs or MIG slices, a compute share asked of a container that is not
    sm-sharing, or a pod not placed yet (``bound`` False). Values are judged by ``parse_resizes``."""
    found: list[RuleViolation] = []
    for key, value in sorted(resize_keys(annotations).items()):
        split = k.split_container_key(key)
        assert split is not None
        name = split.container
        wanted = request.container(name)
        if name not in containers:
            detail = "names match exactly; the pod's containers are " + ", ".join(containers)
            found.append(UnknownContainer(key=key, value=value, detail=detail))
        elif wanted is None:
            found.append(ResizeNotAllowed(key=key, value=value, detail=f'container "{name}" asks for no GPU'))
        elif wanted.exclusive:
            detail = f'container "{name}" holds whole GPUs, which are not resized'
            found.append(ResizeNotAllowed(key=key, value=value, detail=detail))
        elif wanted.mig is not None:
            detail = f'container "{name}" holds MIG slices, whose size is their profile\'s'
            found.append(ResizeNotAllowed(key=key, value=value, detail=detail))
        elif split.suffix == k.RESIZE_COMPUTE_REQUEST and wanted.mode is not ComputeMode.SM_SHARING:
            detail = f'container "{name}" runs {wanted.mode.value}, which reserves no compute share'
            found.append(ResizeNotAllowed(key=key, value=value, detail=detail))
        elif not bound:
            found.append(
                ResizeNotAllowed(
                    key=key, value=value, detail="the pod is not placed yet; set it once it runs"
                )
            )
    return found
