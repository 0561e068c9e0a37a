"""The twin: vLLM's real scheduler and block pool on a virtual clock, fed an agent workload.

Each iteration is one engine step, as in vLLM's EngineCore loop: requests that have
arrived are added, ``schedule()`` runs, the step-time model says how long the GPU would
take for what was scheduled, the clock moves by that much, and ``update_from_output``
gets the tokens a model would have sampled. A turn that finishes sends the job's next
turn after its tool time. With nothing to run, the clock jumps to the next arrival
(the engine sleeps); with requests but nothing schedulable (e.g. every block pinned)
it spins in ``idle_step_s`` steps, as the engine's busy loop does.

With a policy other than ``native`` the scheduler is kvtether's plugin
(``KvtetherScheduler`` on vLLM's priority policy) talking to a real ``kvtether serve``
subprocess. The plugin's agent reads the virtual clock and waits for every decision
(``KVTETHER_PLUGIN_DEADLINE_MS`` = 10 s), so the daemon decides on report times only
and a run is a deterministic function of its inputs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.twin.frontend import Arrivals, FrontEnd
from benchmarks.twin.steptime import StepTimeModel, shape_of
from benchmarks.twin.workload import STOP_TOKEN_ID, Workload, job_tokens

MODEL_DIR = Path(__file__).resolve().parent / "model" / "llama-3.1-8b"
POLICIES = ("native", "fcfs", "continuum", "contextserve", "adaptive", "llmd-ttl")
NO_FRONT_END = FrontEnd()  # a request reaches the scheduler when it is sent
_hash_ready = False  # vLLM's block-hash seed, set once per process


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM's settings for the reference setup (``vllm serve`` on one RTX 5090)."""

    num_blocks: int = 5402
    block_size: int = 16
    max_model_len: int = 4096
    # vLLM's defaults for an OpenAI server on a GPU with < 70 GiB.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # One pass of the engine loop with nothing schedulable.
    idle_step_s: float = 0.002


class VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass(slots=True)
class TurnRecord:
    job_index: int
    turn: int  # 1-based
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class Sample:
    t_s: float
    running: int
    waiting: int
    pinned_blocks: int
    pins: int
    free_blocks: int
    kv_usage: float
    jobs_in_flight: int


@dataclass(slots=True)
class SimResult:
    turns: dict[str, TurnRecord]
    job_arrival_s: list[float]
    job_finish_s: list[float | None]
    samples: list[Sample] = field(default_factory=list)
    steps: int = 0
    idle_steps: int = 0
    busy_s: float = 0.0
    end_s: float = 0.0
    preemptions: int = 0
    wall_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # Prompt tokens computed in each whole second of the clock (index: the second a
    # step ended in): what the daemon's prefill share is read from.
    prefill_tokens_by_s: list[int] = field(default_factory=list)
    plugin_counters: dict[str, int] = field(default_factory=dict)
    # KV block-seconds finished turns' blocks waited for the daemon's word on a pin.
    provisional_block_s: float = 0.0
    # The daemon's answers the plugin applied, by steps after their report (its
    # ``answers_by_lag_steps``: index k, k steps; the last bucket, that many or more).
    answers_by_lag_steps: list[int] = field(default_factory=list)
    pins_at_end: int = 0
    leaked_blocks: int = 0
    # Seconds a request took from being sent to reaching the scheduler, on average
    # (the front end's; 0 without one).
    api_s_mean: float = 0.0


