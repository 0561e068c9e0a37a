"""The version check at start: a tested vLLM is silent, an untested one warns once, a
vLLM without an internal the plugin needs gets its own scheduler back (fail-open) and
one error line naming what is missing. Fakes stand in for vLLM; the last test holds
the real one to the list."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.engine import requires_vllm
from vllm_plugin import compat
from vllm_plugin.scheduler import KvtetherMixin, build

REAL_IMPORTS = compat.IMPORTS


def _method(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def fake_vllm_scheduler(drop: str = "") -> type:
    """A fake of vLLM's scheduler class: every internal the plugin needs but ``drop``
    (a scheduler method, or an attribute of the scheduler or of its parts)."""
    block = SimpleNamespace(**{name: None for name in compat.BLOCK_ATTRIBUTES})
    queue = SimpleNamespace(**{name: _method for name in compat.FREE_QUEUE_ATTRIBUTES
                               if name != drop})
    pool = SimpleNamespace(**{name: _method for name in compat.BLOCK_POOL_ATTRIBUTES
                              if name != drop})
    pool.blocks, pool.free_block_queue = [block], queue
    manager = SimpleNamespace(**{name: _method for name in
                                 compat.KV_CACHE_MANAGER_ATTRIBUTES if name != drop})
    manager.block_pool = pool

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in compat.SCHEDULER_ATTRIBUTES:
            if name != drop:
                setattr(self, name, None)
        if drop != "kv_cache_manager":
            self.kv_cache_manager = manager

    methods = {name: _method for name in compat.SCHEDULER_METHODS if name != drop}
    methods["schedule"] = lambda self: "vLLM's own schedule"
    return type("FakeScheduler", (), {"__init__": __init__, **methods})


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The imports the check makes, on modules every interpreter has.
    monkeypatch.setattr(compat, "IMPORTS", (("types", "SimpleNamespace"),))
    import os

    for name in [n for n in os.environ if n.startswith("KVTETHER_PLUGIN_")]:
        monkeypatch.delenv(name)


def plugin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvtether.plugin"
            and r.levelno >= logging.WARNING]


def check(vllm_class: type, version: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, bool]:
    """The plugin's start-up check on a scheduler of ``vllm_class`` at ``version``."""
    monkeypatch.setattr(compat, "vllm_version", lambda: version)
    under = type("Under", (KvtetherMixin, vllm_class), {})
    scheduler = under.__new__(under)
    vllm_class.__init__(scheduler)  # type: ignore[misc]
    return scheduler, scheduler._fits_vllm()


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0", "0.32.0+cpu"])
def test_a_tested_vllm_starts_the_plugin_silently(
        version: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtether.plugin"):
        scheduler, fits = check(fake_vllm_scheduler(), version, monkeypatch)
    assert fits and isinstance(scheduler, KvtetherMixin)
    assert plugin_records(caplog) == []


def test_an_untested_vllm_gets_one_warning_naming_the_tested_range(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtether.plugin"):
        scheduler, fits = check(fake_vllm_scheduler(), "0.34.1", monkeypatch)
    assert fits and isinstance(scheduler, KvtetherMixin)
    [record] = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("kvtether: vLLM 0.34.1 is untested (tested: 0.32.0, "
                                   "0.33.0, 0.34.0); the plugin runs, fail-open")


@pytest.mark.parametrize(("drop", "named", "before_build"), [
    ("_free_blocks", "Scheduler._free_blocks", True),
    ("make_stats", "Scheduler.make_stats", True),
    ("max_num_scheduled_tokens", "Scheduler.max_num_scheduled_tokens", False),
    ("pop_blocks_for_free", "KVCacheManager.pop_blocks_for_free", False),
    ("_maybe_evict_cached_block", "BlockPool._maybe_evict_cached_block", False),
    ("prepend_n", "FreeKVCacheBlockQueue.prepend_n", False),
])
def test_a_missing_internal_leaves_vllms_scheduling_and_one_error(
        drop: str, named: str, before_build: bool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Through the constructor vLLM calls: no daemon link, no exception."""
    vllm_class = fake_vllm_scheduler(drop)
    plugin_class = type("Under", (KvtetherMixin, vllm_class), {})
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.35.0")
    with caplog.at_level(logging.INFO, logger="kvtether.plugin"):
        scheduler = build(vllm_class, plugin_class)
    # A missing method is seen before the build: vLLM's own class is built instead.
    # A missing attribute is seen after: no agent, the overrides only call vLLM's.
    assert type(scheduler) is (vllm_class if before_build else plugin_class)
    assert getattr(scheduler, "kvtether", None) is None
    assert scheduler.schedule() == "vLLM's own schedule"
    [record] = plugin_records(caplog)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (f"kvtether: vLLM 0.35.0 lacks what the plugin needs "
                                   f"({named}): the plugin steps aside, scheduling is "
                                   f"vLLM's own")


def test_a_missing_module_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "IMPORTS", (("types", "SimpleNamespace"),
                                            ("types", "Gone"), ("no_such_module", "X")))
    vllm_class = fake_vllm_scheduler()
    scheduler = vllm_class()
    assert compat.missing_internals(scheduler, vllm_class) == [
        "types.Gone", "no_such_module.X"]


def test_switched_off_the_scheduler_is_vllms_own_and_checks_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    vllm_class = fake_vllm_scheduler("_free_blocks")
    plugin_class = type("Under", (KvtetherMixin, vllm_class), {})
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.0")
    monkeypatch.setenv("KVTETHER_PLUGIN_ENABLED", "0")
    monkeypatch.setenv("KVTETHER_PLUGIN_DEADLINE_MS", "fast")
    with caplog.at_level(logging.INFO, logger="kvtether.plugin"):
        scheduler = build(vllm_class, plugin_class)
    assert type(scheduler) is vllm_class
    assert plugin_records(caplog) == []


@requires_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_installed_vllm_has_everything_the_plugin_needs(
        async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.engine import tiny_model_dir
    from tests.support.scheduler import build_scheduler

    monkeypatch.setattr(compat, "IMPORTS", REAL_IMPORTS)
    scheduler = build_scheduler(tiny_model_dir(), num_blocks=16,
                                async_scheduling=async_scheduling)
    assert compat.missing_internals(scheduler, type(scheduler)) == []


@requires_vllm
@pytest.mark.parametrize(("setting", "gap", "expected"), [
    ("ENABLED", "", "Scheduler"),  # switched off
    ("", "SCHEDULER_METHODS", "Scheduler"),  # a method gone: vLLM's class is built
    ("", "SCHEDULER_ATTRIBUTES", "KvtetherSyncScheduler"),  # an attribute gone
])
def test_on_the_real_scheduler_a_step_aside_serves_requests_as_vllm_does(
        setting: str, gap: str, expected: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from tests.support.engine import tiny_model_dir
    from tests.support.scheduler import build_scheduler, free_blocks, make_request, step
    from vllm_plugin.scheduler import KvtetherScheduler

    monkeypatch.setattr(compat, "IMPORTS", REAL_IMPORTS)
    if setting:
        monkeypatch.setenv(f"KVTETHER_PLUGIN_{setting}", "0")
    if gap:
        monkeypatch.setattr(compat, gap, (*getattr(compat, gap), "renamed_in_vllm_9"))
    # No daemon at this address: a plugin that did not step aside would try it.
    monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADDRESS", "127.0.0.1:1")
    with caplog.at_level(logging.INFO, logger="kvtether.plugin"):
        scheduler = build_scheduler(tiny_model_dir(), num_blocks=16,
                                    scheduler_cls=KvtetherScheduler)
    assert type(scheduler).__name__ == expected
    assert getattr(scheduler, "kvtether", None) is None
    errors = [r.getMessage() for r in plugin_records(caplog)]
    assert errors == ([] if setting else [
        f"kvtether: vLLM {compat.vllm_version()} lacks what the plugin needs "
        f"(Scheduler.renamed_in_vllm_9): the plugin steps aside, scheduling is vLLM's own"])
    scheduler.add_request(make_request("r1", list(range(40)), max_tokens=3))
    for _ in range(5):
        step(scheduler)
    assert not scheduler.has_unfinished_requests() and free_blocks(scheduler) == 15
