"""The scheduler's side of preemption, reclaim and consolidation: evict the chosen pods, then place.

When the engine cannot place a pod, ``Preemptions.consider`` asks ``gpufrac.placement.preemption`` for
victims: first inside the pod's queue by PriorityClass value, then across queues (reclaim, for a queue
below its fair share, judged on the books as they will be: ``leaving_pods`` gone, nominees held, the
waiting pods' demand; ``gpufrac.placement.queue_shares``). Preemption never crosses queues, and a pod
only gets here in a queue its namespace may use, with a priority its queue allows
(``QueueDirectory.refusal`` runs first): another team's queue label and a critical priority buy no
victims (docs/queues.md). A plan is executed through the Eviction API, never a plain DELETE, so
PodDisruptionBudgets are honoured: every victim is first evicted as a dry run, and a refusal (429)
puts that victim aside for this pod and the search runs again without it. Only when the whole set
passes are the victims evicted for real, each exactly once (a pod being evicted is never chosen
again). The pending pod gets ``status.nominatedNodeName``; Events tell both sides (``Preempting`` on
the pod, ``Preempted`` or ``Reclaimed`` on each victim).

No thrash. The victims stay booked in the engine while they terminate (they still hold their GPUs;
booking them off early would let another pod bind onto memory still in use), and a victim that is
gone keeps its booking until the last victim of the plan is gone too. The rest of the pod's room,
memory on its GPUs that is free already, is held for it in the engine (a booking of no pod,
``HOLD_PREFIX`` and the pod's uid). Then, in the same event handler, the victims are released, the
hold is given back and the preempting pod is placed, before any other pod is considered: no pod, a
victim's replacement included, can take the room in between, so nothing is placed where it would be
preempted again at once.

A restart (or a new leader) loses these books, not the plan: the victims are still terminating and
the pod still carries ``status.nominatedNodeName``. When the pods leaving that node free enough room
for it, the new scheduler files the plan again (``_resume``: no eviction is repeated, the room is held,
the pod is placed first when they are gone) instead of choosing new victims; a gang's likewise, from
the nodes its members are nominated to. ``gpufrac.scheduler.preemption_resume`` finds that plan.

Only pods this scheduler placed (or booked as its own) are candidates: a pod bound by another
scheduler is not ours to evict; nor, by ``preemption_gates``, one younger than its queue's min-runtime,
nor anybody for a pod still within ``preemption_delay_s``. Each victim's ``DisruptionTarget`` condition
says why it goes (``disruption_target``).

Consolidation (``gpufrac.placement.consolidation``) is tried when neither preemption nor reclaim has
a plan (or preemption is off): movable pods are evicted the same way (dry run, budgets, Events:
``Moved`` on each, ``Consolidating`` on the pending pod, the nomination), and their controllers
recreate them and the replacements are placed like any pod. The same no-thrash rule keeps them off
the room the moved pods leave, and the hold keeps a replacement arriving while the moved pods
terminate off the rest of the room. A
``MoveBudget`` bounds the moves per minute: a plan it cannot pay for now is not started, the pod's
message says so, and the pod is tried again when the bucket has refilled. When a search may run at all
(a cycle's search budget, a pod's backoff after a search without a plan, the move budget) and the
victims a budget refused are ``gpufrac.scheduler.preemption_pacing``'s to say.

A gang that does not fit (``consider_gang``) is planned for as a whole
(``gpufrac.placement.gang_preemption``): victims, or moves, after which the gang statement places
``minMember`` members, or nothing. Its plan is filed under the gang's key and each member's uid, every
member gets the Events and its own nomination, and when the last victim is gone one member is placed
now, which places the gang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from gpufrac.kube.errors import KubeError, NotFound, TooManyRequests
from gpufrac.kube.events import NORMAL, WARNING, EventRecorder
from gpufrac.kube.eviction import evict_pod
from gpufrac.kube.patch import set_nominated_node
from gpufrac.placement.consolidation import Consolidation, MoveBudget, plan_consolidation
from gpufrac.placement.decision import Placement, Unschedulable
from gpufrac.placement.engine import Engine
from gpufrac.placement.gang_preemption import GangPreemption, find_gang_victims, plan_gang_consolidation
from gpufrac.placement.model import PendingPod
from gpufrac.placement.preemption import (
    Kind,
    Preemption,
    ShareBook,
    any_victims,
    eligible_by_strategy,
    eligible_victims,
    find_victims,
    free_part,
)
from gpufrac.placement.queue_shares import QueueAmount
from gpufrac.scheduler.disruption_target import mark_disruption_target
from gpufrac.scheduler.preemption_books import LeavingTally, PlanBooks, PlannedTally
from gpufrac.scheduler.preemption_events import (
    PREEMPTION_BLOCKED,
    VERB,
    Plan,
    booked_name,
    booked_queue,
    limit_note,
    pod_key,
    pod_ref,
    taking_story,
    victim_story,
    waiting_for,
    where,
    whom,
)
from gpufrac.scheduler.preemption_gates import GateSettings, MinRuntime, PreemptionDelay, Wakeups
from gpufrac.scheduler.preemption_pacing import SEARCH_BUDGET_S, CycleBudget, SearchMemory
from gpufrac.scheduler.preemption_resume import plan_from_leaving

log = logging.getLogger(__name__)

#: The engine booking that holds, for a pod a plan makes room for, what of its room is free already.
HOLD_PREFIX = "room-hold/"


@dataclass(slots=True)
class _Nomination:
    """An open plan. ``pod`` is placed once the victims are gone (for a gang, any member: placing one
    places the gang); ``members`` are the pods it makes room for (a gang's, or just ``pod``), ``keys``
    what it is filed under in ``Preemptions._open`` (the first one owns the victims)."""

    pod: Pod
    plan: Plan
    waiting: set[str]
    keys: tuple[str, ...]
    members: list[Pod]
    gone: set[str] = field(default_factory=set)
    evicting: bool = False
    holds: list[str] = field(default_factory=list)
    #: the queue of the pods it makes room for (a gang's members share one), named in its Events
    queue: str = ""
    book: ShareBook | None = None  # the queues' numbers it was decided with, told in its Events
    closed: bool = False

    @property
    def owner(self) -> str:
        return self.keys[0]


class Preemptions:
    """Open preemptions of one scheduler; the service calls ``consider`` and ``deleted``.

    The service lends what this needs and nothing more: ``victim_pod`` (the latest Pod of a booked
    uid, None for a pod that is not ours), ``release`` (drop a pod's booking), ``place_now`` (place a
    pod at once), ``retry`` (the cluster changed: try parked pods again) and ``spawn`` (run a task the
    service drains at shutdown). ``preempt``: look for preemption and reclaim victims; ``moves``:
    consolidate, within this bound (None: never).
    """

    def __init__(
        self,
        *,
        client: AsyncClient,
        engine: Engine,
        events: EventRecorder,
        victim_pod: Callable[[str], Pod | None],
        release: Callable[[str], bool],
        place_now: Callable[[Pod], None],
        retry: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        waiting: Callable[[list[Pod]], Iterable[tuple[str, QueueAmount]]] = lambda also: (),
        clock: Callable[[], float] = time.monotonic,
        preempt: bool = True,
        moves: MoveBudget | None = None,
        search_budget_s: float = SEARCH_BUDGET_S,
        gates: GateSettings = GateSettings(),
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._engine = engine
        self._events = events
        self._victim_pod = victim_pod
        self._release = release
        self._place_now = place_now
        self._retry = retry
        self._spawn = spawn
        self._planned = PlannedTally(lambda: ((n.plan, n.queue) for n in self._open.values()))
        self._gone = LeavingTally(engine, lambda: self.leaving_pods)
        self._books = PlanBooks(engine, planned=self.planned, leaving=self._gone.get, waiting=waiting)
        self._preempt = preempt
        self._moves = moves
        self._budget = CycleBudget(search_budget_s)
        self._memory = SearchMemory(clock=clock, retry=retry, spawn=spawn)
        wake = Wakeups(wall=wall, retry=retry, spawn=spawn)
        self._young = MinRuntime(queues=lambda: engine.queues.queues, wall=wall, wake=wake, defaults=gates)
        self._delay = PreemptionDelay(gates.delay_s, wall=wall, wake=wake)
        # By the preempting pod's uid; a gang's plan by the gang's key and each member's uid.
        self._open: dict[str, _Nomination] = {}
        self._victim_of: dict[str, str] = {}  # victim uid -> the owner key of its nomination
        self.evictions = self.moved = 0
        self._ours: set[str] = set()  # booked pods this scheduler placed (candidates it may evict)
        self._leaving: set[str] = set()  # booked pods with a deletionTimestamp, until they are gone

    def new_cycle(self, pods: Iterable[Pod] = ()) -> None:
        """A cycle starts for ``pods`` (still demand on their queues): budget full, queue books anew."""
        self._budget.new_cycle()
        self._gone.stale()
        self._books.new_cycle(pods)

    def planned(self) -> Mapping[str, QueueAmount]:
        """The pods open plans make room for, by uid, and what each will book: counted as held. Read by
        every decision's books, so kept as ``_file`` and ``_close`` change the open plans."""
        return self._planned.get()

    @property
    def leaving_pods(self) -> set[str]:
        """Booked pods on their way out (a plan's victims, pods being deleted): no queue counts them."""
        return self._leaving | set(self._victim_of)

    def deferral_s(self) -> float:
        """How long the next pod deferred in this cycle waits (``CycleBudget.deferral_s``)."""
        return self._budget.deferral_s()

    @property
    def deferred(self) -> int:
        """Searches put off to a later cycle, the cycle's budget spent."""
        return self._budget.deferred

    def consider(self, pending: PendingPod, pod: Pod, decision: Unschedulable) -> str | None:
        """The message to report for an unplaceable pod, after starting a preemption if one helps; None
        when this cycle's search budget is spent (try the pod again in the next cycle, unreported)."""
        answered = pending.uid in self._open or not pending.gpu.containers
        return self._budget.run(answered, lambda: self._consider(pending, pod, decision))

    def leaving(self, uid: str) -> None:
        """A booked pod got a deletionTimestamp: it is on its way out (until ``deleted``)."""
        self._leaving.add(uid)
        self._gone.add([uid])

    def _consider(self, pending: PendingPod, pod: Pod, decision: Unschedulable) -> str:
        uid = pending.uid
        self._memory.prune()
        nomination = self._open.get(uid)
        if nomination is not None:
            nomination.pod = pod
            return f"{decision.message} {waiting_for(self._engine, nomination.plan)}"
        if not pending.gpu.containers:
            return decision.message
        nomination = self._resume(
            uid,
            [(pending, pod)],
            lambda kind, exclude: find_victims(
                self._engine, pending, kind=kind, shares=self._books.of(kind), exclude=exclude
            ),
        )
        if nomination is not None:
            return f"{decision.message} {waiting_for(self._engine, nomination.plan)}"
        if wait := self._delay.note([pod]):
            return f"{decision.message}{wait}"
        plan: Preemption | Consolidation | None = None
        self._young.begin(uid)
        for kind in (Kind.PREEMPT, Kind.RECLAIM) if self._preempt else ():
            # The common case, nobody to take from, costs one vectorised mask; the search reuses it.
            eligible = eligible_by_strategy(self._engine, pending, kind=kind, shares=self._books.of(kind))
            candidates = eligible.slots
            if candidates.size == 0:
                continue
            exclude = self._excluded(uid, candidates, kind, pending.queue)
            plan = find_victims(self._engine, pending, kind=kind, exclude=exclude, eligible=eligible)
            if plan is not None:
                break
        note = ""
        if plan is None and self._moves is not None:
            candidates, _ = eligible_victims(self._engine, pending, kind=Kind.CONSOLIDATE)
            plan, note = self._memory.consolidation(
                uid,
                lambda: plan_consolidation(self._engine, pending, exclude=self._excluded(uid, candidates)),
                budget=self._moves,
                where=where,
            )
        if plan is None:
            said, young = decision.message, self._young.note(uid)
            held = self._books.of(Kind.PREEMPT)  # the limit check reads only what the queues will hold
            return f"{said}{note or young or limit_note(self._engine, held, pending, said)}"
        nomination = self._start(plan, pod, [pod], (uid,), queue=pending.queue)
        self._hold(nomination, [(pending, plan.placement)])
        return f"{decision.message} {waiting_for(self._engine, nomination.plan)}"

    def consider_gang(self, key: str, members: list[tuple[PendingPod, Pod]], min_member: int) -> str | None:
        """For a gang the engine could not place: start a preemption (or reclaim) that makes room for
        ``min_member`` of ``members`` together, if one does. Returns what to add to each member's
        message ("" when nothing was started; None when this cycle's search budget is spent, as for
        ``consider``). ``key`` names the gang (it owns the victims)."""
        answered = any(k in self._open for k in (key, *(p.uid for p, _ in members)))
        return self._budget.run(answered, lambda: self._consider_gang(key, members, min_member))

    def _consider_gang(self, key: str, members: list[tuple[PendingPod, Pod]], min_member: int) -> str:
        self._memory.prune()
        nomination = next(
            (n for n in (self._open.get(k) for k in (key, *(p.uid for p, _ in members))) if n is not None),
            None,
        )
        if nomination is not None:
            nomination.members = [pod for _, pod in members]
            return f" {waiting_for(self._engine, nomination.plan)}"
        pendings = [pending for pending, _ in members]
        if not any(p.gpu.containers for p in pendings):
            return ""
        nomination = self._resume(
            key,
            members,
            lambda kind, exclude: find_gang_victims(
                self._engine,
                pendings,
                min_member=min_member,
                kind=kind,
                shares=self._books.of(),
                exclude=exclude,
            ),
        )
        if nomination is not None:
            return f" {waiting_for(self._engine, nomination.plan)}"
        if wait := self._delay.note([pod for _, pod in members]):
            return wait
        plan: GangPreemption | None = None
        self._young.begin(key)
        for kind in (Kind.PREEMPT, Kind.RECLAIM) if self._preempt else ():
            book = self._books.of()
            candidates = np.unique(
                np.concatenate([any_victims(self._engine, p, kind=kind, shares=book) for p in pendings])
            )
            if candidates.size == 0:
                continue
            plan = find_gang_victims(
                self._engine,
                pendings,
                min_member=min_member,
                kind=kind,
                shares=self._books.of(),
                exclude=self._excluded(key, candidates, kind, pendings[0].queue),
            )
            if plan is not None:
                break
        note = ""
        if plan is None and self._moves is not None:
            eligible = [eligible_victims(self._engine, p, kind=Kind.CONSOLIDATE)[0] for p in pendings]
            candidates = np.unique(np.concatenate(eligible))
            moves, note = self._memory.consolidation(
                key,
                lambda: plan_gang_consolidation(
                    self._engine, pendings, min_member=min_member, exclude=self._excluded(key, candidates)
                ),
                budget=self._moves,
                where=where,
            )
            if moves is not None:
                assert isinstance(moves, GangPreemption)
                plan = moves
        if plan is None:
            return note or self._young.note(key)
        pods = [pod for _, pod in members]
        nomination = self._start(
            plan, pods[0], pods, (key, *(p.uid for p in pendings)), queue=pendings[0].queue
        )
        by_uid = {p.uid: p for p in pendings}
        self._hold(nomination, [(by_uid[pl.pod_uid], pl) for pl in plan.placements])
        return f" {waiting_for(self._engine, nomination.plan)}"

    def _resume(
        self,
        key: str,
        members: list[tuple[PendingPod, Pod]],
        search: Callable[[Kind, set[str]], Preemption | GangPreemption | None],
    ) -> _Nomination | None:
        """Take up the plan of the scheduler before this one (a restart, a new leader) for a pod it
        nominated, or for a gang (``key``) whose members it nominated: when the pods already leaving
        their nominated nodes free enough room (``plan_from_leaving``, with ``search``), wait for them
        instead of choosing victims again (kube-scheduler likewise lets no pod preempt while
        lower-priority pods terminate on its nominated node). The plan is filed as if made here: the
        free part of the room is held, and the pod is placed first when the last of them is gone."""
        pendings = [pending for pending, _ in members]
        pods = [pod for _, pod in members]
        plan = plan_from_leaving(
            self._engine,
            pendings,
            pods,
            search,
            leaving=self._leaving,
            taken=self._victim_of.keys(),
            shares=None,  # as the books were when the plan was made: its victims still counted
            preempt=self._preempt,
            consolidate=self._moves is not None,
        )
        if plan is None:
            return None
        if isinstance(plan, GangPreemption):
            nomination = self._file(
                plan, pods[0], pods, (key, *(p.uid for p in pendings)), queue=pendings[0].queue
            )
            by_uid = {p.uid: p for p in pendings}
            self._hold(nomination, [(by_uid[pl.pod_uid], pl) for pl in plan.placements])
        else:
            nomination = self._file(plan, pods[0], pods, (key,), queue=pendings[0].queue)
            self._hold(nomination, [(pendings[0], plan.placement)])
        log.info(
            "%s: waiting again for %d pod(s) leaving %s (a plan made before this scheduler started)",
            whom(nomination),
            len(plan.victims),
            where(plan),
        )
        return nomination

    def _file(
        self, plan: Plan, pod: Pod, members: list[Pod], keys: tuple[str, ...], *, queue: str
    ) -> _Nomination:
        nomination = _Nomination(
            pod=pod, plan=plan, waiting=set(plan.victims), keys=keys, members=members, queue=queue
        )
        for k in keys:
            self._open[k] = nomination
        self._planned.filed(plan, queue)
        for victim in plan.victims:
            self._victim_of[victim] = nomination.owner
        self._gone.add(plan.victims)
        nomination.book = self._books.filed()  # its victims are leaving now
        return nomination

    def _start(
        self, plan: Plan, pod: Pod, members: list[Pod], keys: tuple[str, ...], *, queue: str
    ) -> _Nomination:
        """File a plan and start its evictions."""
        nomination = self._file(plan, pod, members, keys, queue=queue)
        log.info(
            "%s: %s %d pod(s) on %s",
            whom(nomination),
            VERB[plan.kind].lower(),
            len(plan.victims),
            where(plan),
        )
        self._spawn(self._execute(nomination.owner, nomination))
        return nomination

    def deleted(self, uid: str) -> bool:
        """A pod is gone. True when it is a victim whose booking is kept until its plan completes (the
        service must not release it); a preempting pod that is gone gives its plan up."""
        self._memory.forget(uid)
        self._ours.discard(uid)
        self._leaving.discard(uid)
        self._gone.stale()
        nomination = self._open.get(uid)
        if nomination is not None:
            self._close(uid, nomination)
            return False
        owner = self._victim_of.get(uid)
        if owner is None:
            return False
        nomination = self._open[owner]
        nomination.waiting.discard(uid)
        nomination.gone.add(uid)
        if nomination.waiting or nomination.evicting:
            return True
        # The last victim left: release them all and place the pod (or the gang) now, before any other pod.
        self._close(owner, nomination)
        pod = nomination.pod
        self._place_now(pod)
        return True

    def open_plan(self, key: str) -> Plan | None:
        """The plan a pod (by uid) or a gang (by key) is waiting on, if any."""
        nomination = self._open.get(key)
        return None if nomination is None else nomination.plan

    @property
    def remembered(self) -> int:
        """Pods and gangs with a refusal or a consolidation backoff remembered (``SearchMemory``)."""
        return self._memory.remembered

    # -- internals ----------------------------------------------------------------------------------------

    def _hold(self, nomination: _Nomination, rooms: list[tuple[PendingPod, Placement]]) -> None:
        """Hold in the engine what of each pod's room is free already (``free_part``) while the victims
        leave: an ``Engine.hold``, no pod, no victim, no slot; given back before the victims' bookings."""
        for pending, placement in rooms:
            key = f"{HOLD_PREFIX}{pending.uid}"
            room = free_part(self._engine, key, placement)
            if room is None:
                continue
            self._engine.hold(key, room, namespace=pending.namespace)
            nomination.holds.append(key)

    def _excluded(
        self, uid: str, candidates: np.ndarray, kind: Kind | None = None, queue: str = ""
    ) -> set[str]:
        """Who the search for ``uid`` may not take: victims of open plans, refused ones, pods not ours,
        and for ``kind`` preempt or reclaim by a pod of ``queue``, those younger than their min-runtime."""
        refused = self._memory.refusals(uid)
        # Every candidate's uid read at C speed: a search at 5,000 nodes has thousands of candidates,
        # and a loop over them in Python was a sixth of the loop in a preemption burst.
        victims = list(map(self._engine.pods.uid.__getitem__, candidates.tolist()))
        not_ours = set()
        for victim in set(victims).difference(self._ours, (None,)):
            if self._victim_pod(victim) is None:
                not_ours.add(victim)
            else:
                self._ours.add(victim)  # a pod's scheduler never changes: asked once per pod
        out = set(self._victim_of) | set(refused) | not_ours
        if kind is not None:  # min-runtime: asked of the pods left, which are ours
            rest = (v for v in victims if v is not None and v not in out)
            young = ((v, booked_queue(self._engine, v), self._victim_pod(v)) for v in rest)
            out |= self._young.protected(uid, kind, queue, young)
        return out

    def _close(self, uid: str, nomination: _Nomination) -> None:
        if not nomination.closed:
            nomination.closed = True
            self._planned.closed(nomination.plan, nomination.queue)
        self._gone.stale()
        for key in nomination.keys:
            if self._open.get(key) is nomination:
                del self._open[key]
        for hold in nomination.holds:
            self._engine.release_hold(hold)
        nomination.holds.clear()
        for victim in nomination.plan.victims:
            if self._victim_of.get(victim) == uid:
                del self._victim_of[victim]
        for victim in nomination.gone:
            self._release(victim)

    def _give_up(self, uid: str, nomination: _Nomination, refused: str, detail: str) -> None:
        self._memory.refused(uid, refused)
        if self._open.get(uid) is nomination:
            self._close(uid, nomination)
        for pod in nomination.members:
            self._events.emit(
                regarding=pod_ref(pod),
                type=WARNING,
                reason=PREEMPTION_BLOCKED,
                message=f"evicting {booked_name(self._engine, refused)} was refused ({detail}); "
                "looking for other victims",
            )
        self._retry()

    async def _execute(self, uid: str, nomination: _Nomination) -> None:
        plan = nomination.plan
        nomination.evicting = True
        try:
            victims = [(v, self._victim_pod(v)) for v in plan.victims]
            # Dry run first: a refusal then costs no pod.
            for victim, pod in victims:
                if pod is None:
                    continue
                try:
                    await evict_pod(
                        self._client,
                        name=pod.metadata.name,
                        namespace=pod.metadata.namespace,
                        uid=victim,
                        dry_run=True,
                    )
                except NotFound:
                    continue
                except TooManyRequests as error:
                    self._give_up(uid, nomination, victim, error.message or "disruption budget")
                    return
            for victim, pod in victims:
                if pod is None:
                    continue
                try:
                    await evict_pod(
                        self._client, name=pod.metadata.name, namespace=pod.metadata.namespace, uid=victim
                    )
                except NotFound:
                    continue
                except TooManyRequests as error:
                    # A budget changed since the dry run; victims already evicted still leave.
                    self._give_up(uid, nomination, victim, error.message or "disruption budget")
                    return
                self.evictions += 1
                self.moved += plan.kind is Kind.CONSOLIDATE
                reason, message = victim_story(self._engine, nomination, victim)
                self._events.emit(
                    regarding=pod_ref(pod), type=NORMAL, reason=reason, message=message, keep=True
                )
                self._spawn(mark_disruption_target(self._client, pod, plan.kind, message))
            reason, message = taking_story(self._engine, nomination, victims)
            for member in nomination.members:
                self._events.emit(
                    regarding=pod_ref(member), type=NORMAL, reason=reason, message=message, keep=True
                )
            for member in nomination.members:
                node = (
                    plan.node_of.get(member.metadata.uid or "")
                    if isinstance(plan, GangPreemption)
                    else plan.node
                )
                if node is None:
                    continue  # a gang member beyond minMember the check did not place
                try:
                    await set_nominated_node(
                        self._client,
                        name=member.metadata.name,
                        namespace=member.metadata.namespace,
                        node=node,
                    )
                except KubeError as error:  # best effort: the plan goes on without the status field
                    log.warning("could not set nominatedNodeName on %s: %s", pod_key(member), error)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "preemption for %s failed",
                whom(nomination),
            )
            if self._open.get(uid) is nomination:
                self._close(uid, nomination)
            self._retry()
            return
        finally:
            nomination.evicting = False
        if self._open.get(uid) is nomination and not nomination.waiting:
            # Every victim was gone before the evictions finished.
            self._close(uid, nomination)
            self._place_now(nomination.pod)
