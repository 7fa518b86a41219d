"""``QueueTally``: amounts by pod uid with each queue's sum kept as pods come and go; its sums must be
what adding up its pods gives, after any order of adds, replacements and removals."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpufrac.placement.queue_shares import Amount, QueueAmount
from gpufrac.placement.queue_tally import QueueTally

UIDS = st.sampled_from([f"p{i}" for i in range(6)])
AMOUNTS = st.builds(
    QueueAmount,
    st.sampled_from(["prod", "dev", "ops"]),
    st.builds(Amount, st.integers(0, 80_000), st.integers(0, 8)),
)
OPS = st.lists(st.one_of(st.tuples(st.just("add"), UIDS, AMOUNTS), st.tuples(st.just("discard"), UIDS)))


def summed(entries: dict[str, QueueAmount], besides: str | None = None) -> dict[str, Amount]:
    out: dict[str, Amount] = {}
    for uid, entry in entries.items():
        if uid != besides:
            out[entry.queue] = out.get(entry.queue, Amount()) + entry.amount
    return out


@given(OPS, st.one_of(st.none(), UIDS))
def test_the_sums_are_the_pods_added_up_after_any_adds_and_removals(ops, besides) -> None:
    tally, expected = QueueTally(), {}
    for op in ops:
        if op[0] == "add":
            tally.add(op[1], op[2])
            expected[op[1]] = op[2]
        else:
            tally.discard(op[1])
            expected.pop(op[1], None)
    assert dict(tally) == expected and len(tally) == len(expected)
    assert {e.queue: e.amount for e in tally.totals(besides=besides)} == summed(expected, besides)


def test_a_queue_whose_pods_all_left_has_no_entry_even_when_they_held_nothing() -> None:
    tally = QueueTally([("a", QueueAmount("dev", Amount(0, 0))), ("b", QueueAmount("prod", Amount(5, 1)))])
    assert sorted(e.queue for e in tally.totals()) == ["dev", "prod"]  # a pod holding nothing still counts
    tally.discard("a")
    assert tally.totals() == [QueueAmount("prod", Amount(5, 1))]
    assert tally.totals(besides="b") == []
    assert "b" in tally and "a" not in tally
