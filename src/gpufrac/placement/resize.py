"""Whether a bound pod's resize request fits on the GPUs it already holds: the pure half of a resize.

A resize never moves a pod. Its containers keep their GPUs, so the question is only whether each GPU
can hold the new amounts beside everything else booked there, with the pod's own old amounts freed
first. Three answers, as Kubernetes gives for an in-place resize of CPU and memory:

- ``FITS``: the new placement (same GPUs, new request and limit per device, and an sm-sharing
  container's new compute portion when it asked for one; otherwise its portion stays as bound) is what
  the caller books (``Engine.assume`` replaces the pod's old holding) and then writes.
- ``DEFERRED``: not now, maybe later. A GPU lacks the room (or, with a limit-overcommit cap, the limit
  headroom, or for sm-sharing the compute: the portions booked there may sum to 1 at most) because
  other bookings hold it; the message names the GPU, the amounts and who holds the
  room, and the caller retries when room frees.
- ``INFEASIBLE``: never, as the cluster stands: the request is larger than the GPU itself (or its
  limit beyond the overcommit cap of an empty GPU), the container holds no fraction (or a compute
  share is asked of one that is not sm-sharing), or growing
  would take the pod's queue (or an ancestor) past its limit (the engine's own check,
  ``QueueBook.exceeded``, the one placement applies).

One amount per container: the contract writes a single request and limit per container, so on GPUs of
different sizes a portion resolves to the smallest of its devices' amounts (as the booking cache's
``uniform`` does at bind). Preemption does not make room for a resize (yet): a deferred resize waits for
room to free by itself.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpufrac.contract.request import ComputeMode
from gpufrac.contract.resize import ResizeAsk
from gpufrac.placement.decision import ContainerPlacement, Placement
from gpufrac.placement.demand import PPM, portion_ppm
from gpufrac.placement.engine import Engine, over_limit
from gpufrac.placement.state import GpuLedger


class ResizeOutcome(enum.Enum):
    FITS = "Fits"
    DEFERRED = "Deferred"
    INFEASIBLE = "Infeasible"


@dataclass(frozen=True, slots=True)
class AmountChange:
    """One container's amounts per device, before and after (MiB), and its sm-sharing compute portion
    (None for a container without one)."""

    container: str
    old_request: int
    old_limit: int
    new_request: int
    new_limit: int
    old_portion: float | None = None
    new_portion: float | None = None

    @property
    def unchanged(self) -> bool:
        return (self.old_request, self.old_limit, self.old_portion) == (
            self.new_request,
            self.new_limit,
            self.new_portion,
        )

    @property
    def grows(self) -> bool:
        more_compute = (self.new_portion or 0) > (self.old_portion or 0)
        return self.new_request > self.old_request or self.new_limit > self.old_limit or more_compute

    def describe(self) -> str:
        text = (
            f"container {self.container}: request {self.old_request} -> {self.new_request} MiB, "
            f"limit {self.old_limit} -> {self.new_limit} MiB"
        )
        if self.old_portion != self.new_portion:
            text += f", compute portion {self.old_portion:g} -> {self.new_portion:g}"
        return text


@dataclass(frozen=True, slots=True)
class ResizeDecision:
    outcome: ResizeOutcome
    #: The placement to book when ``FITS``; the current one otherwise.
    placement: Placement
    changes: tuple[AmountChange, ...]
    message: str

    @property
    def unchanged(self) -> bool:
        return all(c.unchanged for c in self.changes)


def decide_resize(engine: Engine, uid: str, asks: Mapping[str, ResizeAsk]) -> ResizeDecision:
    """The decision on resizing bound pod ``uid`` as ``asks`` (by container) say; raises ``KeyError``
    when the engine holds nothing for ``uid``."""
    current = engine.placement_of(uid)
    pod = engine.bound_pod(uid)
    if current is None or pod is None:
        raise KeyError(uid)
    ledgers = {ledger.uuid: ledger for ledger in engine.ledger(current.node)}
    held = {c.container: c for c in current.containers}
    for name in sorted(asks):
        c = held.get(name)
        if c is None or c.exclusive:
            what = "holds whole GPUs" if c is not None else "holds no GPU share on its node"
            return _decision(
                ResizeOutcome.INFEASIBLE, current, (), f"container {name} {what}; nothing to resize"
            )
        if asks[name].compute is not None and c.mode is not ComputeMode.SM_SHARING:
            message = f"container {name} runs {c.mode.value}, which reserves no compute share to resize"
            return _decision(ResizeOutcome.INFEASIBLE, current, (), message)
    containers: list[ContainerPlacement] = []
    changes: list[AmountChange] = []
    for c in current.containers:
        ask = asks.get(c.container)
        if ask is None:
            containers.append(c)
            continue
        held_here = [d for d in c.devices if d.uuid in ledgers]
        if not held_here:
            containers.append(c)
            continue
        old = c.devices[0]
        amounts = [ask.resolve(ledgers[d.uuid].capacity_mib) for d in held_here]
        request = min(a[0] for a in amounts if a is not None) if ask.request is not None else old.request_mib
        limit = min(a[1] for a in amounts if a is not None) if ask.request is not None else old.limit_mib
        portion = ask.compute if ask.compute is not None else old.compute_portion
        changes.append(
            AmountChange(
                c.container,
                old.request_mib,
                old.limit_mib,
                request,
                max(request, limit),
                old.compute_portion,
                portion,
            )
        )
        devices = tuple(
            replace(d, request_mib=request, limit_mib=max(request, limit), compute_portion=portion)
            if ask.compute is not None
            else replace(d, request_mib=request, limit_mib=max(request, limit))
            for d in c.devices
        )
        containers.append(replace(c, devices=devices))
    resized = replace(current, containers=tuple(containers))
    refusal = _gpu_refusal(engine, uid, current, resized, ledgers)
    if refusal is not None:
        outcome, message = refusal
        return _decision(outcome, current, tuple(changes), message)
    more = _total_request(resized) - _total_request(current)
    if more > 0:
        exceeded = engine.queues.exceeded(pod.queue, more, 0)
        if exceeded is not None:
            message = f"growing by {more} MiB: {over_limit(pod.queue, *exceeded)}"
            return _decision(ResizeOutcome.INFEASIBLE, current, tuple(changes), message)
    return _decision(ResizeOutcome.FITS, resized, tuple(changes), "; ".join(c.describe() for c in changes))


def _decision(
    outcome: ResizeOutcome, placement: Placement, changes: tuple[AmountChange, ...], message: str
) -> ResizeDecision:
    return ResizeDecision(outcome=outcome, placement=placement, changes=changes, message=message)


def _total_request(placement: Placement) -> int:
    return sum(d.request_mib for c in placement.containers for d in c.devices)


def _per_gpu(placement: Placement) -> dict[str, tuple[int, int, int]]:
    """(request MiB, limit MiB, compute ppm) the placement holds on each GPU."""
    out: dict[str, tuple[int, int, int]] = {}
    for c in placement.containers:
        for d in c.devices:
            request, limit, ppm = out.get(d.uuid, (0, 0, 0))
            share = 0 if d.compute_portion is None else portion_ppm(d.compute_portion)
            out[d.uuid] = (request + d.request_mib, limit + d.limit_mib, ppm + share)
    return out


def _gpu_refusal(
    engine: Engine, uid: str, current: Placement, resized: Placement, ledgers: Mapping[str, GpuLedger]
) -> tuple[ResizeOutcome, str] | None:
    before, after = _per_gpu(current), _per_gpu(resized)
    cap = engine.rules.limit_overcommit
    for uuid in sorted(after):
        ledger = ledgers.get(uuid)
        if ledger is None:
            continue
        old_request, old_limit, old_ppm = before.get(uuid, (0, 0, 0))
        new_request, new_limit, new_ppm = after[uuid]
        where = f"GPU {uuid} (index {ledger.index}) on node {current.node}"
        if new_request > ledger.capacity_mib:
            return ResizeOutcome.INFEASIBLE, (
                f"{where} has {ledger.capacity_mib} MiB in all; the pod would need {new_request} MiB of it"
            )
        room = ledger.free_mib + old_request
        if new_request > room:
            return ResizeOutcome.DEFERRED, (
                f"{where} has {room} MiB beside its other bookings; the pod would need {new_request} MiB "
                f"(it holds {old_request} MiB); {_holders(engine, uid, current.node, uuid, ledger, room)}"
            )
        compute_room = PPM - ledger.compute_ppm + old_ppm
        if new_ppm > old_ppm and new_ppm > compute_room:
            return ResizeOutcome.DEFERRED, (
                f"{where} has a compute portion of {compute_room / PPM:g} beside its other sm-sharing "
                f"bookings; the pod would need {new_ppm / PPM:g} (it holds {old_ppm / PPM:g}); "
                f"{_compute_holders(engine, uid, current.node, uuid)}"
            )
        if cap is not None and new_limit > old_limit:
            bound = int(ledger.capacity_mib * cap)
            if new_limit > bound:
                return ResizeOutcome.INFEASIBLE, (
                    f"{where} allows limits of {bound} MiB in all (overcommit cap {cap:g}); "
                    f"the pod's would be {new_limit} MiB"
                )
            if ledger.limit_sum_mib - old_limit + new_limit > bound:
                return ResizeOutcome.DEFERRED, (
                    f"{where} allows limits of {bound} MiB in all (overcommit cap {cap:g}); "
                    f"the others' limits take {ledger.limit_sum_mib - old_limit} MiB "
                    f"and the pod's would be {new_limit} MiB"
                )
    return None


def _holders(engine: Engine, uid: str, node: str, uuid: str, ledger: GpuLedger, room: int) -> str:
    """Who holds the rest of the GPU: each other pod booked there with its MiB, largest first, and what
    remains (DRA claims, whatever no pod holds itself)."""
    found: list[tuple[int, str]] = []
    for other in engine.bound_uids:
        placement = engine.placement_of(other)
        if other == uid or placement is None or placement.node != node:
            continue
        mib = sum(d.request_mib for c in placement.containers for d in c.devices if d.uuid == uuid)
        pod = engine.bound_pod(other)
        if mib and pod is not None:
            found.append((mib, pod.key))
    found.sort(key=lambda item: (-item[0], item[1]))
    taken = ledger.capacity_mib - room
    shown = ", ".join(f"{key} {mib} MiB" for mib, key in found[:5])
    if len(found) > 5:
        shown += f" and {len(found) - 5} more pods"
    rest = taken - sum(mib for mib, _ in found)
    if rest > 0:
        shown += f"{', ' if shown else ''}{rest} MiB by shares no pod holds (DRA claims)"
    return f"held there: {shown}" if shown else "held there: nothing"


def _compute_holders(engine: Engine, uid: str, node: str, uuid: str) -> str:
    """The other pods' compute portions on the GPU, largest first."""
    found: list[tuple[int, str]] = []
    for other in engine.bound_uids:
        placement = engine.placement_of(other)
        if other == uid or placement is None or placement.node != node:
            continue
        ppm = sum(
            portion_ppm(d.compute_portion)
            for c in placement.containers
            for d in c.devices
            if d.uuid == uuid and d.compute_portion is not None
        )
        pod = engine.bound_pod(other)
        if ppm and pod is not None:
            found.append((ppm, pod.key))
    found.sort(key=lambda item: (-item[0], item[1]))
    shown = ", ".join(f"{key} {ppm / PPM:g}" for ppm, key in found[:5])
    if len(found) > 5:
        shown += f" and {len(found) - 5} more pods"
    return f"compute held there: {shown or 'by shares no pod holds (DRA claims)'}"
