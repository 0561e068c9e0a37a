"""kvtether's vLLM schedulers: vLLM's own ``Scheduler`` / ``AsyncScheduler`` plus a thin
mixin that reports to the daemon and applies its decisions.

Run vLLM with::

    --scheduler-cls vllm_plugin.scheduler.KvtetherScheduler --scheduling-policy priority

``KvtetherScheduler`` picks the async or the sync class by
``scheduler_config.async_scheduling`` (a plain ``Scheduler`` subclass would silently
lose vLLM's async overlap), and builds vLLM's own class when the plugin is switched
off (``KVTETHER_PLUGIN_ENABLED=0``). The mixin overrides vLLM's scheduler methods
``add_request``, ``schedule``, ``update_from_output``, ``make_stats``,
``_free_request`` / ``_free_blocks`` (pins), ``reset_prefix_cache`` and ``shutdown``.
On this scheduler's own objects only, it also replaces the KV cache manager's
``allocate_slots`` while pins are held (:meth:`KvtetherMixin._wrap_allocation`),
wraps its ``free`` and ``pop_blocks_for_free`` (:meth:`KvtetherMixin._wrap_frees`),
and lets the block pool take a subclass of vLLM's class while blocks are retained
(``vllm_plugin.retention``). On a vLLM without one of these, or without an attribute
the plugin reads, the plugin steps aside at start (``vllm_plugin.compat``). The
policy lives in the daemon (what the engine does without it, in
``vllm_plugin.fallback``), the engine-side bookkeeping in
``vllm_plugin.agent.EngineAgent`` and the parts it coordinates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_plugin import compat
from vllm_plugin.agent import EngineAgent
from vllm_plugin.clock import EngineClock
from vllm_plugin.link import DaemonLink
from vllm_plugin.settings import PluginSettings
from vllm_plugin.vllm_tool_parser import VllmToolParser

logger = logging.getLogger("kvtether.plugin")


def _tokenizer_loader(vllm_config: Any) -> Callable[[], Any]:
    """The model's tokenizer, loaded on first use (then the same one)."""
    tokenizer: Any = None

    def load() -> Any:
        nonlocal tokenizer
        if tokenizer is None:
            try:  # vLLM >= 0.32
                from vllm.tokenizers import cached_tokenizer_from_config

                tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
            except ImportError:  # older layouts
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        return tokenizer

    return load


def _tail_decoder(load_tokenizer: Callable[[], Any]) -> Callable[[Sequence[int]], str]:
    """Decode output tokens with the model's tokenizer, as kvtether's parsing reads them."""

    def decode(tokens: Sequence[int]) -> str:
        return str(load_tokenizer().decode(list(tokens), skip_special_tokens=True))

    return decode


def _use_priority_policy(vllm_config: Any) -> None:
    """kvtether's decisions are ``Request.priority`` values, which only vLLM's priority
    policy reads: turn it on in the engine's scheduler config before vLLM builds its
    queues from it, with one line saying so. vLLM's FCFS policy keeps requests in
    the order they reach the engine and ignores priorities; its priority policy with
    every client at priority 0 orders them by arrival (``vllm_plugin.ranks``)."""
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    policy = getattr(scheduler_config, "policy", None)
    if scheduler_config is None or policy == "priority":
        return
    scheduler_config.policy = "priority"
    logger.warning("kvtether: vLLM's scheduling policy is now 'priority' (it was %r): "
                   "kvtether orders requests inside each client priority; start vLLM "
                   "with --scheduling-policy priority to say so", policy)


