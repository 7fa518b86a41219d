"""CPU-heavier variants of the default openb pod list, sampled the way the published cpuXXX lists are.

Why: FGD and ``fgd-align`` were tuned on the published lists, where CPU-only pods are a minority; a
policy that is CPU-blind can look good there and lose when CPU-only pods crowd the GPU nodes. The paper's
own cpu050/cpu100 lists have *fewer* CPU-only pods than default, so heavier lists are sampled here.

How the published lists were made (read from the files themselves, shared/data/openb; the data README
says only "more or fewer CPU-only pods"): ``cpu050`` and ``cpu100`` keep every GPU pod of ``default``, in
default's order, and a sample of default's 1,088 CPU-only pods drawn without replacement (375 and 789 of
them: each is a sub-multiset of default's), listed first; rows are renamed ``openb-pod-NNNN`` in file
order. The variants here do the same with more CPU-only pods than default has, so the sample cannot be
drawn without replacement alone: ``cpuNx`` holds ``N x 1,088`` CPU-only pods, every CPU-only pod of
default ``floor(N)`` times plus ``round((N - floor(N)) x 1,088)`` of them drawn without replacement, in
an order shuffled by the same generator. The generator is ``numpy.random.default_rng(VARIANT_SEED)``, so
a variant is one fixed list, like a published file, for every policy and replay seed.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .trace import TracePod

BASE = "default"
"""The published list every variant is sampled from."""
VARIANT_SEED = 2023
VARIANTS: dict[str, float] = {"cpu2x": 2.0, "cpu2.5x": 2.5}
"""Variant name -> how many times default's CPU-only pods it holds."""


def cpu_heavier(pods: list[TracePod], times: float, *, seed: int = VARIANT_SEED) -> list[TracePod]:
    """``pods`` (the default list) with ``times`` as many CPU-only pods (module docstring)."""
    if not math.isfinite(times) or times < 0:
        raise ValueError(f"times must be a finite number >= 0, got {times}")
    cpu_only = [p for p in pods if p.num_gpu == 0 or p.gpu_milli == 0]
    gpu = [p for p in pods if not (p.num_gpu == 0 or p.gpu_milli == 0)]
    rng = np.random.default_rng(seed)
    whole = int(times)
    extra = round((times - whole) * len(cpu_only))
    drawn = cpu_only * whole + [cpu_only[i] for i in rng.choice(len(cpu_only), size=extra, replace=False)]
    drawn = [drawn[i] for i in rng.permutation(len(drawn))]
    rows = drawn + gpu
    width = max(4, len(str(len(rows) - 1)))
    return [replace(p, name=f"openb-pod-{i:0{width}d}") for i, p in enumerate(rows)]


def variant(name: str, base: list[TracePod]) -> list[TracePod]:
    """The pod list of variant ``name`` sampled from ``base`` (the default list)."""
    try:
        times = VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None
    return cpu_heavier(base, times)
