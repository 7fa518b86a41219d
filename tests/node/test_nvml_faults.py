"""The REAL NVML inventory backend over a SIMULATED driver: the NVML functions it calls answer from a
small in-memory GPU table (no GPU here), with nvidia-ml-py's own error classes and constants, so the
backend's handling of memory info v2, XID events, lost GPUs and resets is what runs on a GPU node."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from gpufrac.contract.quantities import MIB
from gpufrac.node.inventory.nvml import NvmlInventory


@dataclass
class SimGpu:
    uuid: str
    total: int = 80 * 1024 * MIB
    reserved: int = 500 * MIB + 1  # bytes: rounded up to 501 MiB
    state: str = "ok"  # ok | lost | unreadable


@dataclass
class SimDriver:
    """The driver as NVML shows it: GPUs, and XID events waiting in the event set."""

    gpus: list[SimGpu]
    events: list[tuple[int, int]] = field(default_factory=list)  # (gpu index, xid)
    v2: bool = True

    def module(self) -> Any:
        error = pynvml.NVMLError

        def handle(index: int) -> int:
            return index

        def device(h: int) -> SimGpu:
            gpu = self.gpus[h]
            if gpu.state == "lost":
                raise error(pynvml.NVML_ERROR_GPU_IS_LOST)
            if gpu.state == "unreadable":
                raise error(pynvml.NVML_ERROR_UNKNOWN)
            return gpu

        def memory(h: int, version: Any = None) -> Any:
            gpu = device(h)
            if version is not None and not self.v2:
                raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return types.SimpleNamespace(total=gpu.total, reserved=gpu.reserved)

        def mig_mode(h: int) -> tuple[int, int]:
            device(h)
            return (0, 0)  # MIG off (current, pending)

        def index_of(h: int) -> int:
            device(h)
            return h

        def wait(_set: Any, _timeout_ms: int) -> Any:
            if not self.events:
                raise error(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = self.events.pop(0)
            return types.SimpleNamespace(
                eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid, device=index
            )

        return types.SimpleNamespace(
            NVMLError=error,
            NVMLError_Timeout=pynvml.NVMLError_Timeout,
            NVMLError_GpuIsLost=pynvml.NVMLError_GpuIsLost,
            NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
            NVML_DEVICE_MIG_ENABLE=pynvml.NVML_DEVICE_MIG_ENABLE,
            nvmlMemory_v2=pynvml.nvmlMemory_v2,
            nvmlEventTypeXidCriticalError=pynvml.nvmlEventTypeXidCriticalError,
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            nvmlSystemGetDriverVersion=lambda: "615.20.01",
            nvmlSystemGetCudaDriverVersion=lambda: 13040,
            nvmlDeviceGetCount=lambda: len(self.gpus),
            nvmlDeviceGetHandleByIndex=handle,
            nvmlDeviceGetMigMode=mig_mode,
            nvmlDeviceGetUUID=lambda h: self.gpus[h].uuid,
            nvmlDeviceGetIndex=index_of,
            nvmlDeviceGetMinorNumber=lambda h: h,
            nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
            nvmlDeviceGetMemoryInfo=memory,
            nvmlDeviceGetComputeMode=lambda h: 0,
            nvmlEventSetCreate=lambda: "event-set",
            nvmlDeviceRegisterEvents=lambda h, kinds, s: None,
            nvmlEventSetWait_v2=wait,
            nvmlEventSetFree=lambda s: None,
        )


@pytest.fixture
def driver() -> SimDriver:
    return SimDriver(gpus=[SimGpu(uuid="GPU-a"), SimGpu(uuid="GPU-b")])


def backend(driver: SimDriver) -> NvmlInventory:
    inventory = NvmlInventory()
    inventory._nvml = driver.module()  # the simulated driver in place of libnvidia-ml
    return inventory


def test_memory_info_v2_gives_the_driver_reserve_and_without_v2_none(driver: SimDriver) -> None:
    (a, _) = backend(driver).read().gpus
    assert (a.mib, a.reserved_mib) == (80 * 1024, 501)
    driver.v2 = False
    (a, _) = backend(driver).read().gpus
    assert (a.mib, a.reserved_mib) == (80 * 1024, None)  # the configured reserve applies


def test_a_fatal_xid_withdraws_until_the_gpu_is_reset_and_an_application_xid_does_not(
    driver: SimDriver,
) -> None:
    nvml = backend(driver)
    assert [g.withdrawn_because for g in nvml.read().gpus] == [None, None]
    driver.events += [(0, 13), (1, 48)]  # 13: the application's fault; 48: double-bit ECC error
    a, b = nvml.read().gpus
    assert a.xid is None and b.xid == 48 and "XID 48" in (b.withdrawn_because or "")
    assert nvml.read().gpus[1].xid == 48  # still withdrawn at the next read: it needs a reset

    driver.gpus[1].state = "unreadable"  # being reset
    assert [g.uuid for g in nvml.read().gpus] == ["GPU-a"]
    driver.gpus[1].state = "ok"
    assert [g.withdrawn_because for g in nvml.read().gpus] == [None, None]


def test_a_gpu_off_the_bus_is_named_as_it_was(driver: SimDriver) -> None:
    nvml = backend(driver)
    nvml.read()
    driver.gpus[0].state = "lost"
    a, b = nvml.read().gpus
    assert (a.uuid, a.lost, a.withdrawn_because) == ("GPU-a", True, "it fell off the bus (NVML: GPU is lost)")
    assert b.withdrawn_because is None
    driver.gpus[0].state = "ok"
    assert not nvml.read().gpus[0].lost
