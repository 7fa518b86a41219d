"""Garbage-collector settings for the long-lived controllers (scheduler, operator).

Why: their informer caches hold hundreds of thousands of Python objects (every pod and node of the
cluster, decoded), and CPython's default collector (a young-generation pass every 700 net allocations,
and full passes that walk the whole heap) spent about 15 % of the scheduler's CPU in a 5,000-pod burst
on 1,000 nodes: 837 young, 76 middle and 6 full passes, the full ones 128 ms each
(docs/benchmarks.md, "What the ratio measures, the collector, ..."). Two settings, as large Python
services do:

- the objects alive once the process has imported its code and built its controller (modules,
  classes, the configuration) are moved out of the collector's reach with ``gc.freeze``: they live as
  long as the process, and no full pass walks them again;
- the young generation is collected every ``YOUNG_THRESHOLD`` net allocations instead of 700, which
  leaves the older generations' own thresholds to trigger the rare full passes.

Reference counting still frees every object the moment its last reference goes; the collector is
only for cycles, which now wait a little longer to be freed. Nothing frozen is lost: it was reachable
at the time, and an acyclic object that is dropped later is still freed by reference counting.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
"""Net allocations between young-generation passes (CPython's default: 700)."""


def tune_collector() -> tuple[int, int, int]:
    """Freeze what is alive now and raise the young generation's threshold; returns the old thresholds."""
    previous = gc.get_threshold()
    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, previous[1], previous[2])
    return previous
