"""The paper's metrics, computed from the per-pod event log of a replay.

After every submitted pod: ``arrived`` is the running sum of requested GPU (num_gpu x gpu_milli, failed
pods included) and ``allocated`` the GPU placed, both as a percentage of cluster capacity. The value "at
X%" is the mean, over all events whose arrived share rounds to X, of the allocated share rounded to 0.01.
Unallocated GPUs = (100 - ratio)% of the cluster's GPUs. The fragmentation rate is the cluster's
fragmentation (against the typical pods) over its free GPU capacity.
"""

from __future__ import annotations

import numpy as np

CURVE_POINTS = np.arange(0, 131)


def allocation_at(arrived_pct: np.ndarray, allocated_pct: np.ndarray, x: int) -> float:
    """Mean allocated share over events whose arrived share rounds to ``x`` (NaN if none)."""
    hits = np.round(arrived_pct) == x
    if not hits.any():
        return float("nan")
    return float(np.mean(np.round(allocated_pct[hits], 2)))


def curve(arrived_pct: np.ndarray, allocated_pct: np.ndarray) -> list[float]:
    """Allocation at every whole arrival percentage 0..130 (NaN where no event rounds there)."""
    bucket = np.round(arrived_pct).astype(np.int64)
    alloc = np.round(allocated_pct, 2)
    sums = np.bincount(bucket, weights=alloc, minlength=CURVE_POINTS.size)[: CURVE_POINTS.size]
    counts = np.bincount(bucket, minlength=CURVE_POINTS.size)[: CURVE_POINTS.size]
    with np.errstate(invalid="ignore", divide="ignore"):
        return [float(v) for v in np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)]


def unallocated_gpus(ratio_pct: float, gpus: int) -> float:
    return (100.0 - ratio_pct) / 100.0 * gpus
