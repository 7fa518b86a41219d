"""CI cannot go green without its real layers.

The real-node, install and DRA real-node tests (tests/realnode, tests/install, the MPS hand-over on a
real node) skip themselves where the machine cannot run a real node (``realnode.missing_requirements``).
That is right on a developer's laptop and wrong in CI: a CI machine that lost root or its cgroups, or a
skip condition that grew too wide, would report those layers "skipped" and the run green, and nobody
reads the skip count of a green run.

So where real layers are required (``.ci/run`` exports ``GPUFRAC_REQUIRE_REAL_LAYERS=1``; ``CI=true``
counts too, and ``GPUFRAC_REQUIRE_REAL_LAYERS=0`` turns the guard off on purpose) and this machine can
run them by this module's own judgement (root and a writable cgroup hierarchy, v1 or v2, checked here
independently of the skip condition it guards), every skip of a real-layer test makes the session fail,
with one sentence per skip that says what skipped, why, and what the machine has. Other skips are left
alone. Where the machine lacks root or cgroups the skips stand, and the summary says why.

The judgement is taken at the end of the session (exit status 1) rather than by turning the skip into a
collection error: a collection error stops pytest before any test runs, and CI should still show what
else failed in the same run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

ENV = "GPUFRAC_REQUIRE_REAL_LAYERS"
#: The reason every real-node module skips with (tests/realnode, tests/install, tests/node/mps).
REAL_NODE_SKIP = "no real node on this machine"
#: Test directories that are real layers as a whole, relative to the repository root.
REAL_LAYER_DIRS = ("tests/realnode/", "tests/install/")
#: Other test modules that drive the machine's own runtime stack (a real node, buildah's store).
REAL_NODE_MODULES = ("tests/node/mps/test_mps_handover_realnode.py", "tests/test_image_store.py")
#: The pytest-xdist work unit that keeps every test of the machine's runtime stack in one worker process:
#: two real nodes at once would race for the machine's iptables rule of the kubernetes Service
#: (``ServiceRoute``) and share its cgroups.
ONE_WORKER_GROUP = "real-node"
CGROUP_ROOT = Path("/sys/fs/cgroup")

_TRUE = ("1", "true", "yes")


def required(environ: Mapping[str, str]) -> bool:
    """Whether this run must not skip real layers: ``GPUFRAC_REQUIRE_REAL_LAYERS`` decides when set,
    else ``CI``."""
    explicit = environ.get(ENV, "").strip().lower()
    if explicit:
        return explicit in _TRUE
    return environ.get("CI", "").strip().lower() in _TRUE


def machine_lacks(*, euid: int, cgroup_root: Path = CGROUP_ROOT) -> list[str]:
    """What this machine lacks to run a real node (empty: it can): root, and a cgroup hierarchy it may
    write (v1's memory controller, or v2's unified hierarchy)."""
    lacks = []
    if euid != 0:
        lacks.append(f"root (running as uid {euid})")
    v1 = cgroup_root / "memory"
    v1_ok = (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK)
    v2_ok = (cgroup_root / "cgroup.controllers").exists() and os.access(cgroup_root, os.W_OK)
    if not (v1_ok or v2_ok):
        lacks.append(f"a writable cgroup hierarchy at {cgroup_root} (v1 memory or v2)")
    return lacks


def runs_the_machines_runtime(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (relative to the repository root) runs the machine's runtime stack, so
    that ``make test``'s worker processes must take such tests one at a time."""
    path = nodeid.split("::", 1)[0]
    return path.startswith(REAL_LAYER_DIRS) or path in REAL_NODE_MODULES


def is_real_layer(nodeid: str, reason: str) -> bool:
    """Whether a skip of ``nodeid`` (relative to the repository root) for ``reason`` skips a real layer."""
    return nodeid.startswith(REAL_LAYER_DIRS) or REAL_NODE_SKIP in reason


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason.removeprefix("Skipped: ")
    return str(longrepr)


class RealLayerGuard:
    """A pytest plugin (registered by tests/conftest.py where real layers are required) that fails the
    session when a real layer skips on a machine that could run it; ``lacks`` is ``machine_lacks()``."""

    def __init__(self, *, lacks: list[str]) -> None:
        self.lacks = lacks
        self.skipped: list[tuple[str, str]] = []

    def _note(self, report: Any) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = _skip_reason(report)
        if is_real_layer(report.nodeid, reason):
            self.skipped.append((report.nodeid, reason))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def failures(self) -> list[str]:
        """One sentence per real-layer skip this machine should have run (empty where it lacks root or
        cgroups)."""
        if self.lacks:
            return []
        return [
            f"{nodeid} skipped ({reason}), but this machine runs as root with a writable cgroup hierarchy "
            f"and {ENV} or CI requires the real layers: fix the machine or the skip condition "
            f"({ENV}=0 turns this check off)"
            for nodeid, reason in self.skipped
        ]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.failures() and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        failures = self.failures()
        if failures:
            terminalreporter.section("real layers skipped on a machine that can run them", sep="=", red=True)
            for line in failures:
                terminalreporter.line(f"FAILED {line}", red=True)
        elif self.skipped:
            terminalreporter.section("real layers skipped", sep="=")
            terminalreporter.line(
                f"{len(self.skipped)} real-layer test(s) skipped; allowed because this machine lacks "
                + "; ".join(self.lacks)
            )
