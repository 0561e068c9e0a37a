"""vLLM's KV hint envelope on a real vLLM engine (CPU build), driven in process as an
orchestrator drives it: ``AsyncLLM.generate(..., kv_hints=...)`` with the kvtether
plugin and a daemon (continuum, pins held 30 s).

Two callers. One sends kvtether's own ``kvtether.job`` action: its job shows in
Inspect/GetJob with its turns, the pin keeps its context through a tool gap while
unrelated requests flood the cache (cached tokens on the next turn), and its KV is
freed right after the last step, long before the pin would run out. The other passes
what NVIDIA Dynamo's vLLM worker passes (token ids, a negated priority, ``session_id``,
Dynamo's ``kv.retain`` / ``kv.evict`` actions): its session shows as a job, the
retained context survives a flood, and after the session's close (``kv.evict``) the
same flood evicts it. A malformed action and actions of unknown types never fail a
request.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc
from tests.support.daemon import DaemonController
from tests.support.engine import tiny_model_dir
from vllm_plugin import SCHEDULER_CLS

NUM_BLOCKS = 32
BLOCK_TOKENS = 128  # the CPU backend's block size
PIN_TTL_S = 30
# Freed "right after": well under the pin's TTL, with room for a loaded machine.
RELEASE_WITHIN_S = 5.0


class Engine:
    """An in-process AsyncLLM with the plugin, on one event loop for the whole module."""

    def __init__(self, runner: asyncio.Runner) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        self.runner = runner
        self.kv_usage = 0.0
        owner = self

        class KvUsage(StatLoggerBase):
            """vLLM's own KV usage, as each step reports it."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    owner.kv_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        args = AsyncEngineArgs(
            model=str(tiny_model_dir()), load_format="dummy", enforce_eager=True,
            dtype="float32", max_model_len=2048, num_gpu_blocks_override=NUM_BLOCKS,
            gpu_memory_utilization=0.3, enable_prefix_caching=True,
            scheduling_policy="priority", scheduler_cls=SCHEDULER_CLS)
        self.llm = runner.run(self._start(AsyncLLM, args, KvUsage))

    @staticmethod
    async def _start(async_llm: Any, args: Any, logger: Any) -> Any:
        return async_llm.from_engine_args(args, stat_loggers=[logger])

    def generate(self, prompt: Any, max_tokens: int = 16, **kwargs: Any) -> Any:
        """One request to its end; the final RequestOutput."""
        from vllm import SamplingParams

        async def run() -> Any:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
            final = None
            async for output in self.llm.generate(prompt, params, uuid.uuid4().hex,
                                                  **kwargs):
                final = output
            return final

        return self.runner.run(run())

    def flood(self, tag: str, count: int = 16, words: int = 220) -> None:
        """Unrelated concurrent requests that need more KV than is free."""
        from vllm import SamplingParams

        async def one(index: int) -> None:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            async for _ in self.llm.generate(f"{tag}-{index} " + f"w{index} " * words,
                                             params, f"{tag}-{index}"):
                pass

        async def run() -> None:
            await asyncio.gather(*(one(index) for index in range(count)))

        self.runner.run(run())

    def kv_held(self, timeout_s: float = 3.0) -> float:
        """KV usage once the finishing step's stats arrived (they may come just after
        the request's last output)."""
        deadline = time.monotonic() + timeout_s
        while self.kv_usage == 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.kv_usage

    def kv_after_release(self) -> float:
        """KV usage once the engine has stepped (a one-token tick makes an idle engine
        step and report), within RELEASE_WITHIN_S."""
        deadline = time.monotonic() + RELEASE_WITHIN_S
        while self.kv_usage != 0.0 and time.monotonic() < deadline:
            self.generate("tick", max_tokens=1)
            time.sleep(0.2)
        return self.kv_usage


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonController]:
    controller = DaemonController()
    controller.start("continuum", f"fixed_ttl_s={PIN_TTL_S}")
    yield controller
    controller.stop()


