"""The node's GPU inventory: REAL from NVML, SIMULATED for tests, published on the Node.

- ``backend``    the ``GpuInventoryBackend`` seam and the values it returns (what is usable, and why not)
- ``nvml``       REAL: NVML through nvidia-ml-py (untested here: no GPU in CI; imported by the tests)
- ``simulated``  SIMULATED: GPUs from a YAML file or ``--sim-gpus``, changeable while the agent runs
- ``publish``    the Node's inventory annotation, labels, taint and readiness condition, kept current
"""
