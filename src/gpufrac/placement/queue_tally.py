"""Amounts by pod uid, with each queue's sum kept as pods come and go.

A preemption burst at 5,000 nodes has thousands of victims leaving and of preemptors nominated at
once, and every decision reads the queue books with both counted (``Engine.queue_shares``). Looking up
every pod and adding it in again on every decision made that the largest part of the burst's loop;
a ``QueueTally`` is kept as plans are filed and closed, and a book reads one sum a queue from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from .queue_shares import Amount, QueueAmount


class QueueTally(Mapping[str, QueueAmount]):
    """``uid -> QueueAmount`` (a read-only mapping to its readers) plus the sum per queue."""

    def __init__(self, items: Iterable[tuple[str, QueueAmount]] = ()) -> None:
        self._by_uid: dict[str, QueueAmount] = {}
        self._sums: dict[str, list[int]] = {}  # queue -> [MiB, whole GPUs, pods]
        for uid, amount in items:
            self.add(uid, amount)

    def add(self, uid: str, amount: QueueAmount) -> None:
        """Count ``uid`` with ``amount`` (in place of what it was counted with, if it was)."""
        self.discard(uid)
        self._by_uid[uid] = amount
        count(self._sums, amount, 1)

    def discard(self, uid: str) -> None:
        amount = self._by_uid.pop(uid, None)
        if amount is not None:
            count(self._sums, amount, -1)

    def totals(self, *, besides: str | None = None) -> list[QueueAmount]:
        """One entry per queue with a pod counted: the sum of its pods' amounts, ``besides`` left out."""
        skip = self._by_uid.get(besides) if besides is not None else None
        out = []
        for queue, (mib, gpus, pods) in self._sums.items():
            if skip is not None and skip.queue == queue:
                mib, gpus, pods = mib - skip.amount.mib, gpus - skip.amount.gpus, pods - 1
            if pods:
                out.append(QueueAmount(queue, Amount(mib, gpus)))
        return out

    def __getitem__(self, uid: str) -> QueueAmount:
        return self._by_uid[uid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_uid)

    def __len__(self) -> int:
        return len(self._by_uid)

    def __contains__(self, uid: object) -> bool:
        return uid in self._by_uid


def count(totals: dict[str, list[int]], ask: QueueAmount, sign: int) -> None:
    """Add (``sign`` 1) or take (-1) ``ask`` to its queue's [MiB, whole GPUs, pods] in ``totals``."""
    total = totals.setdefault(ask.queue, [0, 0, 0])
    total[0] += sign * ask.amount.mib
    total[1] += sign * ask.amount.gpus
    total[2] += sign
