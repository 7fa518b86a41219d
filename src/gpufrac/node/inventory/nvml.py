"""REAL GPU inventory from NVML (nvidia-ml-py, imported as ``pynvml``). Untested here: no GPU in CI.

Written against NVML's documented API and only imported by the test suite. Per read: the driver version
(``nvmlSystemGetDriverVersion``), the CUDA version the driver supports (``nvmlSystemGetCudaDriverVersion``,
an int such as 12040 = 12.4), and per device: UUID, index, minor number (the /dev/nvidiaN node), name,
total framebuffer memory (``nvmlDeviceGetMemoryInfo().total``, bytes, floored to MiB), compute mode and
MIG mode. ``nvmlDeviceGetMigMode`` raises NOT_SUPPORTED on GPUs without MIG: that is MIG off. A GPU that
fails while being read (fell off the bus: GPU_IS_LOST) is left out of the inventory, so the publisher
withdraws it; a failing NVML as a whole raises ``InventoryUnavailable``.

NVML is initialised once and kept; a failed read re-initialises on the next call, so a driver reload
(nvidia-smi -r, a driver upgrade) is picked up without restarting the agent.
"""

from __future__ import annotations

from typing import Any

from gpufrac.contract.quantities import MIB
from gpufrac.node.inventory.backend import GpuInfo, InventoryUnavailable, NodeInventory, NvmlComputeMode


class NvmlInventory:
    def __init__(self) -> None:
        try:
            import pynvml  # nvidia-ml-py; imported here so the simulated path never loads libnvidia-ml
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise InventoryUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
        self._nvml: Any = pynvml
        self._initialised = False

    def _init(self) -> None:
        if not self._initialised:
            self._nvml.nvmlInit()
            self._initialised = True

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            self._nvml.nvmlShutdown()

    def read(self) -> NodeInventory:
        nvml = self._nvml
        try:
            self._init()
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            cuda = _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self._initialised = False  # re-initialise next time (driver reloaded, library appeared)
            raise InventoryUnavailable(f"NVML: {exc}") from exc
        gpus = []
        for index in range(count):
            try:
                gpus.append(self._device(index))
            except nvml.NVMLError:
                continue  # lost or unreadable: not offered (the publisher withdraws what is missing)
        return NodeInventory(driver_version=driver, cuda_driver_version=cuda, gpus=tuple(gpus))

    def _device(self, index: int) -> GpuInfo:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig = current == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError_NotSupported:
            mig = False
        return GpuInfo(
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            index=int(nvml.nvmlDeviceGetIndex(handle)),
            minor=int(nvml.nvmlDeviceGetMinorNumber(handle)),
            model=_text(nvml.nvmlDeviceGetName(handle)),
            mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
            compute_mode=_COMPUTE_MODES.get(
                int(nvml.nvmlDeviceGetComputeMode(handle)), NvmlComputeMode.DEFAULT
            ),
            mig=mig,
        )


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
