"""MIG on the node (docs/mig.md, docs/node-agent.md "MIG"): changing a GPU's MIG mode and slices.

- ``control``   the ``MigControl`` seam (enable/disable MIG, reset, create and destroy a slice) and its errors
- ``nvml``      REAL: the seam through NVML (nvidia-ml-py); no GPU here, tested over a simulated driver
- ``layout``    pure: the ``gpufrac.io/gpu-layout`` annotation parsed and checked, and each GPU's next step
- ``executor``  applies the scheduler's layout to idle GPUs and reports ``gpufrac.io/gpu-layout-status``
- ``modes``     the agent's record of the GPUs it serves whole (a mode no driver knows of)

The SIMULATED control is the simulated inventory itself (``gpufrac.node.inventory.simulated``): its GPUs are
what the control changes.
"""
