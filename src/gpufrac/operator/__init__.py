"""The cluster operator: GpuFractioningConfig -> the node agent's DaemonSet, readiness and version gates."""