@contextlib.contextmanager
def _plugin_env(address: str, pin_heartbeat_ms: float = 0.0) -> Iterator[None]:
    values = {
        "KVTETHER_PLUGIN_DAEMON_ADDRESS": address,
        "KVTETHER_PLUGIN_ENGINE_ID": "twin",
        # Wait for every decision: the run must not depend on how fast this box is.
        "KVTETHER_PLUGIN_DEADLINE_MS": "10000",
        # 0: a report every step while pins are held, the daemon re-valuing them as
        # often as the engine steps (the sweeps in benchmarks/results/twin ran this
        # way); the plugin's default (100 ms) to send as few as a CPU engine does.
        "KVTETHER_PLUGIN_PIN_HEARTBEAT_MS": f"{pin_heartbeat_ms:g}",
        # The waiting demand counted as the report is built: on the link's thread it
        # would read the queue whenever that thread got to it (the twin's steps take
        # no time), and a run would depend on this box's speed.
        "KVTETHER_PLUGIN_WAITING_DEMAND_THREAD": "engine",
        "KVTETHER_PLUGIN_FAIL_MODE": "open",
        "KVTETHER_PLUGIN_ENABLED": "1",
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _answer_every_report(agent: Any, lag_steps: int | Callable[[], int] = 0) -> None:
    """Make every decision arrive before the engine's next look at the link.

    On a GPU the plugin sends its report at the end of a step and applies the answer
    at the next ``schedule()``: the forward pass in between hides the round trip. The
    twin's steps take no real time, so the answer would land whenever this box's two
    cores get to it. Each of the agent's ``take_decisions`` calls therefore waits (up
    to the plugin's deadline, 10 s here) for the answers to everything sent: the twin
    models a daemon that always answers within one GPU step, and a run is the same
    for the same inputs, however loaded the machine is.

    ``lag_steps`` > 0 holds each answer back that many more looks at the link: the
    daemon of a real CPU engine, whose steps take a few ms, answers a step or more
    late (``benchmarks.engine`` records how many, ``answers_by_lag_steps``). A
    callable (``benchmarks.twin.lag.DrawnLag``) instead draws, for each answer, the
    steps after its report's step at which the plugin may apply it, as the engine
    counts them; answers stay in the order they came down the stream, so one held
    back holds back those after it, as a daemon waiting for a CPU does. Where the
    plugin waits for its answers (``wait_s`` > 0: the engine going idle, or failing
    closed) everything sent lands at once, the answer it waited for 0 steps late: on
    the CPU engine 99% of those waits got their answer within the 20 ms deadline (its
    ``idle_waits_missed``), an idle engine leaving the daemon the CPU."""
    link = agent.link
    take = link.take_decisions
    deadline_s = agent.settings.deadline_s
    # Fixed: (look it is released at, answers); drawn: (step it is released at, answer).
    held: deque[tuple[int, list[Any]]] = deque()
    looks = 0

    def take_decisions(wait_s: float) -> Any:
        nonlocal looks
        looks += 1
        taken = take(max(wait_s, deadline_s))
        if callable(lag_steps) and wait_s > 0:
            answers = [answer for _release, batch in held for answer in batch] + taken
            held.clear()
            return answers
        if callable(lag_steps):
            now = agent.answer_lag.step_index
            for answer in taken:
                # The step its report went out at, as the plugin counts an answer's lag
                # (not yet popped: the plugin applies what this returns).
                sent = agent.answer_lag.sent_at_step.get(answer.seq, now)
                held.append((max(sent + lag_steps(), held[-1][0] if held else 0), [answer]))
        else:
            now = looks
            if taken:
                held.append((looks + lag_steps, taken))
        answers: list[Any] = []
        while held and held[0][0] <= now:
            answers += held.popleft()[1]
        return answers

    link.take_decisions = take_decisions


def build_engine(policy: str, config: EngineConfig, clock: VirtualClock,
                 daemon_address: str | None,
                 answer_lag_steps: int | Callable[[], int] = 0,
                 pin_heartbeat_ms: float = 0.0) -> Any:
    """vLLM's Scheduler (``native``: its own FCFS policy) or kvtether's plugin scheduler
    connected to the daemon at ``daemon_address``, both on ``clock``; the daemon's
    answers applied ``answer_lag_steps`` steps later than the next one (a callable:
    drawn for each, ``benchmarks.twin.lag.DrawnLag``); while pins are held, a report
    at least every ``pin_heartbeat_ms`` of the clock (0: every step)."""
    from tests.support.scheduler import build_scheduler

    common = dict(num_blocks=config.num_blocks, block_size=config.block_size,
                  max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                  max_num_batched_tokens=config.max_num_batched_tokens)
    if policy == "native":
        return build_scheduler(MODEL_DIR, policy="fcfs", **common)
    if daemon_address is None:
        raise ValueError(f"policy {policy!r} needs a daemon")
    from vllm_plugin.scheduler import KvtetherScheduler

    with _plugin_env(daemon_address, pin_heartbeat_ms):
        scheduler = build_scheduler(MODEL_DIR, policy="priority",
                                    scheduler_cls=KvtetherScheduler, **common)
    agent = scheduler.kvtether
    agent.clock.replace(clock)  # the plugin's every part, the block pool's retention too
    # Tools are named by the client (vllm_xargs "tool"): no output to parse, and the
    # twin's model directory has no tokenizer.
    agent._decode_tail = None
    _answer_every_report(agent, answer_lag_steps)
    deadline = time.monotonic() + 30
    while not agent.link.connected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the plugin did not connect to {daemon_address}")
        time.sleep(0.01)
    return scheduler


def _make_request(request_id: str, prompt: list[int], max_tokens: int, arrival_s: float,
                  extra_args: dict[str, Any], block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        # The answer ends with the stop token (FINISHED_STOPPED) unless it hits the cap.
        sampling_params=SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN_ID],
                                       extra_args=extra_args),
        pooling_params=None,
        arrival_time=arrival_s,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def _model_output(scheduler: Any, scheduler_output: Any,
                  next_token: Callable[[Any], int]) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = []
    for request_id in ids:
        request = requests[request_id]
        sampled.append([] if request.is_prefill_chunk else [next_token(request)])
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={request_id: index for index, request_id in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def simulate(workload: Workload, scheduler: Any, step_model: StepTimeModel,
             config: EngineConfig, clock: VirtualClock, sample_every_s: float = 0.5,
             progress: Callable[[str], None] | None = None,
             step_to_return_finished: bool = False,
             front: FrontEnd = NO_FRONT_END) -> SimResult:
    """Run the workload's jobs through the scheduler on the clock, a step at a time.

    ``step_to_return_finished``: step as vLLM's engine core does, while requests are
    unfinished or finished ones are not yet returned (its ``has_requests()``): a
    request that finishes last takes one more, empty step, at which the plugin applies
    what has come and, idle, may wait again. False, the sweeps' (their points predate
    it): step only while requests are unfinished.

    ``front``: the API server a request passes on its way to the scheduler (the
    sweeps': none, a request reaches the scheduler when it is sent)."""
    started = time.perf_counter()
    has_work = (scheduler.has_requests if step_to_return_finished
                else scheduler.has_unfinished_requests)
    jobs = workload.jobs
    pool = scheduler.kv_cache_manager.block_pool
    start_free = pool.get_num_free_blocks()
    agent = getattr(scheduler, "kvtether", None)
    result = SimResult(turns={}, job_arrival_s=[j.arrival_s for j in jobs],
                       job_finish_s=[None] * len(jobs))
    tokens: dict[int, list[int]] = {}  # job index -> its tokens, while it runs
    job_of_request: dict[str, tuple[int, int]] = {}
    arrivals = Arrivals(front)  # the turns sent, on their way to the scheduler
    for index, job in enumerate(jobs):
        arrivals.send(job.arrival_s, index, 0)
    in_flight = 0
    next_sample_s = 0.0
    next_progress_s = 10.0

    def next_token(request: Any) -> int:
        job_index, _ = job_of_request[request.request_id]
        return tokens[job_index][request.num_tokens]

    while arrivals or has_work():
        for at_s, job_index, turn_index in arrivals.take_ready():
            job = jobs[job_index]
            turn = job.turns[turn_index]
            if turn_index == 0:
                tokens[job_index] = job_tokens(job, workload.max_output_tokens)
                in_flight += 1
            request_id = f"{job.job_id}-t{turn_index + 1}"
            extra: dict[str, Any] = {"job_id": job.job_id, "is_last_step": int(turn.is_last_step)}
            if turn.tool:
                extra["tool"] = turn.tool
            job_of_request[request_id] = (job_index, turn_index)
            result.turns[request_id] = TurnRecord(job_index, turn_index + 1, at_s,
                                                  turn.prompt_tokens)
            scheduler.add_request(_make_request(
                request_id, tokens[job_index][:turn.prompt_tokens], workload.max_output_tokens,
                at_s, extra, config.block_size))
        if not has_work():
            clock.now_s = arrivals.next_reach_s()  # the engine sleeps until a request
            arrivals.advance(clock.now_s, busy=False)
            continue

        output = scheduler.schedule()
        shape = shape_of(scheduler, output)
        step_s = step_model.step_s(shape)
        result.steps += 1
        if shape.empty:
            result.idle_steps += 1
            step_s = config.idle_step_s
        else:
            result.busy_s += step_s
            result.prefill_tokens += shape.prefill_tokens
            result.decode_tokens += shape.decode_seqs
            if shape.prefill_tokens:
                second = int(clock.now_s + step_s)
                by_s = result.prefill_tokens_by_s
                by_s.extend([0] * (second + 1 - len(by_s)))
                by_s[second] += shape.prefill_tokens
        for new in output.scheduled_new_reqs:
            record = result.turns[new.req_id]
            if record.cached_tokens is None:
                record.cached_tokens = int(new.num_computed_tokens)
        for request_id in output.preempted_req_ids or ():
            result.turns[request_id].preemptions += 1
            result.preemptions += 1
        clock.now_s += step_s
        arrivals.advance(clock.now_s, busy=not shape.empty)
        outputs = scheduler.update_from_output(output, _model_output(scheduler, output,
                                                                     next_token))
        now_s = clock.now_s
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                record = result.turns[out.request_id]
                if out.new_token_ids and record.first_token_s is None:
                    record.first_token_s = now_s
                record.output_tokens += len(out.new_token_ids)
                if out.finish_reason is None:
                    continue
                record.finish_s = now_s
                job_index, turn_index = job_of_request.pop(out.request_id)
                job = jobs[job_index]
                turn = job.turns[turn_index]
                if record.output_tokens != turn.output_tokens:
                    raise AssertionError(f"{out.request_id}: {record.output_tokens} output "
                                         f"tokens, the workload says {turn.output_tokens}")
                if turn.is_last_step:
                    result.job_finish_s[job_index] = now_s
                    del tokens[job_index]
                    in_flight -= 1
                else:
                    arrivals.send(now_s + turn.tool_time_s, job_index, turn_index + 1)
        if now_s >= next_sample_s:
            pins = agent.pins if agent is not None else {}
            running = len(scheduler.running)
            result.samples.append(Sample(
                t_s=round(now_s, 4), running=running,
                waiting=len(scheduler.requests) - running,
                # Distinct blocks: jobs that share a prefix pin the same blocks.
                pinned_blocks=len({b.block_id for p in pins.values() for b in p.blocks}),
                pins=len(pins),
                free_blocks=pool.get_num_free_blocks(), kv_usage=round(pool.get_usage(), 4),
                jobs_in_flight=in_flight))
            next_sample_s = now_s + sample_every_s
        if progress is not None and now_s >= next_progress_s:
            done = sum(1 for f in result.job_finish_s if f is not None)
            progress(f"t={now_s:7.1f} s  jobs done {done}/{len(jobs)}  running "
                     f"{len(scheduler.running)}  steps {result.steps}  wall "
                     f"{time.perf_counter() - started:6.1f} s")
            next_progress_s = now_s + 10.0
    result.end_s = clock.now_s
    result.api_s_mean = arrivals.front_s_total / arrivals.reached if arrivals.reached else 0.0
    if agent is not None:
        result.pins_at_end = len(agent.pins)
        counters = agent.counters
        result.plugin_counters = {name: int(getattr(counters, name)) for name in
                                  ("fallback_steps", "resyncs", "local_pin_expiries",
                                   "idle_pin_releases", "idle_waits",
                                   "idle_waits_missed")}
        result.provisional_block_s = counters.provisional_block_seconds
        result.answers_by_lag_steps = [int(n) for n in counters.answers_by_lag_steps]
        agent.release_all_pins()
    result.leaked_blocks = start_free - pool.get_num_free_blocks()
    result.wall_s = time.perf_counter() - started
    return result