@pytest.fixture(scope="module")
def engine(daemon: DaemonController) -> Iterator[Engine]:
    plugin_env = {"KVTETHER_PLUGIN_DAEMON_ADDRESS": daemon.address,
                  "KVTETHER_PLUGIN_ENGINE_ID": "e2e-kv-hints",
                  "KVTETHER_PLUGIN_DEADLINE_MS": "500",
                  "KVTETHER_PLUGIN_PROVISIONAL_PIN_S": "2",
                  "KVTETHER_PLUGIN_MAX_PIN_S": str(PIN_TTL_S * 2),
                  "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                  "TOKENIZERS_PARALLELISM": "false"}
    saved = {name: os.environ.get(name) for name in plugin_env}
    os.environ.update(plugin_env)  # the engine core process inherits them
    runner = asyncio.Runner()
    engine = Engine(runner)
    try:
        yield engine
    finally:
        engine.llm.shutdown()
        runner.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def envelope(*actions: tuple[str, str, dict[str, Any]]) -> Any:
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(
        protocol_version="0.1", message_id=uuid.uuid4().hex,
        actions=[KvHintAction(action_id=f"a{index}", action_type=kind, action_version=version,
                              payload=payload)
                 for index, (kind, version, payload) in enumerate(actions)])


def get_job(daemon: DaemonController, job_id: str) -> inspect_pb2.GetJobResponse:
    with grpc.insecure_channel(daemon.address) as channel:
        return inspect_pb2_grpc.InspectStub(channel).GetJob(
            inspect_pb2.GetJobRequest(job_id=job_id), timeout=10)


def context(seed: int) -> str:
    return (f"agent {seed}: " + "You fix bugs in a repo. " * 30
            + f"task {seed}: make the failing test pass. " * 12)


def tool_output(seed: int) -> str:
    return f"\n$ pytest\nsrc/module_{seed}.py tests/test_{seed}.py " * 8


def test_kvtether_job_action_keeps_the_context_and_the_last_step_frees_it(
        engine: Engine, daemon: DaemonController) -> None:
    job_id = "hinted-job"
    prompt = context(seed=11)

    def turn(last: bool) -> Any:
        return engine.generate(prompt, kv_hints=envelope(
            ("kvtether.job", "1", {"job_id": job_id, "is_last_step": last, "tool": "pytest"}),
            ("someone.else", "3", {"ignored": True})))

    first = turn(last=False)
    assert engine.kv_held() > 0.0, "the finished turn's blocks are pinned through the tool gap"
    engine.flood("hints-flood")
    prompt += first.outputs[0].text + tool_output(seed=11)
    second = turn(last=False)
    assert second.num_cached_tokens > 0, "the pin kept the context through the flood"
    prompt += second.outputs[0].text + tool_output(seed=11)
    turn(last=True)
    print(f"kv hints e2e: job turn 2 cached {second.num_cached_tokens} tokens")
    assert engine.kv_after_release() == 0.0, "the last step frees the job's KV"

    job = get_job(daemon, job_id)
    assert job.found and job.summary.turns_finished == 3
    assert [t.prompt_tokens > 0 and t.departure_s > 0 for t in job.turns] == [True] * 3


def test_dynamo_caller_session_is_retained_and_its_close_releases_it(
        engine: Engine, daemon: DaemonController) -> None:
    from vllm.inputs import TokensPrompt

    session = "dynamo-session-1"
    # What Dynamo's vLLM worker passes: token ids, priority = -nvext.agent_hints.priority,
    # the session id, and the envelope it builds from kv_transfer_params["kv_hint"].
    retain = {"block_hashes": [], "execute_at": "request_completion",
              "include_current_request": True, "priority": 10, "ttl_seconds": 300}
    close = {"block_hashes": [], "execute_at": "request_completion",
             "include_current_request": True}
    tokens = [(7 * index) % 2000 + 20 for index in range(700)]
    full_blocks_tokens = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS

    def turn(*actions: tuple[str, str, dict[str, Any]]) -> Any:
        return engine.generate(TokensPrompt(prompt_token_ids=list(tokens)), priority=-5,
                               session_id=session, kv_hints=envelope(*actions))

    def flood_in_waves(tag: str) -> None:
        # Waves of 4 requests of ~3 blocks fit in the unprotected blocks; 6 waves cycle
        # through far more blocks than the engine has.
        for wave in range(6):
            engine.flood(f"{tag}-{wave}", count=4, words=150)

    first = turn(("kv.retain", "1.0", retain))
    flood_in_waves("dynamo-flood")
    assert engine.kv_after_release() == 0.0, "retained blocks are free blocks: nothing held"
    tokens.extend(first.outputs[0].token_ids)
    tokens.extend(range(100, 228))  # the tool's output
    second = turn(("kv.retain", "1.0", retain))
    assert second.num_cached_tokens >= full_blocks_tokens, "kv.retain kept the session"
    tokens.extend(second.outputs[0].token_ids)
    turn(("kv.evict", "1.0", close))  # the session's close
    flood_in_waves("dynamo-after-close")
    again = engine.generate(TokensPrompt(prompt_token_ids=list(tokens)), max_tokens=1)
    print(f"kv hints e2e: Dynamo turn 2 cached {second.num_cached_tokens} of "
          f"{len(second.prompt_token_ids or ())}; after the close {again.num_cached_tokens}")
    assert again.num_cached_tokens == 0, "the close released the session's blocks"

    job = get_job(daemon, session)
    assert job.found and job.summary.turns_finished == 3 and len(job.turns) == 3


def test_malformed_actions_never_fail_a_request(engine: Engine) -> None:
    # (vLLM's own transport refuses a payload that is not an object before the engine.)
    for payload in ({"job_id": ""}, {"job_id": "j", "is_last_step": "soon"}, {"job": "j"}):
        answer = engine.generate("hello there", max_tokens=4,
                                 kv_hints=envelope(("kvtether.job", "1", payload)))
        assert answer.finished and len(answer.outputs[0].token_ids) == 4
