"""The pytest plugin that runs vLLM's own scheduler tests against kvtether's scheduler.

``scripts/conformance.py`` loads it (``-p scripts.conformance_plugin``) in a pytest run
over the test files of a vLLM source distribution; nothing of vLLM's is edited. Before
any test module is imported it puts kvtether's classes where vLLM's tests import the
schedulers from: ``vllm.v1.core.sched.scheduler.Scheduler`` becomes a subclass of
``vllm_plugin.scheduler.KvtetherSyncScheduler`` and ``vllm.v1.core.sched.async_scheduler
.AsyncScheduler`` one of ``KvtetherAsyncScheduler``. Each one built:

- runs vLLM's ``priority`` policy whatever the test asked for, as kvtether requires
  (``--scheduling-policy priority``, what a user starts vLLM with);
- reports to the daemon the runner names in ``KVTETHER_PLUGIN_DAEMON_ADDRESS``, under
  an engine id of its own; with ``KVTETHER_CONFORMANCE_WAIT_CONNECTED=1`` it waits
  (at most 10 s, else the test fails) until the link is up, so that a test runs
  against the daemon from its first step rather than on the fallback;
- is closed (its link and daemon session) when the test ends.

It also refuses to start unless ``vllm`` is the release the runner meant
(``KVTETHER_CONFORMANCE_VLLM``: ``VERSION`` or ``VERSION@DIRECTORY``), and writes each
test's outcome (``passed``, ``failed``, ``error``, ``skipped``; the first line of the
failure) as JSON to ``KVTETHER_CONFORMANCE_RESULTS``.

It lives outside kvtether's ``tests`` package on purpose: vLLM's test files import
their helpers as ``tests.…``, which must be vLLM's here.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

_built: list[Any] = []
_closing: list[threading.Thread] = []
_engine_ids = itertools.count()
_results: dict[str, dict[str, str]] = {}
# Worst outcome first: a test that failed in its call and errored in teardown failed.
_RANK = {"failed": 0, "error": 1, "skipped": 2, "passed": 3}


def _check_vllm() -> None:
    import vllm

    want = os.environ.get("KVTETHER_CONFORMANCE_VLLM", "")
    version, _, directory = want.partition("@")
    if version and vllm.__version__ != version:
        raise pytest.UsageError(f"conformance: expected vLLM {version}, imported "
                                f"{vllm.__version__} from {vllm.__file__}")
    if directory and not vllm.__file__.startswith(directory):
        raise pytest.UsageError(f"conformance: expected vLLM from {directory}, imported "
                                f"it from {vllm.__file__}")


def _conformance_init(self: Any, cls: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    vllm_config: Any = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    # kvtether requires vLLM's priority policy (vllm_plugin.scheduler); a user starts
    # vLLM with --scheduling-policy priority, so vLLM's tests run with it too.
    vllm_config.scheduler_config.policy = "priority"
    os.environ["KVTETHER_PLUGIN_ENGINE_ID"] = f"conformance-{os.getpid()}-{next(_engine_ids)}"
    super(cls, self).__init__(*args, **kwargs)
    _built.append(self)
    agent = getattr(self, "kvtether", None)
    if agent is None or os.environ.get("KVTETHER_CONFORMANCE_WAIT_CONNECTED") != "1":
        return
    deadline = time.monotonic() + 10.0
    while not agent.link.connected:
        if time.monotonic() > deadline:
            raise RuntimeError("conformance: the plugin did not connect to the daemon at "
                               f"{agent.settings.daemon_address} within 10 s")
        time.sleep(0.005)


def _install() -> None:
    """kvtether's schedulers in place of vLLM's, where vLLM's tests import them from."""
    from vllm.v1.core.sched import async_scheduler, scheduler

    # Imported first, so that kvtether's classes extend vLLM's own.
    from vllm_plugin.scheduler import KvtetherAsyncScheduler, KvtetherSyncScheduler

    class Scheduler(KvtetherSyncScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _conformance_init(self, Scheduler, args, kwargs)

    class AsyncScheduler(KvtetherAsyncScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _conformance_init(self, AsyncScheduler, args, kwargs)

    scheduler.Scheduler = Scheduler
    async_scheduler.AsyncScheduler = AsyncScheduler


def pytest_configure(config: pytest.Config) -> None:
    _check_vllm()
    _install()


@pytest.fixture(autouse=True)
def _close_schedulers() -> Iterator[None]:
    yield
    while _built:
        agent = getattr(_built.pop(), "kvtether", None)
        if agent is None:
            continue
        agent.release_all_pins()
        # Closing the link joins its thread, which may be in a 1 s connection attempt
        # (no daemon): off the test's thread, so that no test waits for it.
        closing = threading.Thread(target=agent.link.close, daemon=True)
        closing.start()
        _closing.append(closing)


def pytest_unconfigure(config: pytest.Config) -> None:
    for closing in _closing:
        closing.join(timeout=5)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.passed and report.when != "call":
        return
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
    else:
        outcome = "skipped" if report.skipped else "passed"
    message = ""
    if not report.passed:
        # The first "E   " lines (the exception, or "fixture 'x' not found"), else the
        # crash line pytest shows.
        errors = [line[1:].strip() for line in report.longreprtext.splitlines()
                  if line.startswith("E ") and line[1:].strip()]
        crash = getattr(report.longrepr, "reprcrash", None)
        # Two lines: pydantic puts the cause (the model that cannot be found) second.
        message = " / ".join(errors[:2]) if errors else crash.message if crash else ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])  # (file, line, reason)
        message = message.strip().splitlines()[0] if message.strip() else ""
    previous = _results.get(report.nodeid)
    if previous is None or _RANK[outcome] < _RANK[previous["outcome"]]:
        _results[report.nodeid] = {"outcome": outcome, "message": message[:300]}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("KVTETHER_CONFORMANCE_RESULTS")
    if path:
        with open(path, "w") as out:
            json.dump(_results, out, indent=1, sort_keys=True)
