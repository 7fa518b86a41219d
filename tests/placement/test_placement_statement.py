"""The engine's Statement, the one "what if" of the placement core: any sequence of ``place``, ``evict``
and ``assume`` rolled back to a checkpoint leaves every book exactly as it was at the checkpoint (GPU
ledgers, host resources, tenants, the pod table slot by slot, queue charges, the pod book, held room
for nominated pods); a committed statement keeps what it did."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_builders import fraction, node, pod, whole

from gpufrac.contract.request import ComputeMode
from gpufrac.placement.decision import Placement
from gpufrac.placement.engine import Engine
from gpufrac.placement.model import Queue
from gpufrac.placement.state import _ARRAYS

_TABLE = ("live", "node", "priority", "queue", "tenant", "movable", "cpu", "mem", "mib", "gpus")
_TABLE_GPU = ("req", "lim", "ppm", "on")


def books(e: Engine) -> dict[str, object]:
    """Everything the engine books, as plain values (nodes' ``version`` counters only ever move on)."""
    state, table, book = e.state, e.pods, e.book
    out: dict[str, object] = {f"state.{n}": getattr(state, n).copy() for n in _ARRAYS if n != "version"}
    out["state.tenants"] = copy.deepcopy(state.tenants)
    rows = sorted(table.slot_of.values())  # a free slot keeps stale values nothing reads
    out |= {f"pods.{n}": getattr(table, n)[rows].copy() for n in _TABLE + _TABLE_GPU}
    out["pods.slot_of"] = dict(table.slot_of)
    # The slots the next pods will get: freed slots (last freed first), then new ones. A statement may
    # grow the table; once undone, a grown slot is free and comes next, as a new one would.
    out["pods.next"] = [*reversed(table._free), *range(len(table.uid), len(table.uid) + 64)][:64]
    out["bound"] = dict(e._bound)
    out["on_node"] = {n: set(uids) for n, uids in e._on_node.items()}
    # A queue first charged inside the statement stays in the book, holding 0.
    out["queues"] = [{q: v for q, v in held.items() if v} for held in (e.queues.usage, e.queues.whole_gpus)]
    out["book.entries"] = dict(book._entries)
    out["book.by_label"] = {k: set(v) for k, v in book._by_label.items()}
    out["book.holds"] = dict(book._holds)
    return out


def assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert np.array_equal(a[key], b[key]), key  # type: ignore[arg-type]
        else:
            assert a[key] == b[key], key


SHAPES = (
    fraction(0.25),
    fraction(0.5),
    fraction(0.3, mode=ComputeMode.SM_SHARING),
    fraction(0.5, count=2),
    whole(),
    whole(2),
)


def cluster() -> Engine:
    e = Engine(policy="binpack", queues=[Queue("a"), Queue("b")])
    for name in ("n0", "n1", "n2"):
        e.add_node(node(name, gpus=4, mib=16384))
    for i in range(8):
        placed = e.place(pod(SHAPES[i % len(SHAPES)], name=f"base-{i}", queue="ab"[i % 2], priority=i))
        assert isinstance(placed, Placement)
    for i, p in enumerate(NOMINATED):
        e.nominate(p, f"n{i % 3}")
    return e


#: Pending pods a preemptor nominated (``cluster`` holds room for them); placing one drops its room.
NOMINATED = [pod(SHAPES[i], name=f"nominated-{i}", priority=50) for i in range(3)]


# One step of a what-if: (operation, which pod or shape, a second choice).
steps = st.lists(
    st.tuples(
        st.sampled_from(["place", "evict", "assume-back", "move", "checkpoint"]),
        st.integers(0, 1000),
        st.integers(0, 1000),
    ),
    max_size=14,
)


def run(e: Engine, stmt, ops) -> None:  # type: ignore[no-untyped-def]
    """Apply ``ops`` through ``stmt``: new pods placed, placed pods evicted, evicted pods assumed back
    where they were, placed pods assumed at another pod's former place (a move)."""
    evicted: list[tuple[object, Placement]] = []
    for i, (op, a, b) in enumerate(ops):
        bound = e.bound_uids
        if op == "place":
            p = pod(SHAPES[a % len(SHAPES)], name=f"new-{i}", queue="ab"[b % 2], priority=b % 7)
            nominated = NOMINATED[b % len(NOMINATED)]
            stmt.place(nominated if b % 2 and e.bound_pod(nominated.uid) is None else p)
        elif op == "evict" and bound:
            evicted.append(stmt.evict(bound[a % len(bound)]))
        elif op == "assume-back" and evicted:
            booked, where = evicted.pop(a % len(evicted))
            if e.bound_pod(booked.uid) is None:  # type: ignore[attr-defined]
                stmt.assume(booked, where)
        elif op == "move" and bound and evicted:
            # A placed pod of the same shape takes the place an evicted pod left.
            booked, where = evicted[b % len(evicted)]
            mover = next((u for u in bound if e.bound_pod(u).gpu == booked.gpu), None)  # type: ignore[union-attr,attr-defined]
            if mover is not None:
                try:
                    stmt.assume(e.bound_pod(mover), Placement(mover, where.node, where.containers))
                except ValueError:
                    pass  # a GPU of that place is gone with its node: nothing was changed
                else:
                    evicted.pop(b % len(evicted))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=steps, after=steps)
def test_rollback_to_a_checkpoint_restores_every_book(before, after):
    e = cluster()
    start = books(e)
    with e.statement() as stmt:
        run(e, stmt, before)
        mark = stmt.checkpoint()
        at_mark = books(e)
        run(e, stmt, after)
        stmt.rollback(mark)
        assert_same(at_mark, books(e))
        # The statement stays open after a rollback, and discarding undoes the rest.
        run(e, stmt, after)
    assert_same(start, books(e))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=steps)
def test_a_committed_statement_keeps_its_changes(ops):
    e = cluster()
    with e.statement() as stmt:
        run(e, stmt, ops)
        done = books(e)
        stmt.commit()
    assert_same(done, books(e))
    with pytest.raises(RuntimeError):
        stmt.place(pod(fraction(0.25)))


def test_rollback_gives_a_nominated_pod_its_held_room_back():
    e = cluster()
    p = NOMINATED[0]
    with e.statement() as stmt:
        assert isinstance(stmt.place(p), Placement)
        assert e.book.nomination(p.uid) is None
    assert e.book.nomination(p.uid) is not None
    assert e.bound_pod(p.uid) is None


def test_a_checkpoint_from_elsewhere_is_refused():
    e = cluster()
    with e.statement() as stmt:
        with pytest.raises(ValueError, match="checkpoint 3"):
            stmt.rollback(3)
        with pytest.raises(ValueError, match="is not placed"):
            stmt.evict("nobody")
