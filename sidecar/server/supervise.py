"""The daemon's background tasks, kept running: one that ends is started again.

A background task of the daemon (the store writer, the engine sweeper) runs for the
daemon's life; if it ended unnoticed, what it does would stop for good while health
still says SERVING. So each runs under :func:`supervise`: if it ends other than by the
daemon stopping (an exception escaped it, it returned, something else cancelled it),
that is logged (``background_task_failed``, with the error), counted
(``kvtether_background_task_restarts_total{task}``), and the task is started again
after ``restart_delay_s``, which keeps a task that fails at once from spinning on
the event loop that decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from sidecar.telemetry import metrics

log = structlog.get_logger("kvtether.daemon")

DEFAULT_RESTART_DELAY_S = 1.0


async def supervise(name: str, start: Callable[[], Coroutine[Any, Any, None]],
                    restart_delay_s: float = DEFAULT_RESTART_DELAY_S) -> None:
    """Run ``start()`` as a task named ``name`` until this coroutine is cancelled (which
    cancels the task too), starting it again whenever it ends."""
    while True:
        task = asyncio.create_task(start(), name=name)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the daemon stops
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        if task.cancelled():
            log.error("background_task_failed", task=name, error="cancelled")
        elif (error := task.exception()) is not None:
            log.error("background_task_failed", task=name,
                      error=f"{type(error).__name__}: {error}", exc_info=error)
        else:
            log.error("background_task_failed", task=name, error="returned")
        metrics.BACKGROUND_TASK_RESTARTS.labels(name).inc()
        await asyncio.sleep(restart_delay_s)
