"""The node agent's Dynamic Resource Allocation driver (docs/dra.md): ResourceSlices for its GPUs."""
