"""Child processes of the embedded cluster: started with their output in a log file, ended for sure.

The embedded cluster (``gpufrac.local.cluster``, through its ``supervisor``) and the real node
(``gpufrac.local.realnode``) start
many long-running programs; both need the same two things: a process whose output lands in
``<logs>/<name>.log`` (so a failure can quote its last lines), in its own session (so a signal to the
test runner does not reach it and ``killpg`` ends its children too), and a stop that cannot hang
(SIGTERM, then SIGKILL to the whole group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Spawned:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start_logged(
    argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log``; ``env`` is added to
    this process's environment."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


def spawn(*, name: str, argv: list[str], logs: Path, env: Mapping[str, str] | None = None) -> Spawned:
    """Start ``argv`` with stdout and stderr appended to ``logs/<name>.log``."""
    log = logs / f"{name}.log"
    return Spawned(name=name, popen=start_logged(argv, log=log, env=env), log=log)


def terminate(popen: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then after ``timeout_s`` SIGKILL to the process group; returns once it is gone."""
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
