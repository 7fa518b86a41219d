"""The REAL NVML MIG code (inventory read and MIG control) over a SIMULATED driver: the NVML functions it
calls answer from a small in-memory A100 80GB (no GPU here), with nvidia-ml-py's own error classes,
constants and ctypes structures, so what runs is the code a GPU node runs, as tests/node/test_nvml_faults.py
does for the rest of the inventory. The driver's profile table is the one ``nvidia-smi mig -lgip`` prints
for an A100-SXM4-80GB (IDs 19, 20, 15, 14, 9, 5, 0)."""

from __future__ import annotations

import ctypes
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from gpufrac.contract.quantities import MIB
from gpufrac.mig.geometry import Slice
from gpufrac.node.inventory.nvml import NvmlInventory
from gpufrac.node.mig.control import MigControlError
from gpufrac.node.mig.nvml import NvmlMigControl

#: NVML_GPU_INSTANCE_PROFILE_* -> (profile id, name, compute slices, memory slices, memorySizeMB, count)
A100_80GB = {
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: (19, "MIG 1g.10gb", 1, 1, 9728, 7),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: (20, "MIG 1g.10gb+me", 1, 1, 9728, 1),
    pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2: (15, "MIG 1g.20gb", 1, 2, 19968, 4),
    pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: (14, "MIG 2g.20gb", 2, 2, 19968, 3),
    pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE: (9, "MIG 3g.40gb", 3, 4, 40192, 2),
    pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: (5, "MIG 4g.40gb", 4, 4, 40192, 1),
    pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE: (0, "MIG 7g.80gb", 7, 8, 80896, 1),
}
BY_ID = {v[0]: v for v in A100_80GB.values()}


@dataclass
class GpuInstance:
    id: int
    profile_id: int
    start: int
    compute: bool = False  # has its compute instance (and so a MIG device)


