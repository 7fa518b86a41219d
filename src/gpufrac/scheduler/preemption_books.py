"""The queues' books a preemption, reclaim or consolidation decision reads, as they will be.

``Preemptions`` asks for them on every search: the pods leaving gone, the open plans' pods held as
nominees, and (for reclaim's fair shares) the demand of every pod still waiting. They are built at most
once a scheduling cycle and again after a plan is filed (its victims are leaving, its pod is a nominee).

Two books, each built only when asked for. Reclaim (and a gang's search, and the Events that tell a
reclaim's numbers) reads the fair shares, which the waiting pods' demand moves: ``full``. Preemption
reads only what each queue will hold (``QueueShares.exceeded``, its limit check), which that demand
does not change: ``held`` leaves it out. Reading the demand is one look at every waiting pod (its queue
and whether it may join it); during a preemption burst at 5,000 nodes thousands of pods wait and a plan
is filed every decision, so it was rebuilt on every decision and cost more than the victim search.
And that look is taken once a cycle (``QueueStatus.waiting_asks``, which keeps each pod's answer across
cycles until the pod, its namespace or the queues change): while a cycle runs (synchronous code) no
pod, namespace or queue changes; each rebuild takes the per-queue sums less the pods planned or
nominated since (``WaitingAsks.besides``), a look at those few pods only.

The pods leaving and the open plans' pods are thousands too in such a burst, and a book that looked
each one up again was the largest part of the burst's loop after that. Both are ``QueueTally``s,
read as one sum a queue: ``PlannedTally`` is kept as plans are filed and closed; ``LeavingTally`` is
read from the engine once a cycle (a victim's booking could change between cycles) and then kept as
the cycle's plans add their victims.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from lightkube.resources.core_v1 import Pod

from gpufrac.placement.engine import Engine
from gpufrac.placement.preemption import Kind, ShareBook
from gpufrac.placement.queue_shares import QueueAmount
from gpufrac.placement.queue_tally import QueueTally
from gpufrac.scheduler.preemption_events import Plan, plan_amounts
from gpufrac.scheduler.queue_status import WaitingAsks


class PlanBooks:
    """``planned``: the pods open plans make room for and what each will book; ``leaving``: booked
    pods on their way out; ``waiting``: (uid, demand) of the waiting pods that may join their queue,
    with the cycle's own pods, which are out of the scheduling queue while it places them
    (``QueueStatus.waiting_asks``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        planned: Callable[[], Mapping[str, QueueAmount]],
        leaving: Callable[[], set[str]],
        waiting: Callable[[list[Pod]], Iterable[tuple[str, QueueAmount]]],
    ) -> None:
        self._engine = engine
        self._planned = planned
        self._leaving = leaving
        self._waiting = waiting
        self._cycle: list[Pod] = []
        self._full: ShareBook | None = None
        self._held: ShareBook | None = None
        self._asks: WaitingAsks | None = None  # read once a cycle

    def new_cycle(self, pods: Iterable[Pod]) -> None:
        """A cycle starts for ``pods`` (still demand on their queues): both books are built anew."""
        self._cycle = list(pods)
        self._full = self._held = self._asks = None

    def filed(self) -> ShareBook | None:
        """A plan was filed: both books are stale. Returns the full book it was decided on (None when
        none was built: preemption's plans do not tell fair shares)."""
        full, self._full, self._held = self._full, None, None
        return full

    def of(self, kind: Kind = Kind.RECLAIM) -> ShareBook:
        """The book a decision of ``kind`` reads: ``Kind.PREEMPT`` the one without the waiting demand."""
        engine = self._engine
        if kind is Kind.PREEMPT:
            if self._held is None:
                self._held = engine.queue_shares(leaving=self._leaving(), nominees=self._planned())
            return self._held
        if self._full is None:
            planned = self._planned()
            if self._asks is None:
                asks = self._waiting(self._cycle)
                self._asks = asks if isinstance(asks, WaitingAsks) else WaitingAsks(asks)
            waiting = self._asks.besides(engine, planned)
            self._full = engine.queue_shares(leaving=self._leaving(), waiting=waiting, nominees=planned)
        return self._full


class PlannedTally:
    """What the pods open plans make room for will book (``Preemptions.planned``), kept as plans are
    filed and closed. A pod two open plans make room for (a gang's member with a plan of its own) is
    counted as ``plan_amounts`` over every open plan counts it: the tally is read afresh while any
    pod is in more than one open plan."""

    def __init__(self, open_plans: Callable[[], Iterable[tuple[Plan, str]]]) -> None:
        self._open_plans = open_plans
        self._plans_of: dict[str, int] = {}  # pod uid -> open plans making room for it
        self._tally: QueueTally | None = None

    def get(self) -> QueueTally:
        if self._tally is None:
            self._tally = QueueTally(plan_amounts(self._open_plans()).items())
        return self._tally

    def filed(self, plan: Plan, queue: str) -> None:
        for uid, amount in plan_amounts([(plan, queue)]).items():
            plans = self._plans_of[uid] = self._plans_of.get(uid, 0) + 1
            if self._tally is None:
                continue
            if plans > 1:
                self._tally = None
            else:
                self._tally.add(uid, amount)

    def closed(self, plan: Plan, queue: str) -> None:
        """``plan`` is no longer open (called once per filed plan)."""
        for uid in plan_amounts([(plan, queue)]):
            plans = self._plans_of.pop(uid, 0) - 1
            if plans > 0:
                self._plans_of[uid] = plans
                self._tally = None
            elif self._tally is not None:
                self._tally.discard(uid)


class LeavingTally:
    """What the pods on their way out hold (``Preemptions.leaving_pods``), by queue: read from the
    engine at the first book of a cycle, then the victims of the cycle's plans added as they are filed.
    Any other change (a pod gone, a plan closed: between cycles) makes it read afresh."""

    def __init__(self, engine: Engine, leaving: Callable[[], Iterable[str]]) -> None:
        self._engine = engine
        self._leaving = leaving
        self._tally: QueueTally | None = None

    def get(self) -> QueueTally:
        if self._tally is None:
            self._tally = QueueTally()
            self.add(self._leaving())
        return self._tally

    def add(self, uids: Iterable[str]) -> None:
        if self._tally is None:
            return
        for uid in uids:
            amount = self._engine.booked_amount(uid)
            if amount is not None:
                self._tally.add(uid, amount)

    def stale(self) -> None:
        self._tally = None
