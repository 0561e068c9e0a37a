"""The pin table: finished requests' blocks held for the job's next turn.

Contract: every pinned block is released exactly once, through :meth:`PinTable.release`
(a daemon RELEASE, the local bound, allocation pressure, an idle engine,
``reset_prefix_cache``, shutdown). Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin.fallback import local_bound_s
from vllm_plugin.link import DaemonLink
from vllm_plugin.settings import PluginSettings


@dataclass(slots=True)
class Pin:
    request_id: str
    job_id: str
    blocks: list[Any]  # vLLM KVCacheBlocks, allocation order
    pinned_at_s: float
    # Local bound: released when the engine clock passes it, whatever happens.
    release_at_s: float
    confirmed: bool
    last_sched_seq: int
    tool: str


class PinTable:
    """The pins held, by request id (``pins``), and how their blocks go back to vLLM.
    A pin released here on the engine's own word is queued in ``released`` (the
    report builder's list) for the daemon, while connected. ``switch_allocation``
    turns the allocation wrapper on or off (``pressure.AllocationGuard.set``)."""

    def __init__(self, scheduler: Any, settings: PluginSettings, link: DaemonLink,
                 counters: pb.EngineCounters, switch_allocation: Callable[[bool], None],
                 released: list[str], clock_s: Callable[[], float]) -> None:
        self.sched = scheduler
        self.settings = settings
        self.link = link
        self.counters = counters
        self.switch_allocation = switch_allocation
        self.released = released
        self.clock_s = clock_s
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.pins: dict[str, Pin] = {}

    def hold(self, request: Any, job_id: str, tool: str) -> None:
        """Pin a finished request's blocks provisionally, until the daemon decides, and
        remove the request from the scheduler (vLLM's invariant: deleted once)."""
        blocks = self.sched.kv_cache_manager.pop_blocks_for_free(request)
        del self.sched.requests[request.request_id]
        now_s = self.clock_s()
        self.pins[request.request_id] = Pin(
            request_id=request.request_id,
            job_id=job_id,
            blocks=list(blocks),
            pinned_at_s=now_s,
            release_at_s=now_s + self.settings.provisional_pin_s,
            confirmed=False,
            last_sched_seq=getattr(request, "last_sched_seq", 0),
            tool=tool,
        )

    def expire(self) -> None:
        """Release every pin past its local bound (``fallback.local_bound_s``)."""
        if not self.pins:
            return
        now_s = self.clock_s()
        connected = self.link.connected
        for pin in list(self.pins.values()):
            if now_s >= local_bound_s(pin, connected, self.settings.max_pin_s):
                self.counters.local_pin_expiries += 1
                self.release(pin, local=True)

    def release(self, pin: Pin, local: bool) -> None:
        """Give ``pin``'s blocks back to vLLM (a no-op if it is no longer held).
        ``local``: the engine's own word, which the daemon hears in the next report."""
        if self.pins.pop(pin.request_id, None) is None:
            return
        self.count_provisional(pin)
        if not self.pins:
            self.switch_allocation(False)  # no pin can give way any more
        sched = self.sched
        # The request's last step may still be writing these blocks (async
        # scheduling): return them through vLLM's fence, as _free_request_blocks does.
        if getattr(sched, "defer_block_free", False) and (
            pin.last_sched_seq > getattr(sched, "processed_step_seq", pin.last_sched_seq)
        ):
            sched.deferred_frees.append((sched.sched_step_seq, pin.blocks))
        else:
            # Reverse order: the tail blocks are evicted first (vLLM's convention).
            self.block_pool.free_blocks(reversed(pin.blocks))
        if local and self.link.connected:
            self.released.append(pin.request_id)

    def release_all(self) -> None:
        for pin in list(self.pins.values()):
            self.release(pin, local=True)

    def count_provisional(self, pin: Pin) -> None:
        """The daemon's word (or a local release) ends a provisional pin: count the
        memory-time it held waiting for that word."""
        if not pin.confirmed:
            self.counters.provisional_block_seconds += len(pin.blocks) * max(
                self.clock_s() - pin.pinned_at_s, 0.0)
