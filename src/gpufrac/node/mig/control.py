"""The seam between the layout executor and whatever changes a GPU's MIG state (NVML, or a simulation).

Four operations, as NVML offers them (NVML API reference, "Multi Instance GPU Management"):

- ``set_mig_mode(gpu, enabled) -> needs_reset``: ``nvmlDeviceSetMigMode``. The new mode becomes NVML's
  *pending* mode; it is *current* once the GPU has been reset, which the driver does itself where it can
  (an idle GPU on bare metal) and otherwise leaves to the operator ("Setting MIG mode on the A100/A30
  requires a GPU reset", MIG User Guide, "Deployment Considerations"). True: the mode waits for a reset.
- ``reset_gpu(gpu)``: the reset that makes the pending mode current (``nvidia-smi --gpu-reset``: NVML has no
  public reset call).
- ``create_slice(gpu, profile, start) -> MIG device UUID``: a GPU instance of ``profile`` at ``start``
  (``nvmlDeviceCreateGpuInstanceWithPlacement``) with one compute instance spanning it
  (``nvmlGpuInstanceCreateComputeInstance`` with the full compute-instance profile); fails with
  ``NVML_ERROR_INSUFFICIENT_RESOURCES`` where the placement overlaps a slice already there.
- ``destroy_slice(gpu, slice)``: its compute instances, then the GPU instance (``nvmlComputeInstanceDestroy``,
  ``nvmlGpuInstanceDestroy``).

``gpu`` is the GPU's UUID. Every failure is a ``MigControlError`` whose message names the NVML error.
"""

from __future__ import annotations

from typing import Protocol

from gpufrac.mig.geometry import Slice


class MigControlError(Exception):
    """A MIG operation NVML (or the simulation) refused; ``code`` is NVML's error name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code


class MigControl(Protocol):
    def set_mig_mode(self, gpu: str, enabled: bool) -> bool: ...

    def reset_gpu(self, gpu: str) -> None: ...

    def create_slice(self, gpu: str, profile: str, start: int) -> str: ...

    def destroy_slice(self, gpu: str, slice_: Slice) -> None: ...
