"""Which vLLM the plugin runs on, checked once when its scheduler starts.

- A tested vLLM (:data:`TESTED_VLLM_VERSIONS`): nothing is said.
- Another version: one warning naming the tested ones; the plugin runs.
- A vLLM without an internal the plugin relies on (a method its scheduler overrides
  or calls, an attribute it reads; listed below): one error line naming each missing
  one, and the plugin steps aside: the engine schedules as vLLM's own scheduler does
  (fail-open), never stopped by a traceback. A missing method or module is seen
  before the scheduler is built, and vLLM's own class is built instead; a missing
  attribute is seen on the built scheduler, whose overrides then only call vLLM's.

vLLM calls ``--scheduler-cls`` "not public": these names are the plugin's whole
dependence on vLLM's insides (docs/compatibility.md). Cheap: attribute look-ups on
objects already built, and no import beyond the vLLM modules the scheduler loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

# vLLM releases the plugin's test suite runs against (scripts/dev.sh test).
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")

# vLLM's Scheduler methods the plugin overrides (vllm_plugin.scheduler) or calls.
# Checked on vLLM's class: on the instance, the plugin's own overrides would hide a
# missing one.
SCHEDULER_METHODS = (
    "add_request", "schedule", "update_from_output", "make_stats", "_free_request",
    "_free_blocks", "reset_prefix_cache", "shutdown", "has_unfinished_requests",
)
# Set by vLLM's Scheduler.__init__, read by the agent and its parts.
SCHEDULER_ATTRIBUTES = (
    "policy", "vllm_config", "requests", "running", "waiting", "block_size",
    "max_num_scheduled_tokens", "kv_cache_manager",
)
# Read when the scheduler defers block frees (vllm_plugin.pins).
DEFERRED_FREE_ATTRIBUTES = ("processed_step_seq", "deferred_frees", "sched_step_seq")
KV_CACHE_MANAGER_ATTRIBUTES = (
    "block_pool", "allocate_slots", "free", "pop_blocks_for_free", "get_blocks",
    "get_block_ids", "kv_cache_config",
)
# Read by the agent, and overridden or read by retention (vllm_plugin.retention).
BLOCK_POOL_ATTRIBUTES = (
    "blocks", "free_block_queue", "enable_caching", "num_gpu_blocks",
    "get_num_free_blocks", "free_blocks", "get_new_blocks", "touch",
    "_maybe_evict_cached_block", "evict_blocks", "reset_prefix_cache",
)
FREE_QUEUE_ATTRIBUTES = (
    "num_free_blocks", "fake_free_list_head", "fake_free_list_tail", "remove", "append",
    "append_n", "prepend_n", "popleft_n",
)
BLOCK_ATTRIBUTES = ("block_id", "ref_cnt", "pool", "block_hash", "is_null",
                    "next_free_block")
# Imported by the plugin's modules when the scheduler starts.
IMPORTS = (
    ("vllm.v1.core.block_pool", "BlockPool"),
    ("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue"),
    ("vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id"),
    ("vllm.v1.core.sched.request_queue", "SchedulingPolicy"),
)


def vllm_version() -> str:
    """The running vLLM's version ("unknown" when it does not say)."""
    try:
        from vllm.version import __version__
    except ImportError:
        return "unknown"
    return str(__version__)


def untested_version_warning(version: str) -> str | None:
    """The warning for ``version``; None for a tested one. A local build tag
    (``0.32.0+cpu``) is the release it was built from."""
    if version.split("+", 1)[0] in TESTED_VLLM_VERSIONS:
        return None
    return (f"kvtether: vLLM {version} is untested (tested: "
            f"{', '.join(TESTED_VLLM_VERSIONS)}); the plugin runs, fail-open")


def missing_internals(scheduler: Any, vllm_class: type) -> list[str]:
    """What the plugin needs from vLLM and ``scheduler`` (built by ``vllm_class``,
    vLLM's own scheduler class) lacks, as qualified names; empty when nothing is."""
    return missing_in_class(vllm_class) + missing_in_instance(scheduler)


def missing_in_class(vllm_class: type) -> list[str]:
    """What the plugin needs before a scheduler is built: the modules it imports and
    the methods of vLLM's scheduler class (``vllm_class``) it overrides or calls."""
    missing: list[str] = []
    for module, name in IMPORTS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name}")
    return missing + _absent(vllm_class, SCHEDULER_METHODS, "Scheduler")


def missing_in_instance(scheduler: Any) -> list[str]:
    """What the plugin reads on a built scheduler and its parts, and ``scheduler``
    lacks."""
    missing = _absent(scheduler, SCHEDULER_ATTRIBUTES, "Scheduler")
    if getattr(scheduler, "defer_block_free", False):
        missing += _absent(scheduler, DEFERRED_FREE_ATTRIBUTES, "Scheduler")
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None:
        return missing
    missing += _absent(manager, KV_CACHE_MANAGER_ATTRIBUTES, "KVCacheManager")
    pool = getattr(manager, "block_pool", None)
    if pool is None:
        return missing
    missing += _absent(pool, BLOCK_POOL_ATTRIBUTES, "BlockPool")
    queue = getattr(pool, "free_block_queue", None)
    if queue is not None:
        missing += _absent(queue, FREE_QUEUE_ATTRIBUTES, "FreeKVCacheBlockQueue")
    blocks = getattr(pool, "blocks", None)
    if blocks:
        missing += _absent(blocks[0], BLOCK_ATTRIBUTES, "KVCacheBlock")
    return missing


def missing_internals_error(version: str, missing: Iterable[str]) -> str:
    return (f"kvtether: vLLM {version} lacks what the plugin needs "
            f"({', '.join(missing)}): the plugin steps aside, scheduling is vLLM's own")


def _absent(owner: Any, names: Iterable[str], label: str) -> list[str]:
    return [f"{label}.{name}" for name in names if not hasattr(owner, name)]
