"""The DRA wire format of gpufrac's driver: device names, our opaque ``GpuShareConfig`` parameters, and a
claim's allocation read back as the shares it holds.

DRA is gpufrac's second front door (docs/dra.md). Its wire format has two readers that must agree to the
MiB: the node's DRA plugin prepares what an allocation says (``gpufrac.node.dra.prepare``), and
gpufrac-scheduler books what an allocation says, its own and kube-scheduler's, after a restart too
(``gpufrac.scheduler.claims``). So the format lives here, beside ``render.read_binding`` (the annotation
path's reader), pure and below both: ``read_allocation`` is the one reader of an allocation, as
``read_binding`` is the one reader of a bound pod, and both give the ``BoundContainer`` that the node's
one planner (``gpufrac.node.inject.plan_bound``) turns into env and mounts.

Reading an allocation (``status.allocation.devices``, resource.k8s.io/v1):

- each result of our driver is one GPU share: ``device`` names a device of our ResourceSlice
  (``device_name``), mapped back to the GPU's UUID through the node's devices;
- ``consumedCapacity.memory`` (consumable capacity, KEP-5075) is the share, rounded up to whole MiB as
  the contract rounds quantities; it is the request, and the limit too unless our opaque configuration
  sets ``memoryLimit`` (a quantity, not below the share: the container may use up to it, as an
  annotation pod's ``gpu-memory.limit`` above its request). A result without it (the
  ``DRAConsumableCapacity`` gate off) holds the whole device: an exclusive GPU, nothing to cap;
- ``consumedCapacity.compute`` (percent of the SMs) of an sm-sharing share is its compute portion, which
  the planner turns into MPS's active-thread percentage as for annotation pods; 0 or none: no ceiling;
- the compute mode comes from our driver's opaque configuration (the chart's DeviceClasses set it, a
  claim may set it too; the claim's own config is applied after the class's, the later wins), default
  time-slicing as in the annotation contract.

A share the reader cannot accept raises ``AllocationError``, whose message names the field, the value and
the rule, as the contract's other refusals do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpufrac.contract import keys
from gpufrac.contract.errors import ContractError
from gpufrac.contract.quantities import parse_mib
from gpufrac.contract.render import BoundContainer
from gpufrac.contract.request import ComputeMode

_LABEL_MAX = 63  # a device name is a DNS label
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


class AllocationError(ValueError):
    """A claim's allocation that cannot be prepared; the message names the field, the value and why."""


def device_name(uuid: str, index: int) -> str:
    """The ResourceSlice device name of a GPU: a DNS label from its UUID (``GPU-8f1c…`` → ``gpu-8f1c…``),
    stable across index changes (the index only names a GPU whose UUID leaves nothing of a label)."""
    text = _NOT_LABEL.sub("-", uuid.lower()).strip("-")[:_LABEL_MAX].rstrip("-")
    return text or f"gpu-{index}"


def mib_quantity(mib: int) -> str:
    """``mib`` MiB in the API server's canonical form (``24576`` → ``24Gi``), so that what is read back
    compares equal to what was written."""
    for suffix, step in (("Ti", 1024 * 1024), ("Gi", 1024)):
        if mib and mib % step == 0:
            return f"{mib // step}{suffix}"
    return f"{mib}Mi"


@dataclass(frozen=True, slots=True)
class ShareConfig:
    """What our opaque configuration says of one request: its compute mode and memory limit."""

    mode: ComputeMode = ComputeMode.TIME_SLICING
    limit: str | None = None  # a quantity (``memoryLimit``); None: the limit is the share


def class_config(mode: ComputeMode | str, *, memory_limit: str | None = None) -> dict[str, Any]:
    """One ``FromClass`` entry of an allocation's ``devices.config``: our opaque ``GpuShareConfig`` with
    ``mode`` (and a ``memoryLimit``), what the chart's DeviceClass of that mode hands the driver; the
    inverse of ``read_share_parameters``."""
    parameters: dict[str, Any] = {
        "apiVersion": keys.DRA_CONFIG_API_VERSION,
        "kind": keys.DRA_CONFIG_KIND,
        keys.DRA_CONFIG_COMPUTE_MODE: ComputeMode(mode).value,
    }
    if memory_limit is not None:
        parameters[keys.DRA_CONFIG_MEMORY_LIMIT] = memory_limit
    return {"source": "FromClass", "opaque": {"driver": keys.DRA_DRIVER_NAME, "parameters": parameters}}


def read_share_parameters(
    parameters: Mapping[str, Any], *, where: str
) -> tuple[ComputeMode | None, str | None]:
    """(computeMode, memoryLimit) of one ``GpuShareConfig`` (None where it sets none); raises
    ``AllocationError`` naming ``where``, the key and the rule. The scheduler reads a claim's own config
    with it too, so both sides accept exactly the same parameters."""
    if (parameters.get("apiVersion"), parameters.get("kind")) != (
        keys.DRA_CONFIG_API_VERSION,
        keys.DRA_CONFIG_KIND,
    ):
        raise AllocationError(
            f"{where}: apiVersion/kind {parameters.get('apiVersion')!r}/{parameters.get('kind')!r} is "
            f"invalid: it must be {keys.DRA_CONFIG_API_VERSION!r}/{keys.DRA_CONFIG_KIND!r}"
        )
    mode: ComputeMode | None = None
    if keys.DRA_CONFIG_COMPUTE_MODE in parameters:
        value = parameters[keys.DRA_CONFIG_COMPUTE_MODE]
        try:
            mode = ComputeMode(value)
        except ValueError:
            known = " or ".join(m.value for m in ComputeMode)
            raise AllocationError(
                f"{where}: {keys.DRA_CONFIG_COMPUTE_MODE}={json.dumps(value)} is invalid: it must be {known}"
            ) from None
    limit = parameters.get(keys.DRA_CONFIG_MEMORY_LIMIT)
    return mode, None if limit is None else str(limit)


