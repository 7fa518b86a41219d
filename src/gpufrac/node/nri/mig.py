"""The NRI handler's MIG branch: which MIG devices a container may be given on this node.

A container placed on MIG slices (docs/mig.md; the contract reads it as ``BoundContainer.mig``) has
the slices' MIG device UUIDs (``MIG-…``) as its devices, as the binder wrote them. It gets exactly
those devices as CDI devices, ``nvidia.com/gpu=<MIG UUID>``: the name that
``nvidia-ctk cdi generate --device-name-strategy=uuid`` gives a MIG device (NVIDIA Container Toolkit
CLI README: one ``nvidia.com/gpu=mig{INDEX}:{MIG_INDEX}`` device per MIG device with the default index
strategy, named by the device's UUID with the uuid strategy), and no fraction variables, no memory
limit and no MPS (``gpufrac.node.inject.plan_bound``): the hardware isolates its memory and SMs.

What is checked against the node's inventory (the GPUs it publishes, ``gpus``' ``mode`` and ``mig``):

- every device of a MIG container must be one of this node's published slices; one that is not
  (another node's, a slice destroyed since the binding, a forged UUID, a GPU) fails the container,
  naming it, as a GPU that is not this node's does;
- a fraction or whole-GPU container is never given a MIG slice, nor a GPU in mode ``mig``: such a GPU
  serves its slices only (a fraction there would share memory and SMs the slices own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpufrac.contract.keys import CDI_GPU_KIND, DEVICE_PLUGIN_CDI_GPU_KIND
from gpufrac.contract.render import BoundContainer
from gpufrac.node.inject import device_name, is_cdi_name, is_mig_device
from gpufrac.node.inventory.backend import GpuInfo, GpuMode, MigSliceInfo
from gpufrac.node.mapping import UNKNOWN_PROFILE

CDI_GPU_KINDS = (CDI_GPU_KIND, DEVICE_PLUGIN_CDI_GPU_KIND)


@dataclass(frozen=True, slots=True)
class NodeSlice:
    """One published slice with the GPU it is carved from."""

    slice: MigSliceInfo
    gpu: GpuInfo


def node_slices(gpus: Iterable[GpuInfo]) -> dict[str, NodeSlice]:
    """The slices of the node's GPUs in mode ``mig``, by MIG UUID."""
    return {s.uuid: NodeSlice(slice=s, gpu=g) for g in gpus if g.mode is GpuMode.MIG for s in g.mig_slices}


def slice_profiles(devices: Sequence[str], gpus: Iterable[GpuInfo] | None) -> tuple[str, ...]:
    """Each device's profile, ``UNKNOWN_PROFILE`` where the inventory (None: not read yet) lacks it."""
    slices = node_slices(gpus or ())
    return tuple(
        slices[name].slice.profile if (name := device_name(d)) in slices else UNKNOWN_PROFILE for d in devices
    )


def slice_mib(devices: Sequence[str], gpus: Iterable[GpuInfo] | None) -> int:
    """The memory of the smallest of ``devices``' slices (0 when none is known): a MIG record's amounts."""
    slices = node_slices(gpus or ())
    return min((slices[n].slice.mib for d in devices if (n := device_name(d)) in slices), default=0)


def mig_device_problem(*, key: str, value: str, bound: BoundContainer, gpus: Sequence[GpuInfo]) -> str | None:
    """Why ``bound``'s devices (the value of ``key``) cannot be given on this node, as MIG slices to a
    MIG container or, to any other, because they are slices or a GPU in mode ``mig``; None when MIG has
    no objection (a fraction's devices are then checked as GPUs)."""
    if bound.mig:
        slices = node_slices(gpus)
        on = sum(1 for g in gpus if g.mode is GpuMode.MIG)
        for device in bound.devices:
            kind = device.partition("=")[0] if is_cdi_name(device) else None
            if (kind is not None and kind not in CDI_GPU_KINDS) or device_name(device) not in slices:
                return (
                    f'{key}="{value}" is invalid: "{device}" is not a MIG slice this node publishes '
                    f"({len(slices)} slice{'' if len(slices) == 1 else 's'} on {on} GPU"
                    f"{'' if on == 1 else 's'} in mode mig, named by MIG UUID or "
                    f"{' or '.join(CDI_GPU_KINDS)}=<MIG UUID>); it may have been destroyed since the "
                    "pod was bound"
                )
        return None
    by_name = {g.uuid: g for g in gpus} | {str(g.index): g for g in gpus}
    for device in bound.devices:
        if is_mig_device(device):
            return (
                f'{key}="{value}" is invalid: "{device}" is a MIG slice and container {bound.container} '
                "asks for no MIG slice (gpufrac.io/container.<c>.mig.profile or mig.gpu-memory)"
            )
        gpu = by_name.get(device_name(device))
        if gpu is not None and gpu.mode is GpuMode.MIG:
            profiles = ", ".join(s.slice_name for s in gpu.mig_slices) or "none yet"
            return (
                f'{key}="{value}" is invalid: GPU "{device}" ({gpu.uuid}) is in mode mig and serves only '
                f"its MIG slices ({profiles}); no fraction or whole GPU is placed on it"
            )
    return None
