"""The embedded cluster's supervisor on plain processes: restarts, back-off, crash loops, the log line.

No control plane needed: the processes are small Python programs, and every check waits on what the
supervisor records (its exits) rather than on time passing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from gpufrac.local.supervisor import Backoff, Supervisor


async def _until(condition, *, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_crashing_component_is_restarted_with_doubling_delays_and_shown_as_a_crash_loop(
    tmp_path: Path,
) -> None:
    reported: list[str] = []
    supervisor = Supervisor(
        backoff=Backoff(initial_s=0.05, max_s=0.2, reset_after_s=60), report=reported.append
    )
    log = tmp_path / "crasher.log"
    component = supervisor.start("crasher", [sys.executable, "-c", "raise SystemExit(3)"], log=log)
    try:
        await _until(lambda: len(component.exits) >= 4)
        await _until(lambda: component.state == "CrashLoopBackOff")
    finally:
        await supervisor.stop()
    first, second, third, fourth = component.exits[:4]
    assert {e.code for e in (first, second, third, fourth)} == {3}
    assert [e.restart_in_s for e in (first, second, third, fourth)] == [0.05, 0.1, 0.2, 0.2]
    assert [e.crash_loop for e in (first, second, third, fourth)] == [False, True, True, True]
    assert reported[0].startswith("crasher exited with code 3 after ")
    assert "restart 1 in 0.1s" in reported[0] and "crash loop" not in reported[0]
    assert "restart 2 in 0.1s (crash loop)" in reported[1]
    assert "--- gpufrac up: crasher exited with code 3" in log.read_text()


async def test_a_killed_component_comes_back_with_a_new_process_and_its_signal_recorded(
    tmp_path: Path,
) -> None:
    supervisor = Supervisor(backoff=Backoff(initial_s=0.05))
    component = supervisor.start(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], log=tmp_path / "sleeper.log"
    )
    try:
        first_pid = component.pid
        os.kill(first_pid, signal.SIGKILL)
        await _until(lambda: component.alive and component.pid != first_pid)
        (killed,) = component.exits
        assert killed.code == -signal.SIGKILL and killed.described == "killed by SIGKILL"
        assert not killed.crash_loop
        assert supervisor.exits() == {"sleeper": [killed]}
    finally:
        await supervisor.stop()
    assert component.state == "Stopped" and component.popen.poll() is not None


async def test_stop_ends_every_process_and_restarts_none(tmp_path: Path) -> None:
    supervisor = Supervisor(backoff=Backoff(initial_s=0.05))
    components = [
        supervisor.start(name, [sys.executable, "-c", "import time; time.sleep(600)"], log=tmp_path / name)
        for name in ("a", "b")
    ]
    await supervisor.stop()
    assert all(c.popen.poll() is not None for c in components)
    assert supervisor.exits() == {"a": [], "b": []}


def test_backoff_refuses_delays_that_cannot_work() -> None:
    with pytest.raises(ValueError, match=r"initial_s=0 must be > 0 and <= max_s=30"):
        Backoff(initial_s=0)
    with pytest.raises(ValueError, match=r"initial_s=5 must be > 0 and <= max_s=1"):
        Backoff(initial_s=5, max_s=1)
    with pytest.raises(ValueError, match=r"reset_after_s=0 must be > 0"):
        Backoff(reset_after_s=0)


def test_a_name_is_supervised_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        supervisor = Supervisor()
        supervisor.start("x", [sys.executable, "-c", "import time; time.sleep(600)"], log=tmp_path / "x")
        try:
            with pytest.raises(ValueError, match="'x' is already supervised"):
                supervisor.start("x", [sys.executable, "-c", "pass"], log=tmp_path / "x2")
        finally:
            await supervisor.stop()

    asyncio.run(scenario())