class KvtetherMixin:
    """Put before vLLM's scheduler class in the bases. Holds no policy."""

    # A class default: vLLM's own tests build a scheduler with object.__new__ and set
    # only the attributes vLLM's methods read; the overrides below then step aside.
    kvtether: EngineAgent | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = PluginSettings.from_env()
        if settings.enabled:
            _use_priority_policy(kwargs.get("vllm_config", args[0] if args else None))
        super().__init__(*args, **kwargs)
        self.kvtether = None
        if not settings.enabled:
            logger.info("kvtether: disabled (KVTETHER_PLUGIN_ENABLED=0): vLLM scheduling")
            return
        if not self._fits_vllm():
            return
        from vllm.v1.core.sched.request_queue import SchedulingPolicy

        sched: Any = self
        if sched.policy != SchedulingPolicy.PRIORITY:
            logger.error("kvtether: vLLM runs its %s policy, not its priority policy: "
                         "kvtether steps aside, vLLM schedules alone", sched.policy.value)
            return
        from sidecar.api.toolcalls import resolve_tool
        from vllm_plugin.retention import install as install_retention

        # One clock for the agent's parts and the pool's retention durations alike.
        clock = EngineClock()
        # Retention priorities on this scheduler's own block pool (which stays vLLM's own
        # class, unchanged, until a block is retained).
        retention = install_retention(sched.kv_cache_manager.block_pool, clock)
        load_tokenizer = _tokenizer_loader(sched.vllm_config)
        self.kvtether = EngineAgent(
            self,
            settings,
            link=DaemonLink.for_settings(settings),
            clock=clock,
            decode_tail=_tail_decoder(load_tokenizer),
            parse_tool=resolve_tool,
            vllm_tool_parser=(
                VllmToolParser(settings.tool_parser, load_tokenizer,
                               sched.vllm_config.model_config)
                if settings.tool_parser else None),
        )
        self._wrap_allocation(self.kvtether)
        if retention is not None:
            self._wrap_frees(self.kvtether)
        if settings.tool_parser:
            logger.info("kvtether: tool calls read by vLLM's %r tool parser, by kvtether's "
                        "own where it finds none", settings.tool_parser)
        logger.info("kvtether: engine %s reporting to daemon at %s (deadline %.1f ms, "
                    "fail-%s)", settings.engine_id, settings.daemon_address,
                    settings.deadline_s * 1000, "closed" if settings.fail_closed else "open")

    def _vllm_class(self) -> type:
        """vLLM's own scheduler class, the one after this mixin in the bases."""
        mro = type(self).__mro__
        return mro[mro.index(KvtetherMixin) + 1]

    def _fits_vllm(self) -> bool:
        """Check the running vLLM at start: untested, one warning; without an internal
        the plugin needs, one error, and the plugin steps aside (no agent: every
        override below only calls vLLM's). False when it stepped aside."""
        version = compat.vllm_version()
        missing = compat.missing_internals(self, self._vllm_class())
        if missing:
            logger.error(compat.missing_internals_error(version, missing))
            return False
        warning = compat.untested_version_warning(version)
        if warning is not None:
            logger.warning(warning)
        return True

    def _wrap_allocation(self, agent: EngineAgent) -> None:
        # When an allocation fails, the daemon's order decides whether a pin goes before
        # vLLM preempts a running request: retry after each pin released. Wrapped on
        # this scheduler's own KV cache manager instance only.
        # Installed only while pins are held and a running request's allocation can
        # fail that step (vllm_plugin.pressure): the wrapper costs ~1 us per call, and
        # vLLM calls allocate_slots once per running request per step.
        manager: Any = self.kv_cache_manager  # type: ignore[attr-defined]
        allocate = manager.allocate_slots

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = allocate(request, *args, **kwargs)
            while blocks is None and agent.on_allocation_failed(request):
                blocks = allocate(request, *args, **kwargs)
            return blocks

        def hook(enabled: bool) -> None:
            if enabled:
                manager.allocate_slots = allocate_slots
            elif "allocate_slots" in vars(manager):
                del manager.allocate_slots  # back to the class's own method

        agent.allocation.hook = hook

    def _wrap_frees(self, agent: EngineAgent) -> None:
        # Every way a request's blocks leave it — freed at finish or preemption, popped
        # for a deferred free or a pin — first tags them with the request's retention
        # priorities. Wrapped on this scheduler's own KV cache manager instance only.
        manager: Any = self.kv_cache_manager  # type: ignore[attr-defined]
        free, pop_blocks_for_free = manager.free, manager.pop_blocks_for_free

        def free_retained(request: Any) -> None:
            agent.retain(request)
            free(request)

        def pop_retained(request: Any) -> Any:
            agent.retain(request)
            return pop_blocks_for_free(request)

        manager.free = free_retained
        manager.pop_blocks_for_free = pop_retained

    # --- hooks ----------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        agent = self.kvtether
        is_new = agent is not None and request.request_id not in self.requests  # type: ignore[attr-defined]
        if is_new:
            agent.on_add(request)  # type: ignore[union-attr]
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        agent = self.kvtether
        if agent is not None:
            agent.before_schedule()
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if agent is not None:
            agent.after_schedule(output)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        if self.kvtether is not None:
            self.kvtether.after_update()  # no-op if make_stats already reported
        return outputs

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM computes this step's KV usage here, at the end of update_from_output:
        # report first, so pins the daemon releases now are already gone from it.
        if self.kvtether is not None:
            self.kvtether.after_update()
        return super().make_stats(*args, **kwargs)  # type: ignore[misc]

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self.kvtether is not None:
            self.kvtether.on_finish(request)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def _free_blocks(self, request: Any) -> None:
        # Pins follow vLLM's invariants: blocks taken with pop_blocks_for_free, the
        # request deleted from self.requests exactly once (by take_blocks or by vLLM).
        if self.kvtether is not None and self.kvtether.take_blocks(request):
            return
        super()._free_blocks(request)  # type: ignore[misc]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # Pinned blocks hold references: release them first or the reset fails.
        if self.kvtether is not None:
            self.kvtether.release_all_pins()
        return bool(super().reset_prefix_cache(*args, **kwargs))  # type: ignore[misc]

    def shutdown(self) -> None:
        if self.kvtether is not None:
            self.kvtether.close()
        super().shutdown()  # type: ignore[misc]


class KvtetherSyncScheduler(KvtetherMixin, Scheduler):
    """vLLM's synchronous scheduler with kvtether."""


class KvtetherAsyncScheduler(KvtetherMixin, AsyncScheduler):
    """vLLM's async (overlapped) scheduler with kvtether."""


class KvtetherScheduler:
    """The class to name in ``--scheduler-cls``: builds the sync or async variant to
    match ``scheduler_config.async_scheduling``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config: Any = kwargs.get("vllm_config", args[0] if args else None)
        async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        if async_scheduling:
            return build(AsyncScheduler, KvtetherAsyncScheduler, *args, **kwargs)
        return build(Scheduler, KvtetherSyncScheduler, *args, **kwargs)


def build(vllm_class: type, plugin_class: type, *args: Any, **kwargs: Any) -> Any:
    """``plugin_class`` (vLLM's ``vllm_class`` with the mixin) — or ``vllm_class``
    itself, exactly vLLM's scheduler, when the plugin is switched off or vLLM lacks
    a method or module the plugin needs (one error line naming each missing one)."""
    if not PluginSettings.from_env().enabled:
        logger.info("kvtether: disabled (KVTETHER_PLUGIN_ENABLED=0): vLLM scheduling")
        return vllm_class(*args, **kwargs)
    missing = compat.missing_in_class(vllm_class)
    if not missing:
        return plugin_class(*args, **kwargs)
    scheduler = vllm_class(*args, **kwargs)
    logger.error(compat.missing_internals_error(
        compat.vllm_version(), missing + compat.missing_in_instance(scheduler)))
    return scheduler
