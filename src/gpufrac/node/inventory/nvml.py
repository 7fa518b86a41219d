"""REAL GPU inventory from NVML (nvidia-ml-py, imported as ``pynvml``). No GPU in CI: tested over a
simulated driver that answers the same calls (tests/node/test_nvml_faults.py), not over libnvidia-ml.

Written against NVML's documented API. Per read: the driver version
(``nvmlSystemGetDriverVersion``), the CUDA version the driver supports (``nvmlSystemGetCudaDriverVersion``,
an int such as 12040 = 12.4), and per device: UUID, index, minor number (the /dev/nvidiaN node), name,
total framebuffer memory and what the driver reserves of it (``nvmlDeviceGetMemoryInfo`` with
``nvmlMemory_v2``: ``total`` floored and ``reserved`` rounded up to MiB; the v1 call and no reserve where
the driver lacks v2), compute mode and MIG mode. ``nvmlDeviceGetMigMode`` raises NOT_SUPPORTED on GPUs
without MIG: that is MIG off. A failing NVML as a whole raises ``InventoryUnavailable``.

MIG (docs/mig.md). ``nvmlDeviceGetMigMode`` gives the current and the pending mode. On a GPU whose current
mode is MIG the GPU instances are read per GPU-instance profile: ``nvmlDeviceGetGpuInstanceProfileInfo``
for each ``NVML_GPU_INSTANCE_PROFILE_*`` the GPU has (the others answer NOT_SUPPORTED or
INVALID_ARGUMENT), ``nvmlDeviceGetGpuInstances`` with that profile's id, and ``nvmlGpuInstanceGetInfo`` for
each instance's id and placement start. The profile's name is NVML's (the v2 info's ``name``,
``MIG 3g.40gb`` -> ``3g.40gb``). The MIG devices (``nvmlDeviceGetMaxMigDeviceCount``,
``nvmlDeviceGetMigDeviceHandleByIndex``, NOT_FOUND for an unused index) give each GPU instance its MIG UUID
(``nvmlDeviceGetGpuInstanceId`` to match, ``nvmlDeviceGetUUID``) and memory (``nvmlDeviceGetMemoryInfo``
on the MIG device; the profile's ``memorySizeMB`` where that fails). A GPU instance without a compute
instance has no MIG device: nothing can run on it, it is left out (the layout executor recreates it).

NVML is initialised once and kept; a failed read re-initialises on the next call, so a driver reload
(nvidia-smi -r, a driver upgrade) is picked up without restarting the agent.

Faults. A device that answers GPU_IS_LOST (fell off the bus) is reported as the GPU it was at the last
read with ``lost=True``, so the publisher names it and why; one that cannot be read at all and was never
seen is left out. Critical XID errors arrive through an NVML event set (``nvmlDeviceRegisterEvents`` with
``nvmlEventTypeXidCriticalError``), drained without waiting at every read; an XID that is not the
application's (``APPLICATION_XIDS``) marks its GPU ``xid=<n>`` until the GPU has been reset: the agent
sees that as the device being unreadable (or lost) at a read and readable again at a later one, or as NVML
initialised again (after a driver reload, which resets every GPU; or an agent restart). A reset too quick
to fall between two reads (5 s apart) is not seen: such a GPU stays withdrawn until the agent restarts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from typing import Any

from gpufrac.contract.quantities import MIB
from gpufrac.node.inventory.backend import (
    APPLICATION_XIDS,
    GpuInfo,
    InventoryUnavailable,
    MigSliceInfo,
    NodeInventory,
    NvmlComputeMode,
)

log = logging.getLogger(__name__)


class NvmlInventory:
    def __init__(self) -> None:
        try:
            import pynvml  # nvidia-ml-py; imported here so the simulated path never loads libnvidia-ml
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise InventoryUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
        self._nvml: Any = pynvml
        self._initialised = False
        self._events: Any = None  # the XID event set
        self._xids: dict[str, int] = {}  # uuid -> the fatal XID it reported since NVML was initialised
        self._seen: dict[int, GpuInfo] = {}  # index -> the GPU as last read (to name a lost one)
        self._went_away: set[str] = set()  # uuids unreadable at some read since their XID: being reset
        self._lock = threading.Lock()  # the publisher and the MIG layout executor read from their threads

    def _init(self) -> None:
        if not self._initialised:
            self._nvml.nvmlInit()
            self._initialised = True
            self._xids.clear()  # a new NVML session: after a reset or a driver reload
            self._events = self._register_xids()

    def _register_xids(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML: no event set, XID errors will not withdraw GPUs: %s", exc)
            return None
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:  # NOT_SUPPORTED on some GPUs: their XIDs go unseen
                log.warning("NVML: XID events of GPU %d not available: %s", index, exc)
        return events

    def _drain_xids(self) -> None:
        nvml = self._nvml
        while self._events is not None:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
            if xid not in APPLICATION_XIDS:
                log.warning("NVML: GPU %s reported XID %d; withdrawn until it is reset", uuid, xid)
                self._xids[uuid] = xid

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
                self._events = None
            self._nvml.nvmlShutdown()

    def read(self) -> NodeInventory:
        with self._lock:
            return self._read()

    def _read(self) -> NodeInventory:
        nvml = self._nvml
        try:
            self._init()
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            cuda = _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
            count = int(nvml.nvmlDeviceGetCount())
            self._drain_xids()
        except nvml.NVMLError as exc:
            self._initialised = False  # re-initialise next time (driver reloaded, library appeared)
            raise InventoryUnavailable(f"NVML: {exc}") from exc
        gpus = []
        for index in range(count):
            try:
                gpu = self._device(index)
            except nvml.NVMLError as exc:
                previous = self._seen.get(index)
                if previous is not None:
                    self._went_away.add(previous.uuid)
                    if isinstance(exc, nvml.NVMLError_GpuIsLost):  # named as it was, so people are told which
                        gpus.append(dataclasses.replace(previous, lost=True))
                continue  # unreadable: not offered (the publisher withdraws what is missing)
            if gpu.uuid in self._went_away:  # readable again after a reset: its XID is history
                self._went_away.discard(gpu.uuid)
                self._xids.pop(gpu.uuid, None)
            gpu = dataclasses.replace(gpu, xid=self._xids.get(gpu.uuid))
            self._seen[index] = gpu
            gpus.append(gpu)
        return NodeInventory(driver_version=driver, cuda_driver_version=cuda, gpus=tuple(gpus))

    def _device(self, index: int) -> GpuInfo:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            mig = current == nvml.NVML_DEVICE_MIG_ENABLE
            mig_pending = pending == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError_NotSupported:
            mig = mig_pending = False
        try:  # memory info v2 (driver r510+) says what the driver reserves for itself
            memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            total, reserved = int(memory.total), -(-int(memory.reserved) // MIB)
        except (nvml.NVMLError, AttributeError):
            total, reserved = int(nvml.nvmlDeviceGetMemoryInfo(handle).total), None
        return GpuInfo(
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            index=int(nvml.nvmlDeviceGetIndex(handle)),
            minor=int(nvml.nvmlDeviceGetMinorNumber(handle)),
            model=_text(nvml.nvmlDeviceGetName(handle)),
            mib=total // MIB,
            reserved_mib=reserved,
            compute_mode=_COMPUTE_MODES.get(
                int(nvml.nvmlDeviceGetComputeMode(handle)), NvmlComputeMode.DEFAULT
            ),
            mig=mig,
            mig_pending=mig_pending,
            mig_slices=read_mig_slices(nvml, handle) if mig else (),
        )


def read_mig_slices(nvml: Any, handle: Any) -> tuple[MigSliceInfo, ...]:
    """The GPU instances of a MIG-enabled GPU that have a MIG device, by start (REAL NVML)."""
    instances: dict[int, tuple[str, int, int]] = {}  # GPU instance id -> (profile, start, profile MiB)
    for profile_index in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue  # a profile this GPU does not have
        if int(info.instanceCount) == 0:
            continue
        name = _profile_name(info)
        found = (nvml.c_nvmlGpuInstance_t * int(info.instanceCount))()
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstances(handle, info.id, found, ctypes.byref(count))
        for i in range(count.value):
            gi = nvml.nvmlGpuInstanceGetInfo(found[i])
            instances[int(gi.id)] = (name, int(gi.placement.start), int(info.memorySizeMB))
    devices: dict[int, tuple[str, int | None]] = {}  # GPU instance id -> (MIG UUID, MiB)
    for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nvml.NVMLError_NotFound:
            continue
        try:
            mib: int | None = int(nvml.nvmlDeviceGetMemoryInfo(mig).total) // MIB
        except nvml.NVMLError:
            mib = None
        devices[int(nvml.nvmlDeviceGetGpuInstanceId(mig))] = (_text(nvml.nvmlDeviceGetUUID(mig)), mib)
    slices = [
        MigSliceInfo(profile=name, start=start, uuid=devices[gi][0], mib=devices[gi][1] or profile_mib)
        for gi, (name, start, profile_mib) in instances.items()
        if gi in devices
    ]
    return tuple(sorted(slices, key=lambda s: s.start))


def _profile_name(info: Any) -> str:
    """``3g.40gb`` from the profile info's v2 name (``MIG 3g.40gb``); from its slices and memory when the
    driver gives no name (the device plugin's spelling: compute slices, memory rounded up to GB)."""
    name = _text(getattr(info, "name", b"") or b"").strip()
    if name:
        return name.removeprefix("MIG ").strip()
    return f"{int(info.sliceCount)}g.{-(-int(info.memorySizeMB) // 1024)}gb"


# nvmlComputeMode_t: NVML_COMPUTEMODE_DEFAULT 0, _EXCLUSIVE_THREAD 1 (deprecated), _PROHIBITED 2,
# _EXCLUSIVE_PROCESS 3
_COMPUTE_MODES = {
    0: NvmlComputeMode.DEFAULT,
    1: NvmlComputeMode.EXCLUSIVE_THREAD,
    2: NvmlComputeMode.PROHIBITED,
    3: NvmlComputeMode.EXCLUSIVE_PROCESS,
}


def _cuda_version(value: int) -> str:
    """NVML's CUDA driver version integer as ``major.minor`` (12040 -> 12.4)."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
