"""REAL MIG control through NVML (nvidia-ml-py, imported as ``pynvml``). No GPU in CI: tested over a
simulated driver that answers the same calls (tests/node/test_nvml_mig.py), not over libnvidia-ml.

Written against NVML's documented API (NVML API reference, "Multi Instance GPU Management"; the calls'
semantics as cuda-python's NVML bindings document them):

- ``set_mig_mode``: ``nvmlDeviceSetMigMode(device, NVML_DEVICE_MIG_ENABLE|DISABLE)``. "This API may unbind
  or reset the device to activate the requested mode"; its activation status says why it did not (e.g.
  IN_USE: the device is not idle); the mode is then pending. Whether a reset is still needed is read back
  from ``nvmlDeviceGetMigMode``: current differs from pending.
- ``reset_gpu``: ``nvidia-smi --gpu-reset -i <uuid>`` (NVML has no public reset call; NVIDIA's mig-parted
  resets through nvidia-smi too). The agent only calls it with ``mig.allow_gpu_reset: true``.
- ``create_slice``: the profile's info (``nvmlDeviceGetGpuInstanceProfileInfo`` with the
  ``NVML_GPU_INSTANCE_PROFILE_*`` constant of ``gpufrac.mig.profiles``) gives its id;
  ``nvmlDeviceCreateGpuInstanceWithPlacement(device, id, &{start, size})``, size in memory slices as
  ``nvmlDeviceGetGpuInstancePossiblePlacements_v2`` reports it; then one compute instance over the whole GPU
  instance: ``nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE,
  NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)`` for the profile's n compute slices, and
  ``nvmlGpuInstanceCreateComputeInstance(gi, id)``. The MIG device's UUID is read back from the MIG device
  handles (``nvmlDeviceGetMigDeviceHandleByIndex``, ``nvmlDeviceGetGpuInstanceId``, ``nvmlDeviceGetUUID``).
  If the compute instance cannot be made the GPU instance is destroyed again, so a failed create leaves
  nothing half-made.
- ``destroy_slice``: the GPU instance at that start (``nvmlDeviceGetGpuInstances``,
  ``nvmlGpuInstanceGetInfo``), each of its compute instances (``nvmlGpuInstanceGetComputeInstances`` per
  compute-instance profile, ``nvmlComputeInstanceDestroy``), then the GPU instance
  (``nvmlGpuInstanceDestroy``). Both need root (the agent is privileged).
"""

from __future__ import annotations

import ctypes
import subprocess
from typing import Any

from gpufrac.mig.geometry import Slice
from gpufrac.mig.profiles import MigProfile, mig_model
from gpufrac.node.mig.control import MigControlError

#: Compute slices -> the NVML_COMPUTE_INSTANCE_PROFILE_* constant that spans them (nvml.h).
_CI_PROFILES = {
    1: "1_SLICE",
    2: "2_SLICE",
    3: "3_SLICE",
    4: "4_SLICE",
    6: "6_SLICE",
    7: "7_SLICE",
    8: "8_SLICE",
}


