"""The plugin inside vLLM's real scheduler (no model, no worker), talking to a real daemon
process: pins, prefix hits, job-level order, pressure, daemon death, no leaked block."""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.api.retention_ranges import Protection
from tests.support.daemon import DaemonController, DaemonProcess, running_daemon
from tests.support.engine import requires_vllm, tiny_model_dir

pytestmark = requires_vllm

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Engine:
    """vLLM's scheduler with the plugin, stepped by hand."""

    def __init__(self, model_dir: Any, daemon: DaemonProcess | DaemonController,
                 monkeypatch: pytest.MonkeyPatch, num_blocks: int = 64,
                 async_scheduling: bool = False, wait_connected: bool = True,
                 **env: str) -> None:
        from tests.support.scheduler import build_scheduler, free_blocks
        from vllm_plugin.scheduler import KvtetherScheduler

        monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADDRESS", daemon.address)
        monkeypatch.setenv("KVTETHER_PLUGIN_ENGINE_ID", f"inprocess-{id(self)}")
        monkeypatch.setenv("KVTETHER_PLUGIN_DEADLINE_MS", "200")  # a loaded CI box
        # Steps here take a millisecond, not a forward pass: wait for each answer so
        # the decisions land on the step they were made for (deterministic tests).
        monkeypatch.setenv("KVTETHER_PLUGIN_FAIL_MODE", "closed")
        for name, value in env.items():
            monkeypatch.setenv(f"KVTETHER_PLUGIN_{name}", value)
        self.sched = build_scheduler(model_dir, num_blocks=num_blocks, block_size=BLOCK,
                                     scheduler_cls=KvtetherScheduler,
                                     async_scheduling=async_scheduling)
        self.agent = self.sched.kvtether
        self.clock_s: Callable[[], float] = time.time  # what requests arrive stamped with
        self._free_blocks = free_blocks
        if wait_connected:
            wait_until(lambda: self.agent.link.connected)
        self.start_free = self.free()
        self.cached_tokens: dict[str, int] = {}
        self.preemptions = 0

    def free(self) -> int:
        return int(self._free_blocks(self.sched))

    def add(self, request_id: str, prompt: list[int], job: str | None, last: bool = False,
            max_tokens: int = 4) -> None:
        from tests.support.scheduler import make_request

        # A non-last turn ends with a tool call (Continuum pins only those); the client
        # names it, as vllm_xargs "tool" does.
        extra = None if job is None else {"job_id": job, "is_last_step": int(last)}
        if extra is not None and not last:
            extra["tool"] = "ls"
        self.sched.add_request(make_request(request_id, prompt, max_tokens, BLOCK,
                                            arrival_time=self.clock_s(), extra_args=extra))

    def use_clock(self, clock_s: Callable[[], float]) -> None:
        """Run the engine on ``clock_s`` from now on, as the twin runs it on its own."""
        self.agent.clock.replace(clock_s)
        self.clock_s = clock_s

    def step(self) -> Any:
        from tests.support.scheduler import step

        output = step(self.sched)
        self.preemptions += len(output.preempted_req_ids or ())
        for new in output.scheduled_new_reqs:
            # Computed tokens at admission = the prefix-cache hit.
            self.cached_tokens.setdefault(new.req_id, new.num_computed_tokens)
        return output

    def drain(self, max_steps: int = 2000) -> list[str]:
        admitted = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return admitted
            admitted += [r.req_id for r in self.step().scheduled_new_reqs]
        raise AssertionError("the engine did not drain")

    def close(self) -> None:
        self.sched.shutdown()


# The ``engines`` fixture: an Engine with the plugin talking to the given daemon.
MakeEngine = Callable[..., Engine]


@pytest.fixture
def engines(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeEngine]:
    made: list[Engine] = []

    def make(daemon: DaemonProcess, **kwargs: Any) -> Engine:
        engine = Engine(model_dir, daemon, monkeypatch, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(scope="module")
def continuum() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "continuum") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def fcfs() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "fcfs") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def adaptive() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "adaptive") as daemon:
        yield daemon


def context(turn: int, length: int = 6 * BLOCK) -> list[int]:
    """A conversation's prompt at a turn: the previous turns' tokens plus new ones."""
    return [100 + (i % 1500) for i in range(length * turn)]


