"""How fairly the churn replay's queues were served over time: allocation against fair share.

``FairnessMeter`` is told the queue books (``QueueShares``, built with the pending pods' demand) each
time trace time moves on, and weighs them by how long they held. Per queue, while its fair share is
above zero (it holds or asks for something):

* ``ratio``: allocated / fair share, its time-weighted mean and 10th and 90th percentiles;
* ``starved_s``: the seconds it had a pending pod that would have fitted within its fair share
  (allocated + the smallest pending request <= fair share): the time reclaim was entitled to act for it
  and the queue still waited. A queue below its share by less than any of its pods is not starved. The
  churn replay leaves out pods that no node could hold even empty (``gpufrac.sim.churn``): they would
  wait whatever reclaim does, and as demand they would raise their queue's fair share by a claim nothing
  can serve.

Over queues, Jain's fairness index of the same ratios, (sum x)^2 / (n * sum x^2) over the n queues with
a fair share at that moment: 1 when every such queue holds the same fraction of its fair share, 1/n when
one holds everything. It measures fairness, not use (all queues at half their share is 1); its
time-weighted mean is reported, instants where no queue holds anything left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gpufrac.placement.queue_shares import QueueShares


def jain(values: list[float]) -> float:
    """Jain's index of ``values`` (nan when empty or all zero)."""
    total = sum(values)
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return float("nan")
    return total * total / (len(values) * squares)


def weighted_percentile(values: list[float], weights: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` each held for ``weights`` (the smallest value whose
    cumulative weight reaches q % of the total); nan when nothing was weighed."""
    if not values or sum(weights) <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    v = np.asarray(values, dtype=float)[order]
    cum = np.cumsum(np.asarray(weights, dtype=float)[order])
    return float(v[min(int(np.searchsorted(cum, cum[-1] * q / 100.0)), v.size - 1)])


@dataclass
class QueueFairness:
    ratio_mean: float
    ratio_p10: float
    ratio_p90: float
    starved_s: float


class FairnessMeter:
    """Time-weighted allocation against fair share, per queue and as Jain's index (module docstring)."""

    def __init__(self, queues: list[str]) -> None:
        self._queues = queues
        self._ratios: dict[str, tuple[list[float], list[float]]] = {q: ([], []) for q in queues}
        self._starved = dict.fromkeys(queues, 0.0)
        self._jain_sum = 0.0
        self._jain_weight = 0.0

    def hold(self, book: QueueShares, smallest_ask: Mapping[str, int], seconds: float) -> None:
        """The books ``book`` held for ``seconds``; ``smallest_ask`` is each queue's smallest pending
        request (MiB), absent for a queue with nothing pending."""
        if seconds <= 0:
            return
        ratios = []
        for q in self._queues:
            share = book.fair_share(q)
            if share <= 0:
                continue
            held = book.allocated(q)
            ratio = held / share
            ratios.append(ratio)
            values, weights = self._ratios[q]
            values.append(ratio)
            weights.append(seconds)
            ask = smallest_ask.get(q)
            if ask is not None and held + ask <= share:
                self._starved[q] += seconds
        index = jain(ratios)
        if not np.isnan(index):
            self._jain_sum += index * seconds
            self._jain_weight += seconds

    def queue(self, name: str) -> QueueFairness:
        values, weights = self._ratios[name]
        total = sum(weights)
        return QueueFairness(
            ratio_mean=float(np.dot(values, weights) / total) if total else float("nan"),
            ratio_p10=weighted_percentile(values, weights, 10),
            ratio_p90=weighted_percentile(values, weights, 90),
            starved_s=self._starved[name],
        )

    @property
    def jain_index(self) -> float:
        """Jain's index, time-weighted over the instants it is defined."""
        return self._jain_sum / self._jain_weight if self._jain_weight else float("nan")