def _share_config(config: Iterable[Mapping[str, Any]], request: str) -> ShareConfig:
    found = ShareConfig()
    ordered = sorted(
        config, key=lambda c: c.get("source") == "FromClaim"
    )  # the claim's own after the class's
    for entry in ordered:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != keys.DRA_DRIVER_NAME:
            continue
        requests = entry.get("requests") or []
        if requests and request not in requests and request.split("/")[0] not in requests:
            continue
        parameters = opaque.get("parameters") or {}
        where = f"status.allocation.devices.config opaque parameters of driver {keys.DRA_DRIVER_NAME}"
        mode, limit = read_share_parameters(parameters, where=where)
        if mode is not None:
            found = replace(found, mode=mode)
        if limit is not None:
            found = replace(found, limit=limit)
    return found


def _limit_mib(config: ShareConfig, *, request_mib: int | None, request: str) -> int | None:
    """The share's memory limit in MiB: ``memoryLimit`` when the claim sets one, else the share itself.

    As with the annotation contract, a limit lets a container use memory beyond what it is guaranteed
    (at its own risk when the GPU fills), and a limit below the request is refused."""
    if config.limit is None:
        return request_mib
    key = f"{keys.DRA_CONFIG_MEMORY_LIMIT} of request {request}"
    if request_mib is None:
        raise AllocationError(
            f"{key}={json.dumps(config.limit)} is invalid: a limit applies to a share of a GPU, and this "
            "allocation holds the whole GPU (no consumedCapacity: the DRAConsumableCapacity gate is off)"
        )
    try:
        limit = parse_mib(config.limit, key=key)
    except ContractError as exc:
        raise AllocationError(str(exc)) from None
    if limit < request_mib:
        raise AllocationError(
            f"{key}={json.dumps(config.limit)} is invalid: the limit must not be below the request "
            f"({request_mib} MiB consumed)"
        )
    return limit


def _portion(result: Mapping[str, Any]) -> float | None:
    """An sm-sharing share's compute portion from its consumed ``compute`` percent (None: 0 or absent,
    no thread ceiling)."""
    consumed = (result.get("consumedCapacity") or {}).get(keys.DRA_COMPUTE_CAPACITY)
    if consumed is None:
        return None
    field = f"consumedCapacity.{keys.DRA_COMPUTE_CAPACITY}"
    try:
        percent = float(str(consumed))
    except ValueError:
        raise AllocationError(
            f"{field}={json.dumps(str(consumed))} is invalid: it must be a whole percent from 0 to 100"
        ) from None
    if not 0 <= percent <= 100:
        raise AllocationError(f"{field}={json.dumps(str(consumed))} is invalid: it must be from 0 to 100")
    return percent / 100 if percent > 0 else None


@dataclass(frozen=True, slots=True)
class AllocatedShare:
    """One result of our driver in a claim's allocation: the request it serves, the device (pool and
    name) it was given, and what it holds there as the planner takes it (``bound.container`` is the
    request's name, ``bound.devices`` the GPU's UUID)."""

    request: str
    pool: str
    device: str
    bound: BoundContainer


def read_allocation(claim: Mapping[str, Any], *, uuids: Mapping[str, str]) -> tuple[AllocatedShare, ...]:
    """Pure: the shares of our driver that ``claim`` (a ResourceClaim as a dict) holds, in result order.

    ``uuids`` maps our device names to GPU UUIDs (the devices of the node the claim is allocated on).
    Results of other drivers are skipped. Raises ``AllocationError`` for a claim that is not allocated, a
    device ``uuids`` does not name, and a share or configuration the format does not accept.
    """
    metadata = claim.get("metadata") or {}
    uid = str(metadata.get("uid") or "")
    allocation = (claim.get("status") or {}).get("allocation")
    if not uid or allocation is None:
        raise AllocationError(
            f"ResourceClaim {metadata.get('namespace')}/{metadata.get('name')} is not allocated: "
            "status.allocation is empty, so there is nothing to prepare"
        )
    devices = allocation.get("devices") or {}
    config = devices.get("config") or []
    shares: list[AllocatedShare] = []
    for result in devices.get("results") or []:
        if result.get("driver") != keys.DRA_DRIVER_NAME:
            continue
        device = str(result.get("device"))
        request = str(result.get("request"))
        uuid = uuids.get(device)
        if uuid is None:
            raise AllocationError(
                f"status.allocation.devices.results device={json.dumps(device)} is invalid: this node "
                "publishes no such GPU (it was withdrawn, or the claim was allocated on another node)"
            )
        consumed = (result.get("consumedCapacity") or {}).get(keys.DRA_MEMORY_CAPACITY)
        mib: int | None = None
        if consumed is not None:
            try:
                mib = parse_mib(str(consumed), key=f"consumedCapacity.{keys.DRA_MEMORY_CAPACITY}")
            except ContractError as exc:
                raise AllocationError(str(exc)) from None
        share_config = _share_config(config, request)
        mode = share_config.mode
        bound = BoundContainer(
            container=request,
            devices=(uuid,),
            mode=mode,
            request_mib=mib,
            limit_mib=_limit_mib(share_config, request_mib=mib, request=request),
            compute_portion=_portion(result) if mode is ComputeMode.SM_SHARING else None,
            exclusive=mib is None,
        )
        shares.append(
            AllocatedShare(request=request, pool=str(result.get("pool")), device=device, bound=bound)
        )
    return tuple(shares)
