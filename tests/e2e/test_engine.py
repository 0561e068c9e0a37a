"""The plugin on a real vLLM engine (CPU build), driven over HTTP with the OpenAI client.

Reproduces the pin verification of reference/continuum-kv-pinning-verification.txt:
KV usage rises each turn, holds through each tool gap while pinned, and drops to 0
right after the last step; the next turn hits the prefix cache because of the pin,
and under the same pressure with fcfs it does not.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Any

import grpc
import httpx
import openai

from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc
from tests.e2e.conftest import LiveEngine
from tests.support.client import AgentJob, cached_tokens
from tests.support.launch import scrape

KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"


def client(engine: LiveEngine) -> openai.OpenAI:
    # No retries: a failed request is what these tests look for. vLLM's API server
    # (uvicorn) closes a connection idle for 5 s, and a pooled connection reused just
    # as it closes fails without ever reaching vLLM; the pool lets them go first.
    pool = httpx.Limits(max_connections=100, max_keepalive_connections=20,
                        keepalive_expiry=2.0)
    return openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused", timeout=120,
                         max_retries=0, http_client=openai.DefaultHttpxClient(limits=pool))


def agent(engine: LiveEngine, job_id: str, seed: int) -> AgentJob:
    return AgentJob(client(engine), job_id, seed)


def flood(engine: LiveEngine, tag: str, count: int = 16, words: int = 220) -> None:
    """Unrelated concurrent requests that together need more KV than is free."""
    api = client(engine)

    def one(index: int) -> None:
        api.chat.completions.create(
            model="tiny", max_tokens=8, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"{tag}-{index} " + f"w{index} " * words}])

    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(one, range(count)))


def kv_usage(engine: LiveEngine) -> float:
    return scrape(engine.base_url)[KV_USAGE]


def wait_for_daemon_engine(engine: LiveEngine, timeout_s: float = 15.0) -> float:
    """Seconds until the daemon has the engine's session again. An idle engine does not
    step, so a one-token request is sent every poll to make it report (and resync)."""
    started = time.monotonic()
    api = client(engine)
    with grpc.insecure_channel(engine.daemon.address) as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        while True:
            try:
                policy = inspect.GetPolicy(inspect_pb2.GetPolicyRequest(), timeout=2)
                if engine.engine_id in policy.engines:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            assert time.monotonic() - started < timeout_s, "engine did not reconnect"
            api.completions.create(model="tiny", prompt="ping", max_tokens=1)
            time.sleep(0.05)


def drain(engine: LiveEngine, timeout_s: float = 15.0) -> None:
    """Wait until every KV block is back in the pool. A pin ends on its local bound
    (10 s at most here) at the engine's next step, so a one-token request is sent
    every poll to make it step."""
    deadline = time.monotonic() + timeout_s
    while kv_usage(engine) != 0.0:
        assert time.monotonic() < deadline, "pinned blocks leaked"
        client(engine).completions.create(model="tiny", prompt="tick", max_tokens=1)
        time.sleep(0.5)


def ensure_policy(engine: LiveEngine, policy: str, *params: str) -> None:
    daemon = engine.daemon
    if (daemon.policy, daemon.params) != (policy, params) or daemon.process is None:
        daemon.start(policy, *params)
    wait_for_daemon_engine(engine)


def test_pins_hold_kv_through_tool_gaps_and_free_it_after_the_last_step(engine: LiveEngine) -> None:
    ensure_policy(engine, "continuum")
    assert kv_usage(engine) == 0.0
    job = agent(engine, "verify-pins", seed=1)
    usages, hits = [], []
    for turn in range(5):
        last = turn == 4
        answer = job.turn(last=last)
        hits.append(cached_tokens(answer))
        usage = kv_usage(engine)
        usages.append(usage)
        if last:
            break
        # The simulated tool runs ~1 s (< Continuum's 2 s TTL): usage holds.
        for _ in range(3):
            time.sleep(0.3)
            assert kv_usage(engine) == usage, f"turn {turn + 1}: pinned blocks were freed"
    assert all(a < b for a, b in itertools.pairwise(usages[:4])), usages
    assert usages[4] == 0.0, "the last step frees the job's KV"
    assert hits[0] == 0 and all(hit > 0 for hit in hits[1:]), hits


def test_pin_keeps_context_under_a_flood_and_fcfs_does_not(engine: LiveEngine) -> None:
    hits = {}
    for policy, params in (("continuum", ("fixed_ttl_s=30",)), ("fcfs", ())):
        # A TTL longer than the flood lasts on a loaded CI machine: the comparison is
        # about what a held pin keeps, not about how long 2 s is.
        ensure_policy(engine, policy, *params)
        job = agent(engine, f"flooded-{policy}", seed=2 if policy == "continuum" else 3)
        job.turn(last=False)
        flood(engine, tag=f"flood-{policy}")
        hits[policy] = cached_tokens(job.turn(last=True))
        assert kv_usage(engine) == 0.0, policy
    assert hits["continuum"] > 0, hits
    assert hits["fcfs"] < hits["continuum"], hits


def run_jobs(engine: LiveEngine, prefix: str, jobs: int, turns: int,
             mid_run: Any = None, lockstep: bool = False,
             max_tokens: int = 160) -> list[Exception]:
    """Concurrent agent jobs; returns the failures (there must be none). ``lockstep``:
    every job sends each turn together with the others (after the slowest one's
    tool), so the turns' KV is wanted at once however fast the engine is."""
    failures: list[Exception] = []
    barrier = threading.Barrier(jobs, timeout=120) if lockstep else None

    def run(index: int) -> None:
        job = agent(engine, f"{prefix}-{index}", seed=100 + index)
        for turn in range(turns):
            try:
                if barrier is not None:
                    barrier.wait()
                job.turn(last=turn == turns - 1, max_tokens=max_tokens)
            except Exception as error:  # collected and asserted on below
                failures.append(error)
                if barrier is not None:
                    barrier.abort()  # the others stop waiting for this job
                return
            time.sleep(0.05)  # tool time

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run, index) for index in range(jobs)]
        if mid_run is not None:
            mid_run()
        for future in futures:
            future.result()
    return failures


