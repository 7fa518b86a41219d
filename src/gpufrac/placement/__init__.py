"""The pure scheduling core: cluster model, per-GPU ledgers, filters, policies, queues and the engine.

No I/O. The scheduler service builds a snapshot from its informers and the simulator builds one from a
trace; both run this same engine.
"""
