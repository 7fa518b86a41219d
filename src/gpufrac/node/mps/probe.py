"""The active MPS probe: a short-lived test client, run with a timeout (REAL).

Why a client. The wedge of CUDA <= 13.5 (``cuda_probe``) is invisible to the control daemon: servers
list as ready, the dead client as attached, nothing is logged; every NEW client hangs in CUDA init. The
supervisor's other wedge signal (a ``client terminate`` that does not answer) needs a container to stop
first. The probe asks the only question that matters -- can a client connect now -- every
``probe_interval_s``, as a process of its own (``probe_command``, by default ``python -m
gpufrac.node.mps.cuda_probe``) with ``CUDA_MPS_PIPE_DIRECTORY`` set to the server's directory, and kills it
after ``probe_timeout_s``.

Outcomes: ``OK`` (it exited 0), ``HUNG`` (it did not exit in time: the server is wedged), ``ERROR`` (it
exited non-zero: the probe could not run -- no driver library, no device -- which proves nothing about
MPS and is only logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from enum import StrEnum
from pathlib import Path

log = logging.getLogger(__name__)


class ProbeOutcome(StrEnum):
    OK = "ok"
    HUNG = "hung"
    ERROR = "error"


async def probe_once(
    *, command: tuple[str, ...], pipe_dir: Path, log_dir: Path, timeout_s: float
) -> tuple[ProbeOutcome, str]:
    """Run the test client once against the server whose directory is ``pipe_dir``."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as error:
        return ProbeOutcome.ERROR, f"could not start {command[0]}: {error}"
    try:
        async with asyncio.timeout(timeout_s):
            _, stderr = await process.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        return ProbeOutcome.HUNG, f"a test client did not get an MPS context within {timeout_s:g}s"
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode == 0:
        return ProbeOutcome.OK, ""
    text = stderr.decode(errors="replace").strip()[-300:]
    return ProbeOutcome.ERROR, f"the test client exited with {process.returncode}: {text}"
