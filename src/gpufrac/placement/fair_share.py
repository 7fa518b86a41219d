"""Fair share between queues: which pending pod goes next, and whether a queue may take more GPU memory.

Order (the issue's rule): higher priority first; among equal priority, the queue furthest below its
deserved share (guaranteed GPU MiB in use / deserved MiB, lowest first; a queue with no deserved share
comes last); then earlier arrival. The standing of a queue changes as its pods are placed, so the order
is decided one pod at a time: each queue keeps its pods sorted, and the next pod is the best queue head.

A policy with look-ahead (``Policy.largest_first``) passes ``size``: within a queue and a priority, the
pods of the batch go largest first (then by arrival). The batch holds only pods the scheduler has
already received, so this reorders a burst, never waits for future pods; it is first-fit-decreasing on
the window the scheduler sees anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .model import PendingPod, Queue


class QueueBook:
    """Known queues and the guaranteed GPU MiB each holds (kept by the engine on place/forget)."""

    def __init__(self) -> None:
        self._queues: dict[str, Queue] = {}
        self.usage: dict[str, int] = {}

    def set(self, queue: Queue) -> None:
        self._queues[queue.name] = queue

    def get(self, name: str) -> Queue:
        return self._queues.get(name) or Queue(name)

    def charge(self, name: str, mib: int) -> None:
        self.usage[name] = self.usage.get(name, 0) + mib

    def over_limit(self, name: str, mib: int) -> bool:
        limit = self.get(name).gpu_memory_limit_mib
        return limit is not None and self.usage.get(name, 0) + mib > limit

    def standing(self, name: str, cluster_mib: int) -> float:
        """Usage over deserved MiB: lower is further below its share."""
        deserved = self.get(name).deserved_share * cluster_mib
        if deserved <= 0:
            return math.inf
        return self.usage.get(name, 0) / deserved


def scheduling_order(
    pods: Sequence[PendingPod],
    book: QueueBook,
    cluster_mib: int,
    place: Callable[[int], None],
    *,
    size: Callable[[int], tuple[int, ...]] | None = None,
) -> None:
    """Call ``place(i)`` for every pod index in queue order, re-reading queue standing after each.

    ``size(i)``, when given, orders pods of one queue and priority largest first (see module docstring).
    """
    heads: dict[str, list[int]] = {}
    for i, pod in enumerate(pods):
        heads.setdefault(pod.queue, []).append(i)
    sizes = {i: tuple(-v for v in size(i)) for i in range(len(pods))} if size else None
    for members in heads.values():
        # Reverse so the next pod is members[-1] (pop from the end is O(1)).
        if sizes is None:
            members.sort(key=lambda i: (-pods[i].priority, pods[i].arrival, i), reverse=True)
        else:
            members.sort(key=lambda i: (-pods[i].priority, sizes[i], pods[i].arrival, i), reverse=True)
    while heads:
        best_queue = min(
            heads,
            key=lambda q: (
                -pods[heads[q][-1]].priority,
                book.standing(q, cluster_mib),
                pods[heads[q][-1]].arrival,
                heads[q][-1],
            ),
        )
        members = heads[best_queue]
        place(members.pop())
        if not members:
            del heads[best_queue]
