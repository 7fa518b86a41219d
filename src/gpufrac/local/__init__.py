"""The embedded local cluster: a real control plane, simulated GPU nodes and every component as a process."""
