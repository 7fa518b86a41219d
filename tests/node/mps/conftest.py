"""Fixtures for the MPS tests; the harness itself is in ``mps_harness``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from mps_harness import STANDIN, MpsEnv, RecordingSink, processes_of

from gpufrac.node.mps.mode import DriverVersion
from gpufrac.node.mps.supervisor import MpsSupervisor


@pytest.fixture
def mps_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[MpsEnv]:
    root = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    wrapper = root / "nvidia-cuda-mps-control"
    # The wrapper records every invocation's argv (one line each), so tests see the exact command grammar.
    wrapper.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {root / "argv.log"}\nexec {sys.executable} {STANDIN} "$@"\n'
    )
    wrapper.chmod(0o755)
    fault_file = root / "faults"
    monkeypatch.setenv("GPUFRAC_STANDIN_FAULT_FILE", str(fault_file))
    monkeypatch.delenv("GPUFRAC_STANDIN_FAULTS", raising=False)
    yield MpsEnv(root=root, bin=wrapper, fault_file=fault_file)
    for pid in processes_of(root / "pipe"):  # never leak into the next test, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def make_supervisor(mps_env: MpsEnv) -> AsyncIterator[Callable[..., MpsSupervisor]]:
    made: list[MpsSupervisor] = []

    def make(
        *,
        driver: str = "615.20.01",
        sink: RecordingSink | None = None,
        on_change: Callable[[], None] | None = None,
        **overrides: object,
    ) -> MpsSupervisor:
        supervisor = MpsSupervisor(
            settings=mps_env.settings(**overrides),
            driver=DriverVersion.parse(driver),
            events=sink if sink is not None else RecordingSink(),
            on_change=on_change,
        )
        made.append(supervisor)
        return supervisor

    try:
        yield make
    finally:
        for supervisor in made:
            await supervisor.stop()