class NvmlMigControl:
    """``MigControl`` through NVML. NVML is initialised per call and shut down after it (a MIG change is
    rare; the inventory backend keeps its own session)."""

    def __init__(self, *, nvml: Any = None, reset_command: tuple[str, ...] = ("nvidia-smi",)) -> None:
        if nvml is None:
            import pynvml  # imported here so the simulated path never loads libnvidia-ml

            nvml = pynvml
        self._nvml = nvml
        self._reset_command = reset_command

    def _call(self, what: str, fn: Any) -> Any:
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise MigControlError(_code(nvml, exc), f"NVML cannot be initialised to {what}: {exc}") from exc
        try:
            return fn()
        except nvml.NVMLError as exc:
            raise MigControlError(_code(nvml, exc), f"{what}: {exc}") from exc
        finally:
            nvml.nvmlShutdown()

    def _handle(self, gpu: str) -> Any:
        return self._nvml.nvmlDeviceGetHandleByUUID(gpu)

    def set_mig_mode(self, gpu: str, enabled: bool) -> bool:
        nvml = self._nvml

        def run() -> bool:
            handle = self._handle(gpu)
            mode = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
            nvml.nvmlDeviceSetMigMode(handle, mode)  # its activation status: read back below instead
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            return bool(current != pending)

        return bool(self._call(f"set MIG {'on' if enabled else 'off'} on GPU {gpu}", run))

    def reset_gpu(self, gpu: str) -> None:
        command = [*self._reset_command, "--gpu-reset", "-i", gpu]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MigControlError("RESET_FAILED", f"{' '.join(command)}: {exc}") from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise MigControlError(
                "RESET_FAILED", f"{' '.join(command)} exited {done.returncode}: {said[-1] if said else ''}"
            )

    def create_slice(self, gpu: str, profile: str, start: int) -> str:
        nvml = self._nvml

        def run() -> str:
            handle = self._handle(gpu)
            wanted = _profile(nvml, handle, gpu, profile)
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, wanted.nvml_profile)
            placement = nvml.c_nvmlGpuInstancePlacement_t(start, wanted.memory_slices)
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(placement))
            try:
                ci_profile = getattr(
                    nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{_CI_PROFILES[wanted.compute_slices]}"
                )
                ci = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
                nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci.id)
            except nvml.NVMLError:
                nvml.nvmlGpuInstanceDestroy(gi)  # nothing half-made: a GPU instance nothing can run on
                raise
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
            for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
                try:
                    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
                except nvml.NVMLError_NotFound:
                    continue
                if int(nvml.nvmlDeviceGetGpuInstanceId(mig)) == gi_id:
                    uuid = nvml.nvmlDeviceGetUUID(mig)
                    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            raise nvml.NVMLError(nvml.NVML_ERROR_NOT_FOUND)

        return str(self._call(f"create MIG slice {profile}@{start} on GPU {gpu}", run))

    def destroy_slice(self, gpu: str, slice_: Slice) -> None:
        nvml = self._nvml

        def run() -> None:
            handle = self._handle(gpu)
            wanted = _profile(nvml, handle, gpu, slice_.profile)
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, wanted.nvml_profile)
            found = (nvml.c_nvmlGpuInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetGpuInstances(handle, info.id, found, ctypes.byref(count))
            for i in range(count.value):
                gi = found[i]
                if int(nvml.nvmlGpuInstanceGetInfo(gi).placement.start) != slice_.start:
                    continue
                for ci_name in _CI_PROFILES.values():
                    ci_profile = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{ci_name}", None)
                    if ci_profile is None:
                        continue
                    try:
                        ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                            gi, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                        )
                    except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                        continue
                    cis = (nvml.c_nvmlComputeInstance_t * max(1, int(ci_info.instanceCount)))()
                    ci_count = ctypes.c_uint(0)
                    nvml.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id, cis, ctypes.byref(ci_count))
                    for j in range(ci_count.value):
                        nvml.nvmlComputeInstanceDestroy(cis[j])
                nvml.nvmlGpuInstanceDestroy(gi)
                return
            raise nvml.NVMLError(nvml.NVML_ERROR_NOT_FOUND)

        self._call(f"destroy MIG slice {slice_} on GPU {gpu}", run)


def _profile(nvml: Any, handle: Any, gpu: str, name: str) -> MigProfile:
    model_name = nvml.nvmlDeviceGetName(handle)
    model_name = model_name.decode() if isinstance(model_name, bytes) else str(model_name)
    model = mig_model(model_name)
    profile = model.profile(name) if model is not None else None
    if profile is None:
        raise MigControlError(
            "NVML_ERROR_INVALID_ARGUMENT", f"GPU {gpu} ({model_name}) has no MIG profile {name} gpufrac knows"
        )
    return profile


def _code(nvml: Any, exc: Exception) -> str:
    """NVML's error name (``NVML_ERROR_INSUFFICIENT_RESOURCES``) for an ``NVMLError``."""
    value = getattr(exc, "value", None)
    for name in dir(nvml):
        if name.startswith("NVML_ERROR_") and getattr(nvml, name) == value:
            return name
    return f"NVML_ERROR_{value}"