def test_a_non_last_turn_is_pinned_and_its_next_turn_hits(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    engine = engines(continuum)
    engine.add("t1", context(1), job="agent", last=False)
    started_s = time.monotonic()
    engine.drain()
    drained_s = time.monotonic() - started_s
    # The finished turn's blocks are held (not free), the request is gone from vLLM.
    assert "t1" in engine.agent.pins and "t1" not in engine.sched.requests
    assert engine.agent.pins["t1"].confirmed, "the daemon confirmed the provisional pin"
    pinned = len(engine.agent.pins["t1"].blocks)
    assert engine.free() == engine.start_free - pinned
    # Held provisionally from the finish to the daemon's PIN: counted once, for the
    # report carries it to the daemon's kvtether_engine_provisional_block_seconds_total.
    provisional = engine.agent.counters.provisional_block_seconds
    assert 0 < provisional <= pinned * drained_s

    engine.add("t2", context(2), job="agent", last=True)
    engine.drain()
    assert engine.cached_tokens["t2"] >= 6 * BLOCK - BLOCK, "turn 2 reused turn 1's KV"
    # The last step is not pinned and its finish released the job's older pin.
    assert not engine.agent.pins
    assert engine.free() == engine.start_free


def test_fcfs_never_pins(engines: MakeEngine, fcfs: DaemonProcess) -> None:
    engine = engines(fcfs)
    engine.add("warm", [1, 2, 3], job="warmup", last=True)  # learn the policy
    engine.drain()
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    assert not engine.agent.pins and engine.free() == engine.start_free
    assert engine.agent.counters.provisional_block_seconds == 0, "nothing held provisionally"


def test_the_daemon_exports_how_late_the_engines_decisions_landed(engines: MakeEngine) -> None:
    # An operator reads on /metrics how many steps after its report the engine applied
    # each answer: the histogram the engine keeps, as its last report carried it.
    from tests.integration.test_metrics import scrape

    with running_daemon("--policy", "continuum") as daemon:
        engine = engines(daemon)
        sent = _reports_as_sent(engine)
        for turn in (1, 2):
            engine.add(f"t{turn}", context(turn), job="agent", last=turn == 2)
            engine.drain()
        wait_until(lambda: bool(sent) and sent[-1].seq == engine.agent.seq)
        reported = list(sent[-1].counters.answers_by_lag_steps)
        name, engine_id = "kvtether_engine_answer_lag_steps", engine.agent.settings.engine_id
        bounds = [f"{lag}.0" for lag in range(len(reported) - 1)] + ["+Inf"]

        def exported() -> list[float]:
            """The histogram's buckets, back to answers per lag."""
            samples = scrape(daemon.metrics_port).get(name, ("", {}))[1]
            cumulative = [samples.get((f"{name}_bucket", ("engine_id", engine_id), ("le", le)),
                                      -1.0) for le in bounds]
            return [now - below for now, below in zip(cumulative, [0.0, *cumulative[:-1]],
                                                      strict=True)]

        wait_until(lambda: exported() == reported)  # once the daemon decided that report
        waits = sent[-1].counters.idle_waits
        waits_name = "kvtether_engine_idle_waits"
        wait_until(lambda: scrape(daemon.metrics_port).get(waits_name, ("", {}))[1].get(
            (f"{waits_name}_total", ("engine_id", engine_id))) == waits)
    assert len(reported) == 8
    # Applied at the next schedule() (lag 1) or, when the engine went idle, waited for
    # and applied in the same step (lag 0); the engine applied every answer it counted.
    assert sum(reported) > 0 and sum(reported[:2]) >= sum(reported) / 2, reported
    assert sum(reported) <= sum(engine.agent.lag_counts)
    # Each drain ended with the engine idle, waiting for the answer to its last report:
    # a responsive daemon answered every wait, each answer applied 0 steps late.
    counters = engine.agent.counters
    assert counters.idle_waits >= 2 and counters.idle_waits_missed == 0
    assert engine.agent.lag_counts[0] >= counters.idle_waits


def test_pin_survives_a_flood_that_evicts_unpinned_context(
        engines: MakeEngine, continuum: DaemonProcess, fcfs: DaemonProcess) -> None:
    hits = {}
    for name, daemon in (("continuum", continuum), ("fcfs", fcfs)):
        engine = engines(daemon, num_blocks=40)
        engine.add("warm", [1, 2, 3], job="warmup", last=True)
        engine.drain()
        engine.add("t1", context(1, 10 * BLOCK), job="agent", last=False)
        engine.drain()
        # Unrelated requests, several at a time, fill the cache and evict whatever is
        # free (with more than one running, Continuum keeps its pins).
        for i in range(12):
            engine.add(f"flood-{i}", [2000 - i] + [1700 + i] * (3 * BLOCK), job=None,
                       last=True)
        engine.drain()
        engine.add("t2", context(2, 10 * BLOCK), job="agent", last=True)
        engine.drain()
        hits[name] = engine.cached_tokens["t2"]
        assert not engine.agent.pins and engine.free() == engine.start_free, name
    assert hits["continuum"] >= 9 * BLOCK
    assert hits["fcfs"] < hits["continuum"]


def test_job_level_fcfs_admits_an_old_jobs_next_turn_first(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    engine = engines(continuum, num_blocks=24)
    engine.add("old-1", context(1, 4 * BLOCK), job="old", last=False)
    engine.drain()
    # A long request occupies the engine while a new job and the old job's turn 2 queue.
    engine.add("hog", [1900] * (14 * BLOCK), job=None, last=True, max_tokens=40)
    engine.step()
    engine.add("new-1", [1800] * (8 * BLOCK), job="new", last=True)
    time.sleep(0.01)
    engine.add("old-2", context(2, 4 * BLOCK), job="old", last=True)
    order = engine.drain()
    assert order.index("old-2") < order.index("new-1"), order
    assert engine.free() == engine.start_free


def test_waiting_demand_counts_a_shared_prefix_once_and_running_blocks_not_at_all(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    # Counted as each report is built: what is asked below is the queue of this instant.
    engine = engines(adaptive, num_blocks=64, WAITING_DEMAND_THREAD="engine")
    demand = engine.agent.waiting_demand
    prefix = [700 + i for i in range(4 * BLOCK)]
    # A running request holds the 4-block prefix (prefilled and cached, still decoding).
    engine.add("runner", [*prefix, 1], job=None, last=True, max_tokens=200)
    engine.step()
    assert [r.request_id for r in engine.sched.running] == ["runner"]
    # Two requests wait with that prefix and 2 full blocks and 5 tokens of their own.
    for name, base in (("w1", 1000), ("w2", 1200)):
        engine.add(name, prefix + [base + i for i in range(2 * BLOCK + 5)], job=None, last=True)
    # Each needs its own 2 full blocks and a partial one; the prefix is in use.
    assert demand.count() == 2 * 3
    # The next report carries it.
    kv = engine.agent.reports.with_demand(engine.agent.reports.kv())
    assert kv.HasField("waiting_demand_blocks") and kv.waiting_demand_blocks == 2 * 3
    # A third waiting request repeats w1's prompt: the blocks w1 takes first serve it
    # too, but for the partial last block each request writes its own. (Summed request
    # by request, the queue wants 3 x 7 blocks.)
    engine.add("w3", prefix + [1000 + i for i in range(2 * BLOCK + 5)], job=None, last=True)
    assert demand.count() == 2 * 3 + 1
    engine.drain()
    assert engine.free() == engine.start_free
    # Finished, the prefix sits cached in the free pool: admission takes those blocks
    # out of it again, so a request that hits them still counts them.
    engine.add("again", [*prefix, 1], job=None, last=True)
    assert demand.count() == 5
    engine.drain()


def fresh_job(name: str) -> str:
    """A job id no earlier test on the shared daemon used: the daemon remembers jobs,
    and adaptive orders a job's turns by its age."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("policy, reads", [("fcfs", False), ("adaptive", True)])
def test_the_waiting_demand_is_counted_only_for_a_policy_that_reads_it(
        engines: MakeEngine, request: pytest.FixtureRequest, policy: str, reads: bool) -> None:
    engine = engines(request.getfixturevalue(policy), num_blocks=20, WAITING_DEMAND_MS="0")
    counts: list[int] = []
    count = engine.agent.waiting_demand.count

    def counted() -> int:
        counts.append(count())
        return counts[-1]

    engine.agent.waiting_demand.count = counted
    engine.add("hog", [1900] * (12 * BLOCK), job=None, last=True, max_tokens=40)
    for name in ("w1", "w2"):  # 8 blocks each: they wait on the hog's 13-15 of 19
        engine.add(name, [300 + i for i in range(8 * BLOCK)], job=fresh_job(name), last=True)
    for _ in range(6):
        engine.step()
    assert len(engine.sched.waiting) == 2
    kv = engine.agent.reports.with_demand(engine.agent.reports.kv())
    if reads:
        assert counts[-1] == 8 and len(counts) >= 2, "counted for the reports"
        assert kv.waiting_demand_blocks == 8, "one shared prompt of 8 blocks"
    else:
        # The first report's, before the daemon's first decision said no; nothing of
        # it is kept.
        assert len(counts) == 1
        assert not kv.HasField("waiting_demand_blocks")
        assert len(engine.agent.waiting_demand._chains) == 0
    engine.drain()


def _reports_as_sent(engine: Engine) -> list[Any]:
    """The reports the engine sends, as they go out (after the link's thread has
    finished them)."""
    sent: list[Any] = []
    send = engine.agent.link.send

    def record(report: Any, finish: Any = None) -> bool:
        def finished(report: Any) -> None:
            try:
                if finish is not None:
                    finish(report)
            finally:  # a finish that raises: the report goes out all the same
                sent.append(report)

        return bool(send(report, finished))

    engine.agent.link.send = record
    return sent


def test_the_link_thread_counts_the_waiting_demand_off_the_engine_thread(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    import threading

    engine = engines(adaptive, num_blocks=20, WAITING_DEMAND_MS="0")
    demand = engine.agent.waiting_demand
    counted_on: list[str] = []
    count = demand.count

    def counted() -> int:
        counted_on.append(threading.current_thread().name)
        return count()

    demand.count = counted
    sent = _reports_as_sent(engine)
    engine.add("hog", [1900] * (12 * BLOCK), job=None, last=True, max_tokens=40)
    for name in ("w1", "w2"):  # 8 blocks each: they wait on the hog's 13-15 of 19
        engine.add(name, [300 + i for i in range(8 * BLOCK)], job=fresh_job(name), last=True)
    for _ in range(6):
        engine.step()
    wait_until(lambda: bool(sent) and sent[-1].seq == engine.agent.seq)
    assert len(engine.sched.waiting) == 2
    assert counted_on and threading.main_thread().name not in counted_on, counted_on
    last = sent[-1].kv
    assert last.HasField("waiting_demand_blocks") and last.waiting_demand_blocks == 8, (
        "one shared prompt of 8 blocks, counted by the link's thread")
    engine.drain()
    assert engine.free() == engine.start_free


def test_a_count_that_fails_on_the_link_thread_costs_that_report_its_count_only(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    # A count racing the engine thread's changes can raise (a vLLM dict changed size
    # under it): the report goes out without the count, the stream stays up, and the
    # next count starts afresh.
    engine = engines(adaptive, num_blocks=20, WAITING_DEMAND_MS="0")
    demand = engine.agent.waiting_demand
    count = demand.count
    failures = [RuntimeError("dictionary changed size during iteration")]

    def racing() -> int:
        if failures:
            raise failures.pop()
        return count()

    demand.count = racing
    sent = _reports_as_sent(engine)
    engine.add("hog", [1900] * (12 * BLOCK), job=None, last=True, max_tokens=40)
    for name in ("w1", "w2"):
        engine.add(name, [300 + i for i in range(8 * BLOCK)], job=fresh_job(name), last=True)
    for _ in range(6):
        engine.step()
    wait_until(lambda: bool(sent) and sent[-1].seq == engine.agent.seq)
    assert engine.agent.link.finish_errors == 1 and engine.agent.link.connected
    assert len(sent[0].new_requests) == 3, "the first report: the three requests"
    assert not sent[0].kv.HasField("waiting_demand_blocks"), "the report that raced"
    assert sent[-1].kv.waiting_demand_blocks == 8, "counted again at the next report"
    assert engine.agent.counters.fallback_steps == 0, "the engine stayed on the daemon's policy"
    engine.drain()
    assert engine.free() == engine.start_free


def test_the_link_thread_counts_while_the_engine_thread_changes_the_queue(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    # Agent turns sharing prefixes arrive, wait, run and finish while every report is
    # counted on the link's thread: the engine never fails, every request completes,
    # nothing leaks, and the counts stay within what the queue could want.
    import random

    engine = engines(adaptive, num_blocks=40, WAITING_DEMAND_MS="0")
    sent = _reports_as_sent(engine)
    rng = random.Random(7)
    scripts = [[rng.randrange(2, 2000) for _ in range(6 * BLOCK)] for _ in range(4)]
    for index in range(60):
        script = rng.choice(scripts)
        tail = [rng.randrange(2, 2000) for _ in range(rng.randrange(1, 3 * BLOCK))]
        engine.add(f"r{index}", script[: rng.randrange(BLOCK, 6 * BLOCK)] + tail,
                   job=f"job{index % 9}", last=True, max_tokens=rng.randrange(1, 12))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    engine.drain()
    wait_until(lambda: bool(sent) and sent[-1].seq == engine.agent.seq)
    counts = [r.kv.waiting_demand_blocks for r in sent if r.kv.HasField("waiting_demand_blocks")]
    assert len(counts) > 20, "counted on the reports"
    assert all(0 <= blocks <= 60 * 9 for blocks in counts), "at most every waiting block"
    assert engine.agent.link.connected
    assert engine.free() == engine.start_free


def test_waiting_demand_is_recounted_at_most_every_interval(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    engine = engines(adaptive, num_blocks=64, WAITING_DEMAND_MS="50",
                     WAITING_DEMAND_THREAD="engine")
    demand = engine.agent.waiting_demand
    assert demand.blocks(100.0) == 0, "nothing waits"
    engine.add("a", [300 + i for i in range(2 * BLOCK)], job=None, last=True)
    assert demand.blocks(100.001) == 2, "the first request to wait is counted at once"
    engine.add("b", [500 + i for i in range(3 * BLOCK)], job=None, last=True)
    assert demand.blocks(100.02) == 2, "within the interval the last count stands"
    assert demand.blocks(100.06) == 5
    assert demand.blocks(99.0) == 5, "a clock that went back recounts"
    engine.drain()
    assert demand.blocks(100.07) == 0


def test_an_idle_engine_does_not_wait_on_pins(engines: MakeEngine) -> None:
    # The daemon is gone (as it is, for a round trip, on a live engine): nothing runs
    # and the pins leave too little free for the first waiting request. The engine
    # releases them itself, one a step, instead of idling until their local bound.
    with running_daemon("--policy", "continuum") as daemon:
        engine = engines(daemon, num_blocks=24)
        for job in ("a", "b"):
            engine.add(f"{job}-1", [ord(job), *context(1, 8 * BLOCK)[1:]], job=job,
                       last=False)
            engine.drain()
        assert sorted(engine.agent.pins) == ["a-1", "b-1"], "two jobs in a tool, pinned"
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(timeout=10)
        wait_until(lambda: not engine.agent.link.connected)
        engine.add("c-1", [1800 + i for i in range(12 * BLOCK)], job="c", last=True)
        assert engine.free() < 12
        for _ in range(3):
            engine.step()
        assert "c-1" in engine.cached_tokens, "admitted within 3 steps"
        # One pin gave way (first in the daemon's last pressure order); the other
        # still serves its job.
        assert engine.agent.counters.idle_pin_releases == 1
        assert len(engine.agent.pins) == 1
        kept = next(iter(engine.agent.pins.values())).job_id
        engine.add(f"{kept}-2", [ord(kept), *context(2, 8 * BLOCK)[1:]], job=kept, last=True)
        engine.drain()
        assert engine.cached_tokens[f"{kept}-2"] >= 8 * BLOCK, "the kept pin served its job"
        assert not engine.agent.pins and engine.free() == engine.start_free


@pytest.fixture(scope="module")
def continuum_long_ttl() -> Iterator[DaemonProcess]:
    # Pins outlive any test's steps: what releases them is the test's point.
    with running_daemon("--policy", "continuum", "--param", "fixed_ttl_s=60") as daemon:
        yield daemon


def test_a_pin_gives_way_before_vllm_preempts_a_running_request(
        engines: MakeEngine, continuum_long_ttl: DaemonProcess) -> None:
    # The daemon releases pins itself once the free blocks run out, a step later. A
    # block that fails before its answer lands (a frozen daemon here; on a GPU, the
    # answer one step behind) releases the first pin of the daemon's last pressure
    # order on the spot, instead of vLLM preempting the running request.
    engine = engines(continuum_long_ttl, num_blocks=24, CLOSED_WAIT_S="0.005")
    engine.add("a-1", context(1, 8 * BLOCK), job="a", last=False)
    engine.drain()
    assert list(engine.agent.pins) == ["a-1"], "the job is in a tool, its context pinned"
    gave_way: list[str] = []
    release_for = engine.agent.on_allocation_failed

    def on_allocation_failed(request: Any) -> bool:
        released = release_for(request)
        if released:
            gave_way.append(request.request_id)
        return released

    engine.agent.on_allocation_failed = on_allocation_failed
    # 6 blocks of prompt and 200 tokens of answer: 19 blocks, where the pin leaves 15.
    engine.add("grower", [1500 + i for i in range(6 * BLOCK)], job=None, last=True,
               max_tokens=200)
    while engine.free() > 2:
        engine.step()
    assert engine.agent.decisions.orders.pressure_order == ["a-1"]
    hook_on_steps = 0
    daemon = continuum_long_ttl.process
    daemon.send_signal(signal.SIGSTOP)
    try:
        while engine.sched.has_unfinished_requests():
            engine.step()
            hook_on_steps += engine.agent.allocation.hook_on
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert gave_way == ["grower"], "the pin gave way when the grower's next block failed"
    assert engine.preemptions == 0, "so vLLM preempted nothing"
    assert hook_on_steps > 0 and not engine.agent.pins
    assert engine.free() == engine.start_free


def test_the_allocation_wrapper_stays_off_while_no_allocation_can_fail(
        engines: MakeEngine, continuum_long_ttl: DaemonProcess) -> None:
    # 400 blocks: a pin of 9 and a running request leave more free blocks than a step
    # can take (its 4,096-token budget is 256 blocks), so no pin could give way.
    engine = engines(continuum_long_ttl, num_blocks=400)
    engine.add("a-1", context(1, 8 * BLOCK), job="a", last=False)
    engine.drain()
    assert list(engine.agent.pins) == ["a-1"]
    engine.add("runner", [1500 + i for i in range(6 * BLOCK)], job=None, last=True,
               max_tokens=40)
    hook_on_steps = 0
    while engine.sched.has_unfinished_requests():
        engine.step()
        assert engine.agent.decisions.orders.pressure_order == ["a-1"], "the daemon's order stands"
        hook_on_steps += engine.agent.allocation.hook_on
    assert hook_on_steps == 0
    assert "allocate_slots" not in vars(engine.sched.kv_cache_manager), "vLLM's own method"
    assert list(engine.agent.pins) == ["a-1"]
    engine.agent.release_all_pins()
    assert engine.free() == engine.start_free


def test_a_stalled_engine_reports_the_stall_once_not_every_step(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    engine = engines(continuum, num_blocks=24)
    # More blocks than the cache has: never admitted, the engine spins on it.
    engine.add("huge", [1800 + i for i in range(30 * BLOCK)], job=None, last=True)
    engine.step()
    assert engine.agent.reports.admission_stalled
    reports = engine.agent.seq
    for _ in range(50):
        engine.step()
    assert engine.agent.seq - reports <= 1, "the daemon heard of the stall once"
    engine.sched.finish_requests("huge", _finished_status("FINISHED_ABORTED"))
    engine.step()
    assert not engine.sched.has_unfinished_requests()
    assert engine.free() == engine.start_free


def _finished_status(name: str) -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus[name]


def twelve_jobs_of_two_turns(engine: Engine) -> None:
    """More than a 48-block cache holds: twelve jobs' first turns (5 blocks each),
    then their last turns (7 blocks), each wave drained."""
    for turn, blocks, last in ((1, 5, False), (2, 7, True)):
        for job in range(12):
            engine.add(f"j{job}-t{turn}", [job * 50 + i for i in range(blocks * BLOCK)],
                       job=f"j{job}", last=last, max_tokens=24)
        engine.drain()


def test_pressure_with_pins_preempts_and_leaks_nothing(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    engine = engines(continuum, num_blocks=48)
    twelve_jobs_of_two_turns(engine)
    assert engine.preemptions > 0, "the load should exceed the KV cache"
    assert not engine.agent.pins
    assert engine.free() == engine.start_free


@pytest.mark.parametrize("answers_report_with_return", [False, True])
def test_a_release_decided_before_the_job_came_back_stays_cached(
        engines: MakeEngine, continuum: DaemonProcess, answers_report_with_return: bool) -> None:
    """The daemon decides on the report it last had; its answer lands a step later.
    A release decided while the job was in its tool, landing after the job's next
    turn arrived, frees the blocks but keeps them cached above everything below the
    returned-job priority (90), for as long as the release said. The race depends on
    step timing, so the crossing answer is handed to the agent directly."""
    from sidecar.api.v1 import engine_session_pb2 as pb

    engine = engines(continuum)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    assert "t1" in engine.agent.pins
    full = [block.block_id for block in engine.agent.pins["t1"].blocks[:6]]  # hashed
    job_in_tool_seq = engine.agent.seq  # the daemon's view: the job is in its tool
    engine.add("t2", context(2), job="agent", last=True)
    engine.agent.flush()  # t2 reported: the daemon knows the job is back from here
    answered = engine.agent.seq if answers_report_with_return else job_in_tool_seq
    engine.agent.decisions.apply([pb.StepDecision(seq=answered, pins=[pb.PinDecision(
        request_id="t1", action=pb.PIN_ACTION_RELEASE, retention_priority=40,
        retention_duration_s=7.5)])])

    assert "t1" not in engine.agent.pins  # freed either way: no memory held back
    kept = [retention.entry(block_id) for block_id in full]
    if answers_report_with_return:  # decided knowing t2 waits: the daemon's word
        assert engine.agent.stale_releases_retained == 0
        assert {entry.protection for entry in kept if entry} == {Protection(40, 7.5)}
    else:  # raised for the returned job, for the duration the release named
        assert engine.agent.stale_releases_retained == 1
        assert {entry.protection for entry in kept if entry} == {Protection(90, 7.5)}
    assert all(kept), "every full block of t1 kept cached, soft"
    engine.drain()
    assert engine.cached_tokens["t2"] >= 6 * BLOCK - BLOCK, "turn 2 reused turn 1's KV"
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_adaptive_pins_while_memory_is_idle(engines: MakeEngine, adaptive: DaemonProcess) -> None:
    engine = engines(adaptive)
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    assert "t1" in engine.agent.pins and engine.agent.pins["t1"].confirmed
    engine.add("t2", context(2), job="agent", last=True)
    engine.drain()
    assert engine.cached_tokens["t2"] >= 6 * BLOCK - BLOCK, "turn 2 reused turn 1's KV"
    assert not engine.agent.pins and engine.free() == engine.start_free


@pytest.fixture(scope="module")
def adaptive_cached() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "adaptive", "--param", "provisional_cache=true") as daemon:
        yield daemon


def test_a_cached_turn_holds_nothing_until_the_daemon_pins_it(
        engines: MakeEngine, adaptive_cached: DaemonProcess) -> None:
    engine = engines(adaptive_cached)
    engine.add("warm", [1, 2, 3], job="warmup", last=True)  # learn the policy's wish
    engine.drain()
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    # Freed at the finish and kept cached; the daemon's PIN took the blocks back (an
    # engine going idle waits for that answer). Nothing was held awaiting it.
    assert engine.agent.pins["t1"].confirmed and not engine.agent.provisional.waiting
    assert engine.agent.counters.provisional_block_seconds == 0
    pinned = len(engine.agent.pins["t1"].blocks)
    assert pinned >= 5 and engine.free() == engine.start_free - pinned
    engine.add("t2", context(2), job="agent", last=True)
    engine.drain()
    assert engine.cached_tokens["t2"] >= 6 * BLOCK - BLOCK, "turn 2 reused turn 1's KV"
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_a_stale_release_of_a_cached_turn_keeps_it_for_the_returned_job(
        engines: MakeEngine, adaptive_cached: DaemonProcess) -> None:
    """A cached turn (provisional_cache) whose RELEASE was decided while its job was in
    its tool, landing after the job's next turn arrived, is lowered only to the
    returned-job priority (90), as a held pin's stale release is: the next turn hits.
    The daemon is stopped so that the turn waits cached, and the crossing answer is
    handed to the agent directly."""
    from sidecar.api.v1 import engine_session_pb2 as pb

    engine = engines(adaptive_cached)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    engine.add("warm", [1, 2, 3], job="warmup", last=True)  # learn the policy's wish
    engine.drain()
    engine.add("t1", context(1), job="agent", last=False)
    engine.step()  # admitted and answered: a turn the daemon never answered is held
    daemon = adaptive_cached.process
    daemon.send_signal(signal.SIGSTOP)
    try:
        engine.drain()
        assert "t1" in engine.agent.provisional.waiting, "cached, awaiting the word"
        blocks = [block.block_id for block in engine.agent.provisional.waiting["t1"].blocks]
        engine.agent.flush()
        job_in_tool_seq = engine.agent.seq  # the daemon's view: the job is in its tool
        engine.add("t2", context(2), job="agent", last=True)
        engine.agent.flush()  # t2 reported: the job is back from here
        engine.agent.decisions.apply([pb.StepDecision(seq=job_in_tool_seq, pins=[pb.PinDecision(
            request_id="t1", action=pb.PIN_ACTION_RELEASE, retention_priority=40,
            retention_duration_s=7.5)])])
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert "t1" not in engine.agent.provisional.waiting and "t1" not in engine.agent.pins
    assert engine.agent.stale_releases_retained == 1
    full = 6  # the prompt's full (hashed) blocks: context(1) is 6 blocks long
    assert [retention.queued_priority(block_id) for block_id in blocks[:full]] == [90] * full
    # The same retention as a held pin's stale release (the test above).
    kept = {retention.entry(block_id).protection for block_id in blocks[:full]}
    assert kept == {Protection(90, 7.5)}
    engine.drain()
    assert engine.cached_tokens["t2"] >= 6 * BLOCK - BLOCK, "turn 2 reused turn 1's KV"
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_cached_turns_under_pressure_leak_nothing(
        engines: MakeEngine, adaptive_cached: DaemonProcess) -> None:
    engine = engines(adaptive_cached, num_blocks=48)
    twelve_jobs_of_two_turns(engine)
    assert not engine.agent.pins and not engine.agent.provisional.waiting
    assert engine.free() == engine.start_free
    from vllm_plugin.provisional import SCOPE

    handle = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    owners = {entry.owner for block_id in range(48)
              if (entry := handle.entry(block_id)) is not None}
    assert SCOPE not in owners, "every provisional priority was lowered"


def test_adaptive_soft_retains_under_pressure_and_leaks_nothing(
        engines: MakeEngine, adaptive: DaemonProcess) -> None:
    engine = engines(adaptive, num_blocks=48)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    for job in range(12):
        engine.add(f"j{job}-t1", [job * 50 + i for i in range(5 * BLOCK)], job=f"j{job}",
                   last=False, max_tokens=24)
    engine.drain()
    # Twelve jobs' turn 1 do not fit at once: with others waiting, a cold-start pin
    # (P=0.5 within 2 s) does not repay its memory, so contexts are released but kept
    # cached at a retention priority instead of pinned.
    assert retention.num_retained_entries > 0
    pinned = sum(len(pin.blocks) for pin in engine.agent.pins.values())
    assert pinned < 12 * 5, "not every context was hard-pinned"
    for job in range(12):
        engine.add(f"j{job}-t2", [job * 50 + i for i in range(7 * BLOCK)], job=f"j{job}",
                   last=True, max_tokens=24)
    engine.drain()
    assert not engine.agent.pins
    assert engine.free() == engine.start_free


@pytest.mark.parametrize(("heartbeat_ms", "most_reports"), [("0", None), ("60000", 4)])
def test_held_pins_report_at_the_heartbeat_not_every_step(
        engines: MakeEngine, continuum: DaemonProcess, heartbeat_ms: str,
        most_reports: int | None) -> None:
    engine = engines(continuum, PIN_HEARTBEAT_MS=heartbeat_ms)
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    assert engine.agent.pins, "a pin is held"
    # A long answer decodes while the pin is held: 15 steps inside one KV block, so
    # nothing the daemon needs changes from step to step.
    engine.add("long", [7] * (2 * BLOCK), job=None, last=True, max_tokens=40)
    engine.step()
    engine.step()
    before = engine.agent.seq
    for _ in range(15):
        engine.step()
    reports = engine.agent.seq - before
    if most_reports is None:
        assert reports >= 15, "heartbeat 0: a report every step"
    else:
        assert reports <= most_reports, f"{reports} reports in 15 steps"
    engine.drain()


def test_daemon_killed_mid_run_fails_nothing_and_leaks_nothing(engines: MakeEngine) -> None:
    with running_daemon("--policy", "continuum") as daemon:
        engine = engines(daemon, PROVISIONAL_PIN_S="0.3", MAX_PIN_S="0.5")
        for job in range(4):
            engine.add(f"k{job}-t1", context(1), job=f"k{job}", last=False)
        engine.drain()
        assert engine.agent.pins
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(timeout=10)
        wait_until(lambda: not engine.agent.link.connected)
        for job in range(4):
            engine.add(f"k{job}-t2", context(2), job=f"k{job}", last=False)
        engine.drain()  # nothing raises, every request finishes
        assert engine.agent.counters.fallback_steps > 0
        # Native behaviour while the daemon is gone: no new pin; old ones expire locally.
        time.sleep(0.6)
        engine.add("probe", [5, 6, 7], job=None, last=True)
        engine.drain()
        assert not engine.agent.pins
        assert engine.free() == engine.start_free


class VirtualClock:
    """The twin's kind of clock: seconds from 0, moved by hand."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@contextlib.contextmanager
def paused(daemon: DaemonProcess) -> Iterator[None]:
    """The daemon stopped (its connection open): no word comes, the engine's bounds
    decide."""
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        daemon.process.send_signal(signal.SIGCONT)


def test_on_a_replaced_clock_pins_and_retention_durations_end_on_it(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    """The twin runs the engine on its own clock, from 0. Replaced, the clock reaches
    the pin table and the block pool alike: a pin's local bound and a retention
    priority's duration end when that clock passes them, not the machine's."""
    from sidecar.api.v1 import engine_session_pb2 as pb

    engine = engines(continuum, MAX_PIN_S="30", CLOSED_WAIT_S="0.2")
    clock = VirtualClock()
    engine.use_clock(clock)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    engine.add("held-t1", context(1), job="held", last=False)
    engine.add("soft-t1", [3000 + i for i in range(6 * BLOCK)], job="soft", last=False)
    engine.drain()
    assert engine.agent.pins["held-t1"].confirmed and "soft-t1" in engine.agent.pins
    soft = [block.block_id for block in engine.agent.pins["soft-t1"].blocks][:6]  # full ones
    # A policy's soft retention: priority 90 for 600 s of the engine's clock.
    engine.agent.decisions.apply([pb.StepDecision(seq=0, pins=[pb.PinDecision(
        request_id="soft-t1", action=pb.PIN_ACTION_RELEASE, retention_priority=90,
        retention_duration_s=600)])])
    assert [retention.queued_priority(block_id) for block_id in soft] == [90] * 6

    with paused(continuum):  # a confirmed pin: bounded by MAX_PIN_S from its pin
        clock.now_s = 29.0
        engine.step()
        assert "held-t1" in engine.agent.pins
        clock.now_s = 31.0
        engine.step()
        assert "held-t1" not in engine.agent.pins
        assert engine.agent.counters.local_pin_expiries == 1

    clock.now_s = 599.0
    engine.add("probe-1", [5, 6, 7], job=None, last=True)
    engine.drain()  # its allocation checks the pool's expiries
    assert [retention.queued_priority(block_id) for block_id in soft] == [90] * 6
    clock.now_s = 601.0
    engine.add("probe-2", [8, 9, 10], job=None, last=True)
    engine.drain()
    assert all(retention.entry(block_id) is None for block_id in soft), (
        "600 s of the engine's clock have passed: back to vLLM's priority")
    assert engine.free() == engine.start_free


def test_on_a_replaced_clock_a_cached_turn_ends_on_it(
        engines: MakeEngine, adaptive_cached: DaemonProcess) -> None:
    """A turn cached provisionally (adaptive with provisional_cache) waits for the
    daemon's word for PROVISIONAL_PIN_S of the engine's clock, the one replaced."""
    engine = engines(adaptive_cached, PROVISIONAL_PIN_S="2", CLOSED_WAIT_S="0.2")
    clock = VirtualClock()
    engine.use_clock(clock)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    engine.add("warm", [1, 2, 3], job="warmup", last=True)  # learn the policy's wish
    engine.drain()
    engine.add("t1", context(1), job="agent", last=False)
    engine.step()  # admitted and answered: a turn the daemon never answered is held
    with paused(adaptive_cached):
        engine.drain()
        assert "t1" in engine.agent.provisional.waiting, "cached, awaiting the word"
        cached = [block.block_id for block in engine.agent.provisional.waiting["t1"].blocks]
        clock.now_s = 1.9
        engine.step()
        assert "t1" in engine.agent.provisional.waiting
        clock.now_s = 2.1
        engine.step()
        assert "t1" not in engine.agent.provisional.waiting, "the bound passed: no word"
        assert all(retention.entry(block_id) is None for block_id in cached), (
            "lowered to vLLM's priority")
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_reset_prefix_cache_releases_pins_first(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    engine = engines(continuum)
    engine.add("t1", context(1), job="reset", last=False)
    engine.drain()
    assert engine.agent.pins
    assert engine.sched.reset_prefix_cache() is True
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_async_scheduler_variant_is_chosen_and_works(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    from vllm_plugin.scheduler import KvtetherAsyncScheduler

    engine = engines(continuum, async_scheduling=True)
    assert isinstance(engine.sched, KvtetherAsyncScheduler)
    engine.add("a1", context(1), job="async-job", last=False)
    engine.drain()
    engine.add("a2", context(2), job="async-job", last=True)
    engine.drain()
    assert engine.cached_tokens["a2"] > 0
    assert not engine.agent.pins and engine.free() == engine.start_free


def test_reports_carry_the_work_each_step_did_and_how_long_it_took(
        engines: MakeEngine, fcfs: DaemonProcess) -> None:
    engine = engines(fcfs, num_blocks=64)
    sent = _reports_as_sent(engine)
    # Three prompts sharing nothing, 4 output tokens each: every prompt token is
    # computed in a step that schedules more than one token, then 3 steps decode.
    prompts = {"a": 5 * BLOCK, "b": 7 * BLOCK, "c": 3 * BLOCK}
    for offset, (request_id, tokens) in enumerate(prompts.items()):
        engine.add(request_id, [300 + 500 * offset + i for i in range(tokens)],
                   job=None, last=True, max_tokens=4)
    steps_with_work = 0
    while engine.sched.has_unfinished_requests():
        if engine.step().total_num_scheduled_tokens:
            steps_with_work += 1
    engine.agent.flush()  # the last step's work goes with the next report
    wait_until(lambda: bool(sent) and sent[-1].seq == engine.agent.seq)
    work = [report.work for report in sent if report.HasField("work")]
    assert sum(w.prefill_tokens for w in work) == sum(prompts.values())
    assert sum(w.decode_seqs for w in work) == 3 * len(prompts)
    assert sum(w.steps for w in work) == steps_with_work
    assert all(w.busy_s > 0.0 for w in work), "every step is timed"


def test_a_request_id_the_daemon_refuses_costs_the_engine_nothing(
        engines: MakeEngine, continuum: DaemonProcess) -> None:
    # vLLM takes a client's own request_id (or X-Request-Id) of any length and content;
    # the daemon refuses a report naming one. Such a request is left to vLLM, while
    # every other request is still reported and decided on.
    engine = engines(continuum)
    engine.step()  # the session's first report: a snapshot
    snapshots = engine.agent.counters.resyncs
    for odd_id in ("x" * 300, "two\nlines"):
        engine.add(odd_id, context(1, 2 * BLOCK), job="agent-odd", last=False)
    engine.add("t1", context(1), job="agent", last=False)
    engine.drain()
    assert "t1" in engine.agent.pins and engine.agent.pins["t1"].confirmed
    assert set(engine.agent.pins) == {"t1"}, "a request the daemon never saw is not pinned"
    assert engine.agent.counters.resyncs == snapshots, "no report was refused"
    assert not engine.agent._unreported
    assert engine.free() == engine.start_free - len(engine.agent.pins["t1"].blocks)
