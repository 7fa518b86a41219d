"""The suite's own layout: test folders are not packages, so pytest imports each test module by its
file name alone, and two modules with one name (tests/contract/test_resize.py and
tests/node/test_resize.py) stop the whole run at collection. Helper modules imported by name
(``sched_harness``, ``placement_builders``) must be unique for the same reason."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_modules_of_the_suite_share_a_file_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name in ("conftest.py", "__init__.py") or "__pycache__" in path.parts:
            continue
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"test modules that share a file name (pytest cannot import both): {clashes}"
