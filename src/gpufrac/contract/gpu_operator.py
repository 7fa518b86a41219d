"""The NVIDIA GPU Operator's node labels that gpufrac reads: when its driver is being upgraded, and where
GPU clients may run. Pure; the names are the GPU Operator's (frozen external contract), not ours.

Driver upgrades. The GPU Operator's upgrade controller walks each node through states in the label
``nvidia.com/gpu-driver-upgrade-state`` (``upgrade-required``, ``cordon-required``,
``wait-for-jobs-required``, ``pod-deletion-required``, ``drain-required``, ``pod-restart-required``,
``validation-required``, ``uncordon-required``, ``upgrade-done``, ``upgrade-failed``). The label is absent
on a node never upgraded; ``upgrade-done`` is the resting value; every other value means the driver is about
to be, or is being, unloaded. While it is, nothing may hold the driver: NVIDIA's GPU-fractioning operator
recorded the unload failing with EBUSY, and the driver DaemonSet crash-looping, while its MPS daemon held
the device files. ``upgrade-failed`` counts as in progress too: the driver is in an unknown state until
someone acts.

GPU clients. The GPU Operator keeps ``nvidia.com/gpu.deploy.<operand>`` labels per node; third-party
clients of the driver select ``nvidia.com/gpu.deploy.client=true``, and the GPU Operator evicts the pods
that do before it unloads the driver (they hold no ``nvidia.com/gpu`` resource, so its own pod-deletion
step would miss them). A node without the label (no GPU Operator) allows them.
"""

from __future__ import annotations

from collections.abc import Mapping

DRIVER_UPGRADE_STATE_LABEL = "nvidia.com/gpu-driver-upgrade-state"
DRIVER_UPGRADE_DONE = "upgrade-done"
DEPLOY_CLIENT_LABEL = "nvidia.com/gpu.deploy.client"
DEPLOY_CLIENT_ALLOWED = "true"
#: The GPU Operator's per-node switches for its operands (``false``: not deployed on this node), read by
#: the GPU stack gate (``gpufrac.node.gpustack``).
DEPLOY_TOOLKIT_LABEL = "nvidia.com/gpu.deploy.container-toolkit"
DEPLOY_DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"


def driver_upgrade_state(labels: Mapping[str, str] | None) -> str | None:
    """The upgrade state while a driver upgrade is in progress on the node; None when there is none."""
    value = (labels or {}).get(DRIVER_UPGRADE_STATE_LABEL, "")
    return value if value and value != DRIVER_UPGRADE_DONE else None
