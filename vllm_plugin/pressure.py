"""Pins giving way to the engine's own need for memory.

Two moments: a running request's allocation fails (vLLM would preempt a running
request), and nothing runs while the first waiting request does not fit beside the
pins (the engine would idle). The daemon's pressure order decides which pin goes;
without it, ``vllm_plugin.fallback`` does.

The scheduler wraps ``allocate_slots`` so that a failed allocation releases a pin
before vLLM preempts (``KvtetherMixin._wrap_allocation``). The wrapper costs about
1 us per call and vLLM calls ``allocate_slots`` once per running request per step,
so it is installed only on steps where an allocation can fail and a pin could give
way. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin import fallback
from vllm_plugin.decisions import DaemonOrders
from vllm_plugin.link import DaemonLink
from vllm_plugin.metadata import RequestMetadata
from vllm_plugin.pins import PinTable


class AllocationGuard:
    """Installs and removes the pin-aware allocation wrapper through ``hook`` (set by
    the scheduler; None: no wrapper, as in tests that drive the agent alone)."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.hook: Callable[[bool], None] | None = None
        self.hook_on = False
        self._bound = step_allocation_bound(scheduler)

    def set(self, enabled: bool) -> None:
        if enabled != self.hook_on and self.hook is not None:
            self.hook(enabled)
            self.hook_on = enabled

    def running_may_fail(self) -> bool:
        """Whether a running request's allocation can fail in the coming step: the
        free blocks do not cover the most the step can take. Each running request
        takes at most its new tokens' blocks plus a partial one and its lookahead and
        speculative slots, in every KV cache group, and the new tokens add up to the
        step's token budget at most. (vLLM's watermark holds back only admissions,
        which never release a pin.) Without this check the wrapper stays on at most
        steps with memory idle, under a policy that sends a pressure order with
        every decision."""
        bound = self._bound
        if bound is None:
            return True  # a scheduler of another shape: keep the wrapper
        budget_blocks, per_running = bound
        most_blocks = budget_blocks + len(self.sched.running) * per_running
        return bool(self.block_pool.get_num_free_blocks() <= most_blocks)


def step_allocation_bound(sched: Any) -> tuple[int, int] | None:
    """(blocks of the step's token budget, blocks per running request) over every KV
    cache group, from the scheduler's configuration (fixed at start); None for a
    scheduler without it."""
    try:
        size = int(sched.block_size)
        budget_tokens = int(sched.max_num_scheduled_tokens)
        extra_tokens = 1 + int(getattr(sched, "num_lookahead_tokens", 0) or 0) + int(
            getattr(sched, "num_spec_tokens", 0) or 0)
        groups = int(getattr(sched.kv_cache_manager, "num_kv_cache_groups", 1) or 1)
    except (AttributeError, TypeError, ValueError):
        return None
    if size <= 0:
        return None
    return groups * -(-budget_tokens // size), groups * (1 + -(-extra_tokens // size))


class PinPressure:
    """Releases pins for a failed allocation or an engine that would idle. ``orders``
    are the daemon's standing orders (its pressure order); ``metadata`` the agent's
    request metadata (for the jobs of waiting requests)."""

    def __init__(self, scheduler: Any, link: DaemonLink, counters: pb.EngineCounters,
                 pins: PinTable, orders: DaemonOrders, allocation: AllocationGuard,
                 metadata: Mapping[str, RequestMetadata]) -> None:
        self.sched = scheduler
        self.link = link
        self.counters = counters
        self.pin_table = pins
        self.orders = orders
        self.allocation = allocation
        self.metadata = metadata

    def on_allocation_failed(self, request: Any) -> bool:
        """An allocation for a running request failed: release the daemon's first
        pressure pin, if any, so vLLM retries before preempting a running request
        (daemon gone: ``fallback.oldest_pin``). A waiting request's failed admission
        releases nothing (vLLM just stops admitting; it never preempts for one).
        False: nothing released."""
        if getattr(getattr(request, "status", None), "name", "") != "RUNNING":
            return False
        orders = self.orders
        if (orders.pressure_max_running is not None
                and len(self.sched.running) > orders.pressure_max_running):
            return False
        pins = self.pin_table.pins
        while orders.pressure_order:
            pin = pins.get(orders.pressure_order.pop(0))
            if pin is not None:
                self.pin_table.release(pin, local=True)
                return True
        if not self.link.connected and pins:
            self.pin_table.release(fallback.oldest_pin(pins.values()), local=True)
            return True
        return False

    def set_allocation_hook(self) -> None:
        """Install the allocation wrapper for the coming step only if a failed
        allocation could release a pin in it."""
        self.allocation.set(self._pins_may_give_way())

    def _pins_may_give_way(self) -> bool:
        if not self.pin_table.pins or not self.allocation.running_may_fail():
            return False
        if not self.link.connected:
            return True  # daemon gone: any pin gives way (fallback.oldest_pin)
        orders = self.orders
        return bool(orders.pressure_order) and (
            orders.pressure_max_running is None
            or len(self.sched.running) <= orders.pressure_max_running)

    def release_for_idle_engine(self) -> bool:
        """Nothing runs and vLLM admitted nothing: the first waiting request does not
        fit beside the pins. Release one pin (``fallback.idle_release``); the next
        step retries the admission. False: nothing to release (the request waits on
        something else: a grammar, remote KV)."""
        waiting, holding = self.sched.waiting, getattr(self.sched, "kv_holding_waiting", None)
        head = _peek(waiting) or _peek(holding)
        if head is None or getattr(head.status, "name", "") not in ("WAITING", "PREEMPTED"):
            return False
        waiting_jobs = {self._job_of(r.request_id) for r in (*waiting, *(holding or ()))}
        pin = fallback.idle_release(self.pin_table.pins.values(), self.orders.pressure_order,
                                    self._job_of(head.request_id), waiting_jobs)
        self.counters.idle_pin_releases += 1
        self.pin_table.release(pin, local=True)
        return True

    def _job_of(self, request_id: str) -> str:
        meta = self.metadata.get(request_id)
        return meta.job_id if meta is not None else ""


def _peek(queue: Any) -> Any:
    """The request vLLM would try to admit first from a waiting queue, or None."""
    if not queue:
        return None
    return queue.peek_request()
