"""Run a component's main coroutine until SIGTERM/SIGINT, and turn how it ended into an exit code.

The scheduler and the operator end this way: a signal cancels the main task and the process exits 0
once the task's own ``finally`` blocks have run (leases released, connections closed); the task
ending by itself, or failing, exits 1 so the Deployment restarts the replica. The node agent
(``gpufrac.node.command.serve``) and the admission webhook (a threaded HTTP server stopped from its
signal handler) stop on their own paths.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)


async def run_until_signal(
    main: Coroutine[Any, Any, None],
    *,
    name: str,
    expected: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``main`` until a signal (0) or its end or failure (1).

    ``expected`` failures (a lost lease) are logged as one line instead of with a traceback.
    """
    task = asyncio.create_task(main, name=name)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def stop() -> None:
        if not stopping.is_set():
            log.info("signal received, stopping %s", name)
            stopping.set()
            task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await task
        log.error("%s ended unexpectedly", name)
        return 1
    except asyncio.CancelledError:
        if stopping.is_set():
            return 0
        raise
    except expected as error:
        log.error("%s stopping: %s", name, error)
        return 1
    except Exception:
        log.exception("%s failed", name)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
