"""Protected sessions under an eviction flood, on vLLM's real scheduler and block pool.

Each mode gets a fresh copy of vLLM's real ``Scheduler`` (no model, no worker) with
the kvtether plugin, talking to one real daemon process (fcfs: no pins, so retention
alone keeps anything):

- ``none``    the sessions send no directive (vLLM's LRU);
- ``xargs``   each turn carries its session's directives (vllm_xargs
              ``retention_directives``, a JSON string as the OpenAI API delivers it);
- ``pushed``  the orchestrator pushes them once per session over gRPC (SetDirectives).

Directives: the system prompt at priority 100, the rest of the context at 80 for 45 s.
The workload, the same for every mode: ``sessions`` agent sessions of ``turns`` turns
(each turn's prompt = the previous prompt + new tokens); after each round of turns,
``flood_requests`` unrelated requests arrive in waves of ``wave`` (each wave drains
before the next). A ``moderate`` flood's waves fit in the unprotected blocks; a
``heavy`` one's do not, so it must take protected blocks too (lowest priority first).

Measured per session turn after the first: prefix-cache hit (vLLM's computed tokens
at admission / prompt tokens) and time to first token in engine steps and in modelled
time (a linear GPU step model, ``StepModel``); the flood's own TTFT too.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.common.stats import percentile

MODES = ("none", "xargs", "pushed")


@dataclass(frozen=True)
class Scenario:
    name: str
    wave: int
    sessions: int = 4
    turns: int = 5
    system_tokens: int = 256
    turn_tokens: int = 160
    flood_requests: int = 30
    flood_tokens: int = 256
    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 1024
    context_duration_s: float = 45.0


SCENARIOS = (Scenario("moderate", wave=6), Scenario("heavy", wave=22))


@dataclass(frozen=True)
class StepModel:
    """Illustrative step time of a GPU engine (roughly an 8B model on one H100-class
    GPU): a fixed cost per step, per prompt token prefilled and per decoding sequence."""

    fixed_ms: float = 8.0
    prefill_ms_per_token: float = 0.06
    decode_ms_per_seq: float = 0.1

    def step_ms(self, num_scheduled_tokens: dict[str, int]) -> float:
        prefill = sum(n for n in num_scheduled_tokens.values() if n > 1)
        decode = sum(1 for n in num_scheduled_tokens.values() if n == 1)
        return self.fixed_ms + self.prefill_ms_per_token * prefill + self.decode_ms_per_seq * decode


@dataclass
class Tracked:
    kind: str  # "session" or "flood"
    turn: int
    prompt_tokens: int
    added_step: int
    added_ms: float
    cached_tokens: int = -1
    first_token_step: int = -1
    first_token_ms: float = -1.0


@dataclass
class Run:
    scenario: Scenario
    mode: str
    model: StepModel
    sched: Any
    steps: int = 0
    clock_ms: float = 0.0
    tracked: dict[str, Tracked] = field(default_factory=dict)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, kind: str, turn: int,
            extra: dict[str, Any]) -> None:
        from tests.support.scheduler import make_request

        self.tracked[request_id] = Tracked(kind, turn, len(prompt), self.steps, self.clock_ms)
        self.sched.add_request(make_request(request_id, prompt, max_tokens,
                                            self.scenario.block_size,
                                            arrival_time=time.time(), extra_args=extra))

    def drain(self) -> None:
        from tests.support.scheduler import model_output

        while self.sched.has_unfinished_requests():
            output = self.sched.schedule()
            for new in output.scheduled_new_reqs:
                if new.req_id in self.tracked:
                    self.tracked[new.req_id].cached_tokens = new.num_computed_tokens
            engine_outputs = self.sched.update_from_output(output,
                                                           model_output(self.sched, output))
            self.steps += 1
            self.clock_ms += self.model.step_ms(output.num_scheduled_tokens)
            for outputs in engine_outputs.values():
                for item in outputs.outputs:
                    done = self.tracked.get(item.request_id)
                    if done is not None and item.new_token_ids and done.first_token_step < 0:
                        done.first_token_step = self.steps - done.added_step
                        done.first_token_ms = self.clock_ms - done.added_ms
            if self.steps > 1_000_000:
                raise RuntimeError("the engine did not drain")


def _tokens(seed: int, count: int) -> list[int]:
    return [2 + (seed * 7919 + i * 31) % 2040 for i in range(count)]


def _directives(scenario: Scenario) -> list[dict[str, Any]]:
    return [{"start": 0, "end": scenario.system_tokens, "priority": 100},
            {"start": scenario.system_tokens, "priority": 80,
             "duration": scenario.context_duration_s}]


def _push(address: str, session: str, scenario: Scenario) -> None:
    import grpc

    from sidecar.api.v1 import retention_pb2, retention_pb2_grpc

    config = retention_pb2.RetentionConfig()
    config.token_ranges.add(token_start=0, token_end=scenario.system_tokens, priority=100)
    config.token_ranges.add(token_start=scenario.system_tokens, priority=80,
                            duration_s=scenario.context_duration_s)
    with grpc.insecure_channel(address) as channel:
        retention_pb2_grpc.RetentionStub(channel).SetDirectives(
            retention_pb2.SetDirectivesRequest(
                target=retention_pb2.RetentionTarget(session_id=session), config=config,
                scope="bench-orchestrator"), timeout=10)


def run_mode(scenario: Scenario, mode: str, model_dir: Any, daemon_address: str,
             engine_id: str, step_model: StepModel) -> Run:
    from tests.support.scheduler import build_scheduler
    from vllm_plugin.scheduler import KvtetherScheduler

    sched = build_scheduler(model_dir, num_blocks=scenario.num_blocks,
                            block_size=scenario.block_size, scheduler_cls=KvtetherScheduler,
                            max_num_batched_tokens=scenario.max_num_batched_tokens)
    deadline = time.monotonic() + 20
    while not sched.kvtether.link.connected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no daemon at {daemon_address}")
        time.sleep(0.01)
    run = Run(scenario, mode, step_model, sched)
    try:
        sessions = [f"{scenario.name}-{mode}-s{index}" for index in range(scenario.sessions)]
        if mode == "pushed":
            for session in sessions:
                _push(daemon_address, session, scenario)
        flood_index = 0
        for turn in range(scenario.turns):
            for index, session in enumerate(sessions):
                system = _tokens(1000 + index, scenario.system_tokens)
                context = _tokens(2000 + index, scenario.turn_tokens * (turn + 1))
                extra: dict[str, Any] = {"job_id": session}
                if mode == "xargs":
                    extra["retention_directives"] = json.dumps(_directives(scenario))
                run.add(f"{session}-t{turn}", system + context, 16, "session", turn, extra)
            run.drain()
            for wave_start in range(0, scenario.flood_requests, scenario.wave):
                for _ in range(min(scenario.wave, scenario.flood_requests - wave_start)):
                    flood_index += 1
                    prompt = _tokens(10_000 + flood_index, scenario.flood_tokens)
                    run.add(f"flood-{flood_index}", prompt, 8, "flood", turn, {})
                run.drain()
        return run
    finally:
        sched.shutdown()


def summarize(run: Run) -> dict[str, Any]:
    later_turns = [t for t in run.tracked.values() if t.kind == "session" and t.turn > 0]
    flood = [t for t in run.tracked.values() if t.kind == "flood"]

    def ttft(items: list[Tracked]) -> dict[str, float]:
        steps = [float(t.first_token_step) for t in items]
        ms = [t.first_token_ms for t in items]
        return {"steps_mean": statistics.fmean(steps), "steps_p50": percentile(steps, 0.5),
                "steps_max": max(steps), "ms_mean": statistics.fmean(ms),
                "ms_p50": percentile(ms, 0.5), "ms_p95": percentile(ms, 0.95)}

    pool = run.sched.kv_cache_manager.block_pool
    return {
        "protected_turns": len(later_turns),
        "hit_rate": sum(t.cached_tokens for t in later_turns)
        / sum(t.prompt_tokens for t in later_turns),
        "turns_with_a_hit": sum(t.cached_tokens > 0 for t in later_turns) / len(later_turns),
        # The system prompt (priority 100) hit in full: what survives when the context
        # (priority 80) had to give way.
        "turns_hitting_the_system_prompt": sum(
            t.cached_tokens >= run.scenario.system_tokens for t in later_turns)
        / len(later_turns),
        "ttft": ttft(later_turns),
        "flood_requests": len(flood),
        "flood_ttft": ttft(flood),
        "engine_steps": run.steps,
        "modelled_makespan_ms": run.clock_ms,
        "retained_block_entries_at_end": pool.kvtether_retention.num_retained_entries,
    }


def benchmark(model_dir: Any, daemon_address: str,
              scenarios: tuple[Scenario, ...] = SCENARIOS) -> Iterator[dict[str, Any]]:
    step_model = StepModel()
    for scenario in scenarios:
        results = {}
        for mode in MODES:
            run = run_mode(scenario, mode, model_dir, daemon_address,
                           f"bench-{scenario.name}-{mode}", step_model)
            results[mode] = summarize(run)
        yield {"scenario": asdict(scenario), "step_model": asdict(step_model),
               "modes": results}
