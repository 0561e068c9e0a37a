"""What each pin came to: did its job come back while the pin held the blocks, and how
much memory-time it held for that.

A pin pays only if the job's next request arrives while it holds: that request finds
its context in the prefix cache. A pin that ends first (expired, released under
pressure, given way by the engine) held the memory for nothing. The two counts and
the block-seconds behind each are what an operator needs to judge a policy's pins on
their own workload, and what the engine benchmark records per run.

Block-seconds count from the pin to the job's return, or to the pin's end when the
job did not return: after the return the request being served shares the blocks, so
the pin no longer holds memory of its own.

Called from the daemon's event loop only, through ``EngineMirror``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.framework import PinView
from sidecar.telemetry import metrics

RETURNED = "returned"  # the job's next request arrived while the pin held
NOT_RETURNED = "not_returned"  # the pin ended before the job came back


@dataclass(slots=True)
class _Held:
    job_id: str
    blocks: int
    pinned_at_s: float
    returned_at_s: float | None = None


class PinOutcomes:
    """The pins of one engine, from pinned to ended. Ending a pin it does not know
    (never pinned here, or already ended) is harmless: releases may repeat."""

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        self._held: dict[str, _Held] = {}
        self._by_job: dict[str, set[str]] = {}

    def pinned(self, pin: PinView) -> None:
        if pin.request_id in self._held:
            return  # re-reported (a snapshot): keep its history
        self._held[pin.request_id] = _Held(pin.job_id, pin.blocks, pin.pinned_at_s)
        self._by_job.setdefault(pin.job_id, set()).add(pin.request_id)

    def job_returned(self, job_id: str, at_s: float) -> None:
        """A request of ``job_id`` arrived: every pin of the job still holding paid."""
        for request_id in self._by_job.get(job_id, ()):
            held = self._held[request_id]
            if held.returned_at_s is None:
                held.returned_at_s = max(at_s, held.pinned_at_s)

    def ended(self, request_id: str, at_s: float) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        pins = self._by_job[held.job_id]
        pins.discard(request_id)
        if not pins:
            del self._by_job[held.job_id]
        outcome = RETURNED if held.returned_at_s is not None else NOT_RETURNED
        until_s = held.returned_at_s if held.returned_at_s is not None else at_s
        metrics.PINS_ENDED.labels(outcome).inc()
        if outcome == NOT_RETURNED:
            metrics.PINS_UNRETURNED.labels(self._engine_id).inc()
        metrics.PIN_BLOCK_SECONDS.labels(outcome).inc(
            held.blocks * max(until_s - held.pinned_at_s, 0.0))

    def forget(self) -> None:
        """The engine's view is rebuilt from a snapshot or gone: pins held now are
        neither counted as paid nor as wasted."""
        self._held.clear()
        self._by_job.clear()
