"""The fewest GPUs a set of GPU shares could fill: how well did a replay pair the shares it placed?

A replay ends with shares on GPUs and room left between them. Knowing every one of those shares in
advance, and ignoring nodes, CPU, host memory and arrival order, how few GPUs could hold them? That is
bin packing, and this module gives both sides of the answer:

- ``first_fit_decreasing``: a packing (largest share first, into the first GPU with room);
- ``fewest_bins_bound``: a number of GPUs no packing can go below, the linear relaxation of the
  cutting-stock model (Gilmore and Gomory), solved by column generation. The bound is certified: it is
  computed from a dual solution whose value on every possible GPU content is checked by an exact
  knapsack, so a numerical slip in the small simplex here can only weaken it, never make it wrong.

Sizes are integers (thousandths of a GPU in the replays); the bench that uses this is
``bench/placement_waste.py`` (issue 16).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

_MAX_ROUNDS = 1000
_EPS = 1e-9


def _check(sizes: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive integer, got {capacity}")
    for s in sizes:
        if not 0 < s <= capacity:
            raise ValueError(f"share size {s} is outside (0, capacity={capacity}]: it cannot go on one GPU")


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Each GPU's shares, largest first, each into the lowest-numbered GPU with room for it."""
    _check(sizes, capacity)
    n = len(sizes)
    # A max tree over the free room of the GPUs opened so far: the leftmost GPU with room in O(log n).
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    room = [0] * (2 * leaves)
    bins: list[list[int]] = []
    for s in sorted(sizes, reverse=True):
        if room[1] >= s:
            i = 1
            while i < leaves:
                i = 2 * i if room[2 * i] >= s else 2 * i + 1
            b = i - leaves
            bins[b].append(s)
        else:
            b = len(bins)
            bins.append([s])
            i = leaves + b
            room[i] = capacity
        i = leaves + b
        room[i] -= s
        i //= 2
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i //= 2
    return bins


def _best_content(values: np.ndarray, sizes: list[int], capacity: int) -> tuple[float, list[int]]:
    """The GPU content (how many of each size) of the highest total value that fits: exact knapsack."""
    best = [0.0] * (capacity + 1)
    last = [-1] * (capacity + 1)
    for c in range(1, capacity + 1):
        best[c], last[c] = best[c - 1], -2  # -2: one unit of capacity left unused
        for i, s in enumerate(sizes):
            if s <= c and best[c - s] + values[i] > best[c] + _EPS:
                best[c], last[c] = best[c - s] + values[i], i
    counts = [0] * len(sizes)
    c = capacity
    while c > 0 and last[c] != -1:
        if last[c] == -2:
            c -= 1
        else:
            counts[last[c]] += 1
            c -= sizes[last[c]]
    return best[capacity], counts


def _max_dual(contents: list[list[int]], demand: np.ndarray) -> np.ndarray:
    """Maximise demand . y subject to content . y <= 1 for every content, y >= 0 (simplex, Bland's rule).

    The slack basis is feasible (every right-hand side is 1), so no first phase is needed.
    """
    a = np.array(contents, dtype=float)
    m, n = a.shape
    tableau = np.zeros((m + 1, n + m + 1))
    tableau[:m, :n] = a
    tableau[:m, n : n + m] = np.eye(m)
    tableau[:m, -1] = 1.0
    tableau[m, :n] = -demand
    basis = list(range(n, n + m))
    for _ in range(50 * (n + m) + 100):
        entering = next((j for j in range(n + m) if tableau[m, j] < -_EPS), None)
        if entering is None:
            break
        column = tableau[:m, entering]
        rows = [r for r in range(m) if column[r] > _EPS]
        ratio = min(tableau[r, -1] / column[r] for r in rows)
        leaving = min((r for r in rows if tableau[r, -1] / column[r] <= ratio + _EPS), key=lambda r: basis[r])
        tableau[leaving] /= tableau[leaving, entering]
        for r in range(m + 1):
            if r != leaving and tableau[r, entering] != 0.0:
                tableau[r] -= tableau[r, entering] * tableau[leaving]
        basis[leaving] = entering
    y = np.zeros(n)
    for r, j in enumerate(basis):
        if j < n:
            y[j] = max(tableau[r, -1], 0.0)
    return y


def fewest_bins_bound(sizes: Sequence[int], capacity: int) -> int:
    """No packing of ``sizes`` into bins of ``capacity`` uses fewer bins than this (see the module)."""
    _check(sizes, capacity)
    if not sizes:
        return 0
    counts = Counter(sizes)
    distinct = sorted(counts, reverse=True)
    demand = np.array([counts[s] for s in distinct], dtype=float)
    contents = [
        [capacity // s if i == j else 0 for j in range(len(distinct))] for i, s in enumerate(distinct)
    ]
    y = np.zeros(len(distinct))
    for _ in range(_MAX_ROUNDS):
        y = _max_dual(contents, demand)
        value, content = _best_content(y, distinct, capacity)
        if value <= 1.0 + 1e-7 or content in contents:
            break
        contents.append(content)
    # Certify: scale y so that no content whatever is worth more than one bin.
    value, _ = _best_content(y, distinct, capacity)
    bound = float(demand @ y) / max(value, 1.0)
    volume = math.ceil(sum(sizes) / capacity)
    return max(volume, math.ceil(bound - 1e-6))
