"""When the scheduler may search for preemption victims or consolidation moves, and what it remembers.

A search (``find_victims``, ``plan_consolidation`` and their gang twins) is the expensive part of
preemption: tens to hundreds of milliseconds in a full 8,000-GPU cluster (bench/preemption_speed.py), on
the event loop that also renews the lease, binds and handles watch events, and a full cluster retries its
parked pods on every change. ``Preemptions`` decides what a plan is and carries it out; this module decides
whether a search runs at all, and keeps what one search leaves for the next:

- per cycle, ``CycleBudget``: a scheduling cycle searches for at most ``SEARCH_BUDGET_S``; the pods past
  it are deferred to later cycles, spread by the measured cost of one search.
- per pod or gang, ``SearchMemory``: after a consolidation search found no plan, the pod is not searched
  again for a backoff that doubles up to a maximum (its own placement is still tried on every change);
  a plan the ``MoveBudget`` cannot pay for now is not started, and the parked pods are tried again
  (one timer at a time) once it has refilled. And the victims a PodDisruptionBudget refused for a pod
  stay aside for it for ``REFUSAL_MEMORY_S``.

What is remembered per pod is forgotten when the pod is gone (``SearchMemory.forget``) or, for a gang's
key and a pod that was placed rather than deleted, once it is stale (``SearchMemory.prune``): a scheduler
runs for months. Collaborators come in as callables (the clock, ``retry``, ``spawn``); nothing here
knows the open plans or the API.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gpufrac.placement.consolidation import Consolidation, MoveBudget, NoConsolidation, Why
from gpufrac.placement.gang_preemption import GangPreemption

#: How long a victim a disruption budget refused stays aside for the pod that wanted it.
REFUSAL_MEMORY_S = 60.0
#: Most seconds one scheduling cycle spends searching for victims or moves. The cycle's other pods that
#: fit nowhere are tried again in a later cycle, after the event loop has run: lease renewals, binds and
#: watch events wait while a cycle runs, and a burst of 2,000 preemptors on a full 8,000-GPU cluster
#: searched for seconds at a stretch until the scheduler lost its lease (bench/preemption_e2e.py).
SEARCH_BUDGET_S = 0.1
#: After a consolidation search found no plan for a pod, it is not searched again for this long, doubled
#: at each further miss up to the maximum. The search costs tens to hundreds of milliseconds in a full
#: 8,000-GPU cluster (bench/preemption_speed.py) and a full cluster retries its parked pods on every
#: change; the pod's own placement is still tried on every change.
NO_PLAN_BACKOFF_S = 10.0
NO_PLAN_BACKOFF_MAX_S = 160.0

Moves = Consolidation | GangPreemption  # a consolidation plan: a pod's, or a gang's (kind CONSOLIDATE)


class CycleBudget:
    """The search time of one scheduling cycle. ``deferred`` counts the searches it put off."""

    def __init__(self, budget_s: float = SEARCH_BUDGET_S) -> None:
        self._budget_s = budget_s
        self._searched_s = 0.0
        self._searched = False
        self._cost_s: float | None = None  # a moving average of one search
        self._deferred_in_cycle = 0
        self.deferred = 0

    def new_cycle(self) -> None:
        """A scheduling cycle starts: its search budget is full again."""
        self._searched_s = 0.0
        self._searched = False
        self._deferred_in_cycle = 0

    def deferral_s(self) -> float:
        """How long the next pod deferred in this cycle waits. Deferred pods come back spread by the
        measured cost of a search, so each later cycle meets about as many of them as its budget can
        search (placing all of them again every cycle cost more than the searches)."""
        self._deferred_in_cycle += 1
        return self._deferred_in_cycle * max(self._cost_s or 0.0, 0.001)

    def run(self, answered: bool, search: Callable[[], str]) -> str | None:
        """``search()``, timed against this cycle's budget; None when the budget is spent. ``answered``:
        no search is needed (an open plan answers), so neither the budget nor the clock applies."""
        if answered:
            return search()
        if self._spent():
            return None
        started = time.perf_counter()
        try:
            return search()
        finally:
            seconds = time.perf_counter() - started
            self._searched_s += seconds
            cost = self._cost_s
            self._cost_s = seconds if cost is None else 0.8 * cost + 0.2 * seconds

    def _spent(self) -> bool:
        """Whether this cycle's budget is spent (one search per cycle always runs, so every pod gets
        its turn however slow a search is)."""
        if not self._searched or self._searched_s < self._budget_s:
            self._searched = True
            return False
        self.deferred += 1
        return True


class SearchMemory:
    """Refusals and consolidation backoffs by pod uid or gang key, and the move budget's retry timer.

    ``retry``: the cluster changed, try parked pods again; ``spawn``: run a task the service drains at
    shutdown; ``clock``: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        retry: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._clock = clock
        self._retry = retry
        self._spawn = spawn
        self._retry_armed = False
        self._refused: dict[str, dict[str, float]] = {}  # pod uid or gang key -> victim uid -> when
        # Pod uid or gang key -> (search again at, delay, why).
        self._no_plan: dict[str, tuple[float, float, str]] = {}
        self._pruned_at = clock()

    def refused(self, key: str, victim: str) -> None:
        """A disruption budget refused evicting ``victim`` for the pod or gang filed under ``key``."""
        self._refused.setdefault(key, {})[victim] = self._clock()

    def refusals(self, key: str) -> set[str]:
        """The victims refused for ``key`` within the last ``REFUSAL_MEMORY_S``."""
        now = self._clock()
        refused = self._refused.get(key, {})
        for victim, when in list(refused.items()):
            if now - when > REFUSAL_MEMORY_S:
                del refused[victim]
        return set(refused)

    def forget(self, key: str) -> None:
        """The pod is gone: nothing is remembered for it."""
        self._no_plan.pop(key, None)
        self._refused.pop(key, None)

    @property
    def remembered(self) -> int:
        """Pods and gangs with a refusal or a consolidation backoff remembered (bounded by ``prune``)."""
        return len(self._refused.keys() | self._no_plan.keys())

    def prune(self) -> None:
        """Forget refusals older than ``REFUSAL_MEMORY_S`` and backoffs that ended long ago, at most once
        a ``REFUSAL_MEMORY_S``: a gang's key, and a pod that was placed rather than deleted, are never
        forgotten otherwise, and a scheduler runs for months. A backoff forgotten early only restarts
        at ``NO_PLAN_BACKOFF_S``."""
        now = self._clock()
        if now - self._pruned_at < REFUSAL_MEMORY_S:
            return
        self._pruned_at = now
        for key, victims in list(self._refused.items()):
            for victim, when in list(victims.items()):
                if now - when > REFUSAL_MEMORY_S:
                    del victims[victim]
            if not victims:
                del self._refused[key]
        for key, (again_at, _, _) in list(self._no_plan.items()):
            if now - again_at > NO_PLAN_BACKOFF_MAX_S:
                del self._no_plan[key]

    def consolidation(
        self,
        key: str,
        search: Callable[[], Moves | NoConsolidation],
        *,
        budget: MoveBudget,
        where: Callable[[Moves], str],
    ) -> tuple[Moves | None, str]:
        """A consolidation plan (``search``'s, for the pod or gang filed under ``key``) the bound allows
        now, or None and the sentence that says why not. ``search`` runs only when the budget has a move
        left and ``key`` is not backing off; ``where`` names the nodes of a plan for that sentence."""
        bound = f"consolidation.max_moves_per_minute={budget.per_minute}"
        wait = budget.wait_s(1, now=self._clock())
        if wait > 0:
            # Not one move left: no plan could be carried out, so none is searched for (a full cluster
            # retries its parked pods on every change).
            self._retry_after(wait)
            return None, f" Consolidation: deferred by {bound}."
        now = self._clock()
        missed = self._no_plan.get(key)
        if missed is not None and now < missed[0]:
            return None, f" Consolidation: {missed[2]}."
        outcome = search()
        if isinstance(outcome, NoConsolidation):
            if outcome.why is Why.NO_PLAN:
                delay = NO_PLAN_BACKOFF_S if missed is None else min(NO_PLAN_BACKOFF_MAX_S, 2 * missed[1])
                self._no_plan[key] = (now + delay, delay, outcome.detail)
            return None, f" Consolidation: {outcome.detail}."
        self._no_plan.pop(key, None)
        count = len(outcome.moves)
        if budget.take(count, now=now):
            return outcome, ""
        wait = budget.wait_s(count, now=now)
        head = f" Consolidation would move {count} pod(s) off {where(outcome)}"
        if math.isinf(wait):
            return None, f"{head}, more than {bound} allows."
        self._retry_after(wait)
        return None, f"{head}; deferred by {bound}."

    def _retry_after(self, seconds: float) -> None:
        """Try parked pods again once the move budget has refilled (one timer at a time)."""
        if self._retry_armed:
            return
        self._retry_armed = True

        async def later() -> None:
            try:
                await asyncio.sleep(seconds)
            finally:
                self._retry_armed = False
            self._retry()

        self._spawn(later())
