"""MIG (Multi-Instance GPU): each MIG-capable model's profiles and the geometry of a layout.

Pure: no I/O, imports nothing of gpufrac, so the contract, the placement engine, the node agent and the
simulator all judge a layout by the same tables and rules (docs/mig.md).
"""
