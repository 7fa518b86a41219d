"""The driver's per-cgroup GPU memory limit: set, read back, kept in force (docs/node-agent.md)."""
