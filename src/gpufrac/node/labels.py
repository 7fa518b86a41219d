"""Node-side names the node agent writes on its Node, beyond the contract's (``gpufrac.contract.keys``).

The contract owns what the scheduler reads as part of the annotation contract (the managed label and
taint, the ``gpufrac.io/gpus`` inventory, the readiness condition); the names here describe the node
for operators and for selectors. The compute-mode capability labels are spelled by
``gpufrac.node.mps.mode.NodeMpsCapability.labels`` (``gpufrac.io/compute-mode.<mode>``, ``gpufrac.io/mps``).
"""

from __future__ import annotations

from gpufrac.contract import keys as _contract

# Re-exported: the contract owns these names (the operator reads the driver major and the GPU count, the
# scheduler the GPU model; neither may import the node agent). The GPU count is of the GPUs the node
# publishes, in whichever mode it serves (a MIG GPU counts once; withdrawn GPUs do not count).
from gpufrac.contract.keys import DRIVER_MAJOR_LABEL as DRIVER_MAJOR_LABEL
from gpufrac.contract.keys import GPU_COUNT_LABEL as GPU_COUNT_LABEL
from gpufrac.contract.keys import GPU_MODEL_LABEL as GPU_MODEL_LABEL

#: The CUDA version the driver supports (``13.4``), for selectors; informational.
CUDA_DRIVER_LABEL = "gpufrac.io/cuda-driver"

# Reasons of the gpu-fractioning.nvidia.com/Ready condition: each tells an operator what is missing. The
# contract owns them, so that the scheduler can tell them from another node stack's.
REASON_READY = _contract.NODE_REASON_READY
REASON_INVENTORY_UNAVAILABLE = _contract.NODE_REASON_INVENTORY_UNAVAILABLE
REASON_NO_GPUS = _contract.NODE_REASON_NO_GPUS
REASON_NRI_NOT_CONNECTED = _contract.NODE_REASON_NRI_NOT_CONNECTED
REASON_NO_ENFORCEABLE_MODE = _contract.NODE_REASON_NO_ENFORCEABLE_MODE
REASON_AGENT_STOPPED = _contract.NODE_REASON_AGENT_STOPPED
REASON_CONFLICTING_STACK = _contract.NODE_REASON_CONFLICTING_STACK
REASON_DRIVER_UPGRADE = _contract.NODE_REASON_DRIVER_UPGRADE
