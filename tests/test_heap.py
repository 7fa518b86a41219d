"""The long-lived controllers' collector settings (gpufrac.process.heap), each in a fresh interpreter so
the test process keeps its own collector as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout.strip()


def test_tuning_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    out = _run(
        """
        import gc
        from gpufrac.process.heap import YOUNG_THRESHOLD, tune_collector
        before = gc.get_threshold()
        assert gc.get_freeze_count() == 0
        old = tune_collector()
        assert old == before, (old, before)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2]), gc.get_threshold()
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imported modules' objects
        print("ok")
        """
    )
    assert out == "ok"


def test_cycles_made_after_tuning_are_still_freed_without_an_explicit_collect() -> None:
    """The collector still runs on its own: a cycle dropped after tuning is freed once enough other
    objects have been allocated, and garbage from before tuning is not frozen."""
    out = _run(
        """
        import gc, weakref
        from gpufrac.process.heap import YOUNG_THRESHOLD, tune_collector

        class Node:
            pass

        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return weakref.ref(a)

        early = cycle()  # garbage already when the process tunes: collected, not frozen
        tune_collector()
        assert early() is None
        late = cycle()
        assert late() is not None  # a cycle waits for the collector
        keep = [[] for _ in range(3 * YOUNG_THRESHOLD)]  # allocations past the young threshold
        print("freed" if late() is None else "leaked")
        """
    )
    assert out == "freed"
