"""The annotation contract: quantities, keys, parsing and validation, rendering of binder-owned keys.

Pure: no I/O, imports nothing above it. Every component (webhook, scheduler, node agent, ``validate``)
parses the contract here and nowhere else, so a rule is written once.
"""