@dataclass
class Driver:
    """An A100 80GB as NVML shows it: MIG mode, GPU instances, their compute instances."""

    mig: bool = True
    pending: bool = True
    resets_itself: bool = False
    instances: list[GpuInstance] = field(default_factory=list)
    names: bool = True  # profile info v2 with a name (older drivers: none)
    fail_compute: bool = False

    def mig_uuid(self, gi: int) -> str:
        return f"MIG-0000000{gi}-aaaa-bbbb-cccc-dddddddddddd"

    def module(self) -> Any:
        error = pynvml.NVMLError

        def gi_of(handle: int) -> GpuInstance:
            found = next((g for g in self.instances if g.id + 1 == handle), None)
            if found is None:
                raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return found

        def profile_info(h: Any, profile: int, version: int = 2) -> Any:
            if profile not in A100_80GB:
                raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
            pid, name, compute, _memory, mb, count = A100_80GB[profile]
            info = types.SimpleNamespace(id=pid, sliceCount=compute, instanceCount=count, memorySizeMB=mb)
            if self.names:
                info.name = name.encode()
            return info

        def get_instances(h: Any, profile_id: int, array: Any, count_ref: Any) -> int:
            found = [g for g in self.instances if g.profile_id == profile_id]
            for i, g in enumerate(found):
                array[i] = g.id + 1
            count_ref._obj.value = len(found)
            return 0

        def gi_info(handle: int) -> Any:
            g = gi_of(handle)
            size = BY_ID[g.profile_id][3]
            return types.SimpleNamespace(
                id=g.id, profileId=g.profile_id, placement=types.SimpleNamespace(start=g.start, size=size)
            )

        def devices() -> list[GpuInstance]:
            return [g for g in self.instances if g.compute]

        def mig_handle(h: Any, index: int) -> Any:
            live = devices()
            if index >= len(live):
                raise error(pynvml.NVML_ERROR_NOT_FOUND)
            return ("mig", live[index].id)

        def uuid_of(h: Any) -> str:
            return self.mig_uuid(h[1]) if isinstance(h, tuple) else "GPU-a100"

        def memory(h: Any, version: Any = None) -> Any:
            if isinstance(h, tuple):
                g = next(g for g in self.instances if g.id == h[1])
                return types.SimpleNamespace(total=(BY_ID[g.profile_id][4] - 100) * MIB, reserved=0)
            return types.SimpleNamespace(total=81920 * MIB, reserved=0)

        def create_gi(h: Any, profile_id: int, placement_ref: Any) -> int:
            placement = placement_ref._obj
            size = BY_ID[profile_id][3]
            wanted = set(range(placement.start, placement.start + size))
            for g in self.instances:
                other = BY_ID[g.profile_id][3]
                if wanted & set(range(g.start, g.start + other)):
                    raise error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi = GpuInstance(
                id=max((g.id for g in self.instances), default=0) + 1,
                profile_id=profile_id,
                start=placement.start,
            )
            self.instances.append(gi)
            return gi.id + 1

        def ci_profile_info(gi: int, profile: int, engine: int, version: int = 2) -> Any:
            g = gi_of(gi)
            compute = BY_ID[g.profile_id][2]
            spans = {n: getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{n}_SLICE") for n in (1, 2, 3, 4, 7)}
            if profile != spans[compute]:  # only the full one is checked here: bigger than the GI is refused
                raise error(
                    pynvml.NVML_ERROR_NOT_SUPPORTED
                    if profile > spans[compute]
                    else pynvml.NVML_ERROR_INVALID_ARGUMENT
                )
            return types.SimpleNamespace(id=100 + profile, instanceCount=1)

        def create_ci(gi: int, profile_id: int) -> int:
            if self.fail_compute:
                raise error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            gi_of(gi).compute = True
            return gi

        def get_cis(gi: int, profile_id: int, array: Any, count_ref: Any) -> int:
            g = gi_of(gi)
            count_ref._obj.value = 1 if g.compute else 0
            if g.compute:
                array[0] = gi
            return 0

        def destroy_ci(ci: int) -> int:
            gi_of(ci).compute = False
            return 0

        def destroy_gi(gi: int) -> int:
            g = gi_of(gi)
            if g.compute:
                raise error(pynvml.NVML_ERROR_IN_USE)  # its compute instances first
            self.instances.remove(g)
            return 0

        def set_mode(h: Any, mode: int) -> int:
            self.pending = mode == pynvml.NVML_DEVICE_MIG_ENABLE
            if self.resets_itself:
                self.mig = self.pending
            return 0

        constants = {
            n: getattr(pynvml, n)
            for n in dir(pynvml)
            if n.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlMemory_"))
        }
        return types.SimpleNamespace(
            **constants,
            c_nvmlGpuInstance_t=ctypes.c_void_p,
            c_nvmlComputeInstance_t=ctypes.c_void_p,
            c_nvmlGpuInstancePlacement_t=pynvml.c_nvmlGpuInstancePlacement_t,
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            nvmlSystemGetDriverVersion=lambda: "615.20.01",
            nvmlSystemGetCudaDriverVersion=lambda: 13040,
            nvmlDeviceGetCount=lambda: 1,
            nvmlDeviceGetHandleByIndex=lambda i: 0,
            nvmlDeviceGetHandleByUUID=lambda u: 0,
            nvmlDeviceGetMigMode=lambda h: (int(self.mig), int(self.pending)),
            nvmlDeviceSetMigMode=set_mode,
            nvmlDeviceGetUUID=uuid_of,
            nvmlDeviceGetIndex=lambda h: 0,
            nvmlDeviceGetMinorNumber=lambda h: 0,
            nvmlDeviceGetName=lambda h: "NVIDIA A100-SXM4-80GB",
            nvmlDeviceGetMemoryInfo=memory,
            nvmlDeviceGetComputeMode=lambda h: 0,
            nvmlDeviceGetGpuInstanceProfileInfo=profile_info,
            nvmlDeviceGetGpuInstances=get_instances,
            nvmlGpuInstanceGetInfo=gi_info,
            nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
            nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
            nvmlDeviceGetGpuInstanceId=lambda h: h[1],
            nvmlDeviceCreateGpuInstanceWithPlacement=create_gi,
            nvmlGpuInstanceGetComputeInstanceProfileInfo=ci_profile_info,
            nvmlGpuInstanceCreateComputeInstance=create_ci,
            nvmlGpuInstanceGetComputeInstances=get_cis,
            nvmlComputeInstanceDestroy=destroy_ci,
            nvmlGpuInstanceDestroy=destroy_gi,
            nvmlEventSetCreate=lambda: "event-set",
            nvmlDeviceRegisterEvents=lambda h, kinds, s: None,
            nvmlEventSetWait_v2=lambda s, t: (_ for _ in ()).throw(error(pynvml.NVML_ERROR_TIMEOUT)),
            nvmlEventSetFree=lambda s: None,
        )


def inventory(driver: Driver) -> NvmlInventory:
    backend = NvmlInventory()
    backend._nvml = driver.module()  # the simulated driver in place of libnvidia-ml
    return backend


def test_a_mig_gpu_is_read_with_its_slices_by_nvml_profile_name_start_uuid_and_memory() -> None:
    driver = Driver(
        instances=[
            GpuInstance(id=1, profile_id=9, start=4, compute=True),  # 3g.40gb@4
            GpuInstance(id=2, profile_id=20, start=0, compute=True),  # 1g.10gb+me@0: read as NVML names it
            GpuInstance(id=3, profile_id=19, start=1),  # no compute instance: no MIG device, not offered
        ]
    )
    (gpu,) = inventory(driver).read().gpus
    assert (gpu.mig, gpu.mig_pending, gpu.mode.value, gpu.withdrawn_because) == (True, True, "mig", None)
    assert [(s.profile, s.start, s.uuid, s.mib) for s in gpu.mig_slices] == [
        ("1g.10gb+me", 0, driver.mig_uuid(2), 9628),
        ("3g.40gb", 4, driver.mig_uuid(1), 40092),  # the MIG device's own memory
    ]
    driver.names = False  # a driver whose profile info has no name: the device plugin's spelling
    assert [s.profile for s in inventory(driver).read().gpus[0].mig_slices] == ["1g.10gb", "3g.40gb"]


def test_mig_off_with_mig_pending_is_read_as_fractions_waiting_for_a_reset() -> None:
    (gpu,) = inventory(Driver(mig=False, pending=True)).read().gpus
    assert (gpu.mode.value, gpu.mig_pending, gpu.mig_slices) == ("fractions", True, ())


def test_the_control_creates_a_full_slice_and_destroys_it_compute_instance_first() -> None:
    driver = Driver(instances=[GpuInstance(id=1, profile_id=9, start=0, compute=True)])
    control = NvmlMigControl(nvml=driver.module())
    uuid = control.create_slice("GPU-a100", "3g.40gb", 4)
    assert uuid == driver.mig_uuid(2)
    assert [(s.profile, s.start, s.uuid) for s in inventory(driver).read().gpus[0].mig_slices] == [
        ("3g.40gb", 0, driver.mig_uuid(1)),
        ("3g.40gb", 4, uuid),
    ]
    with pytest.raises(MigControlError) as caught:
        control.create_slice("GPU-a100", "1g.10gb", 5)  # inside 3g.40gb@4
    assert caught.value.code == "NVML_ERROR_INSUFFICIENT_RESOURCES" and "1g.10gb@5" in str(caught.value)

    control.destroy_slice("GPU-a100", Slice("3g.40gb", 0))  # the driver refuses a GI with a CI: IN_USE
    assert [s.start for s in inventory(driver).read().gpus[0].mig_slices] == [4]
    with pytest.raises(MigControlError, match="NVML_ERROR_NOT_FOUND"):
        control.destroy_slice("GPU-a100", Slice("3g.40gb", 0))


def test_a_compute_instance_that_cannot_be_made_leaves_no_gpu_instance_behind() -> None:
    driver = Driver(fail_compute=True)
    with pytest.raises(MigControlError, match="NVML_ERROR_INSUFFICIENT_RESOURCES"):
        NvmlMigControl(nvml=driver.module()).create_slice("GPU-a100", "7g.80gb", 0)
    assert driver.instances == []


def test_set_mig_mode_says_whether_the_mode_waits_for_a_reset() -> None:
    driver = Driver(mig=False, pending=False)
    control = NvmlMigControl(nvml=driver.module())
    assert control.set_mig_mode("GPU-a100", True) is True  # pending until a reset
    driver.resets_itself = True
    assert control.set_mig_mode("GPU-a100", True) is False and driver.mig


def test_a_reset_that_fails_says_the_command_and_its_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'Unable to reset GPU: in use by another client' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(MigControlError, match=r"--gpu-reset -i GPU-a100 exited 3: Unable to reset GPU"):
        NvmlMigControl(nvml=Driver().module(), reset_command=(str(fake),)).reset_gpu("GPU-a100")