def test_pressure_preempts_fails_nothing_and_leaks_nothing(engine: LiveEngine) -> None:
    ensure_policy(engine, "continuum")
    drain(engine)
    before = scrape(engine.base_url)
    # In lockstep: with jobs free-running, a fast engine (a step in about a
    # millisecond) serves the turns as they come and never runs out of KV. A first turn
    # is 657 prompt tokens (6 blocks), so 4 or 5 of the 10 are admitted together,
    # however the requests' arrivals spread. 400 answer tokens grow each to 9 blocks:
    # 4 x 9 = 36 > 32, so they always run out. With 160 (7 blocks) only 5 together run
    # out, and a fifth that arrives after the first four have grown is not admitted, so
    # a run may see no preemption. Two turns keep the second within the 2,048-token
    # context (about 1,700 tokens).
    failures = run_jobs(engine, "pressure", jobs=10, turns=2, lockstep=True, max_tokens=400)
    after = scrape(engine.base_url)
    assert failures == []
    assert after[PREEMPTIONS] > before[PREEMPTIONS], "the load should exceed the KV cache"
    assert after[KV_USAGE] == 0.0, "every block is back in the pool after the drain"


def test_daemon_killed_mid_run_fails_nothing_and_leaks_nothing(engine: LiveEngine) -> None:
    ensure_policy(engine, "continuum")

    def kill_then_revive() -> None:
        time.sleep(1.0)
        engine.daemon.kill()
        time.sleep(2.0)
        engine.daemon.start("continuum")

    failures = run_jobs(engine, "killed", jobs=6, turns=4, mid_run=kill_then_revive)
    assert failures == []
    # Back on policy within a second or so of the daemon's return, once the engine steps.
    assert wait_for_daemon_engine(engine) < 5.0
    # Pins made before the kill end on their local bound (10 s at most).
    drain(engine)


def test_bad_vllm_xargs_never_fail_a_request(engine: LiveEngine) -> None:
    ensure_policy(engine, "continuum")
    answer = client(engine).chat.completions.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hello"}],
        extra_body={"vllm_xargs": {"job_id": ["not", "a", "string"], "is_last_step": 7,
                                   "retention_directives": "priority 100"}})
    assert answer.choices[0].message.content is not None
    deadline = time.monotonic() + 5
    while "ignoring vllm_xargs job_id=" not in engine.log_path.read_text():
        assert time.monotonic() < deadline, "the bad field was not reported in the log"
        time.sleep(0.1)
    assert kv_usage(engine) == 0.0


def _prompt_seconds(api: openai.OpenAI, tag: str, words: int, repeats: int = 5
                    ) -> tuple[float, int]:
    """Median seconds of a one-token answer to a fresh prompt of ``words`` x "lorem ipsum" (a new
    first word each time, so nothing is cached), and the prompt's tokens."""
    timings, tokens = [], 0
    for index in range(repeats):
        started = time.perf_counter()
        answer = api.completions.create(model="tiny", max_tokens=1,
                                        prompt=f"{tag}{index} " + "lorem ipsum " * words)
        timings.append(time.perf_counter() - started)
        tokens = answer.usage.prompt_tokens
    return sorted(timings)[len(timings) // 2], tokens


def test_the_daemon_learns_what_a_prompt_token_costs_on_this_engine(engine: LiveEngine) -> None:
    ensure_policy(engine, "adaptive")
    api = client(engine)
    # Work of varied shapes: prompts of ~50-1,250 tokens, a few answering at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(lambda i: api.completions.create(
            model="tiny", max_tokens=1 + i % 12, extra_body={"ignore_eos": True},
            prompt=f"learn{i} " + "lorem ipsum " * (8 + (i * 37) % 200)), range(40)))
    with grpc.insecure_channel(engine.daemon.address) as channel:
        policy = inspect_pb2_grpc.InspectStub(channel).GetPolicy(
            inspect_pb2.GetPolicyRequest(), timeout=5)
    learned = {cost.engine_id: cost for cost in policy.engine_costs}
    assert engine.engine_id in learned, "no step cost learned from 40 requests"
    cost = learned[engine.engine_id]
    # Timed from outside as the engine benchmark does: a long prompt against a short one.
    short_s, short_tokens = _prompt_seconds(api, "short", 8)
    long_s, long_tokens = _prompt_seconds(api, "long", 250)
    outside_s = (long_s - short_s) / (long_tokens - short_tokens)
    assert outside_s / 2.5 < cost.prefill_s_per_token < outside_s * 2.5, (
        f"learned {cost.prefill_s_per_token:.3g} s a token, timed {outside_s:.3g}")
    assert cost.prefill_relative_error <= 0.2
    # The 40 requests kept the engine busy, mostly computing prompts, moments ago.
    assert cost.HasField("prefill_time_share"), "no prefill load shown for a live engine"
    assert cost.prefill_tokens_per_s > 0
    assert 0.05 < cost.prefill_time_share < 1.5, cost.prefill_time_share
