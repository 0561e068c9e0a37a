"""``python -m benchmarks.twin cpu``: the real-engine benchmark's setup in the twin, run
as an engineer runs it, from a committed real-engine result."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Real engine runs on older CPUs, kept as test data: they record what the twin replays.
ENGINE_RUNS = Path(__file__).resolve().parent / "data" / "engine_runs"
# Recorded before the answers' lag was.
REAL_RUN = ENGINE_RUNS / "d077e0a-epyc-noavx512-rounds12.json"
RUN_17 = ENGINE_RUNS / "5e3f9ee-epyc17-noavx512-vary-seed-rounds10.json"
RUN_19 = ENGINE_RUNS / "2398034-epyc19-noavx512-vary-seed-rounds8.json"  # its steps recorded


def _twin_cpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.twin", "cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_real_runs_setup_runs_in_the_twin_with_its_pins(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    done = _twin_cpu("--like", str(REAL_RUN), "--policies", "fcfs,adaptive", "--seeds", "1",
                     "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(REAL_RUN.read_text())
    fcfs = real["policies"]["fcfs"]
    setup = json.loads(out.read_text())["setup"]
    # The real run's engine, workload and learned costs, and its time outside vLLM.
    assert (setup["blocks"], setup["block_tokens"], setup["jobs"], setup["jobs_per_s"]) == (
        24, 128, real["workload"]["jobs"], real["workload"]["jobs_per_s"])
    assert setup["prefill_s_per_token"] == fcfs["learned_prefill_s_per_token"]
    assert setup["step_s"] == fcfs["learned_step_s"]
    # vLLM's e2e holds the request's wait in the API server; the scheduler's phases not.
    phases = fcfs["vllm_mean_s"]
    assert abs(setup["gap_s"] - (fcfs["client_request_mean_s"] - phases["queue"]
                                 - phases["prefill"] - phases["decode"])) < 1e-9
    figures = json.loads(out.read_text())["policies"]
    # That time is the API server's: its work a request fitted so that the requests,
    # slowed while the engine computes, take it on their way on average.
    assert setup["api_delay_s"] < setup["gap_s"]
    assert abs(figures["fcfs"][0]["api_s"] / setup["gap_s"] - 1) < 0.05, (
        figures["fcfs"][0]["api_s"], setup["gap_s"])
    assert set(figures) == {"fcfs", "adaptive"}
    assert figures["fcfs"][0]["pinned_blocks_avg"] == 0
    assert figures["adaptive"][0]["pinned_blocks_avg"] > 0, "adaptive pinned nothing"
    for name in ("fcfs", "adaptive"):
        assert figures[name][0]["avg_duration_s"] > 0
        assert f"\n{name} " in done.stdout, done.stdout
    assert "1 seeds" in done.stdout
    # Its steps are linear in the prompt tokens: the daemon learns the model's figure.
    for name in ("fcfs", "adaptive"):
        learned = figures[name][0]["learned_prefill_s_per_token"]
        assert abs(learned / setup["prefill_s_per_token"] - 1) < 0.05, (name, learned)


def test_attention_priced_apart_is_learned_into_the_prompt_token(tmp_path: Path) -> None:
    # The CPU engine's fit (benchmarks/engine/attention.py): a prompt token's own cost
    # and attention's per query-key pair. The daemon's linear fit averages the pairs in.
    out = tmp_path / "cpu.json"
    done = _twin_cpu("--like", str(REAL_RUN), "--policies", "fcfs", "--seeds", "1",
                     "--prefill-s-per-token", "1.5e-5", "--attention-s-per-pair", "9.5e-8",
                     "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["setup"]["attention_s_per_pair"] == 9.5e-8
    assert "9.50e-08 s an attention pair" in done.stdout
    # Contexts of hundreds of tokens: attention is most of a prompt token's cost.
    assert result["policies"]["fcfs"][0]["learned_prefill_s_per_token"] > 3 * 1.5e-5


def test_a_file_that_is_not_an_engine_result_is_named(tmp_path: Path) -> None:
    bogus = tmp_path / "twin-point.json"
    bogus.write_text(json.dumps({"policy": "fcfs"}))
    done = _twin_cpu("--like", str(bogus), "--seeds", "1")
    assert done.returncode != 0
    assert str(bogus) in done.stderr and "not an engine benchmark result" in done.stderr


def test_an_unknown_policy_is_named() -> None:
    done = _twin_cpu("--policies", "fcfs,lifo", "--seeds", "1")
    assert done.returncode != 0
    assert "'lifo'" in done.stderr


def test_a_negative_attention_cost_is_named() -> None:
    done = _twin_cpu("--attention-s-per-pair=-1e-8", "--seeds", "1")
    assert done.returncode != 0
    assert "--attention-s-per-pair: -1e-08 must be >= 0" in done.stderr


def test_drawn_lags_replay_the_engines_reports_and_its_stale_steps(tmp_path: Path) -> None:
    # The run recorded its steps: the lags are fitted with reports on the run's share
    # of the steps and to its fallback share, and the twin reports pins as the engine
    # does (the plugin's 100 ms heartbeat), not every step.
    out = tmp_path / "cpu.json"
    done = _twin_cpu("--like", str(RUN_19), "--policies", "adaptive", "--seeds", "1",
                     "--answer-lag-drawn", "--answer-lag-tail-steps", "24", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    adaptive = json.loads(RUN_19.read_text())["policies"]["adaptive"]
    # This run does not count idle waits apart: its answers 0 steps late are the
    # plugin's idle waits, which land at once in the twin; the rest are drawn.
    waits = adaptive["answers_by_lag_steps"]["0"]
    report_share = (adaptive["daemon_reports"] - waits) / adaptive["engine_steps"]
    assert f"reports on {report_share:.0%} of the steps and idle waits on" in done.stdout, \
        done.stdout
    assert "pins re-reported every 100 ms" in done.stdout
    # The fit places the idle waits at the rate the twin's engine has them, measured
    # on a first run of each policy.
    measured = re.search(r"adaptive: the twin's engine waited for its answers on "
                         r"([0-9.]+)% of its steps", done.stderr)
    assert measured is not None, done.stderr[-2000:]
    twin_share = float(measured.group(1)) / 100
    assert f"idle waits on {twin_share:.0%}," in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert result["setup"]["pin_heartbeat_ms"] == 100.0
    twin = result["policies"]["adaptive"][0]
    # Fitted as one report a step, the twin left 9-13% of its steps without a fresh
    # answer where this engine left 34-41%.
    assert twin["fallback_steps"] / twin["steps"] > 0.2, done.stdout


def test_a_negative_pin_heartbeat_is_named() -> None:
    done = _twin_cpu("--pin-heartbeat-ms=-5", "--seeds", "1")
    assert done.returncode != 0
    assert "--pin-heartbeat-ms: -5.0 must be >= 0" in done.stderr


def test_a_negative_answer_lag_is_named() -> None:
    done = _twin_cpu("--answer-lag-steps", "-1", "--seeds", "1")
    assert done.returncode != 0
    assert "--answer-lag-steps: -1 must be >= 0" in done.stderr


@pytest.mark.parametrize(("args", "named"), [
    (("--answer-lag-drawn",), "--answer-lag-drawn: needs --like with a run that recorded"),
    (("--like", str(REAL_RUN), "--answer-lag-drawn"),
     "--answer-lag-drawn: needs --like with a run that recorded"),
    (("--like", str(RUN_17), "--answer-lag-drawn", "--answer-lag-steps", "2"),
     "--answer-lag-drawn: draws every answer's lag; drop --answer-lag-steps"),
    (("--answer-lag-tail-steps", "3"), "--answer-lag-tail-steps: only with --answer-lag-drawn"),
    (("--like", str(RUN_17), "--answer-lag-drawn", "--answer-lag-tail-steps=-1"),
     "--answer-lag-tail-steps: -1.0 must be >= 0"),
])
def test_a_lag_that_cannot_be_drawn_is_named(args: tuple[str, ...], named: str) -> None:
    done = _twin_cpu(*args, "--seeds", "1")
    assert done.returncode != 0
    assert named in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(("args", "named"), [
    (("--seeds", "0"), "--seeds: 0 must be >= 1"),
    (("--api-busy-rate", "0"), "--api-busy-rate: 0.0 must be in (0, 1]"),
    (("--api-busy-rate", "1.5"), "--api-busy-rate: 1.5 must be in (0, 1]"),
    (("--gap-s=-0.1",), "--gap-s: -0.1 must be >= 0"),
])
def test_a_bad_cpu_setup_is_named(args: tuple[str, ...], named: str) -> None:
    done = _twin_cpu(*args, "--policies", "fcfs")
    assert done.returncode != 0
    assert named in done.stderr, done.stderr[-2000:]


RUN_21 = ENGINE_RUNS / "18de9e7-epyc21-zen5-idle-waits-rounds4.json"  # its idle waits recorded


def test_the_twin_steps_once_more_after_the_last_finish_as_vllm_does() -> None:
    # vLLM's engine core steps while finished requests are not yet returned: one empty
    # step after the last one finishes, at which the plugin, idle, reports the pin it
    # was answered and waits again. Without it the twin's engine waits for the daemon
    # far less often than the recorded engine's continuum does.
    from dataclasses import replace

    from benchmarks.twin.cpu import CpuSetup, run_policy

    setup = replace(CpuSetup.like(RUN_21), draw_answer_lag=True, pin_heartbeat_ms=100.0)
    like_vllm = run_policy(setup, "continuum", seed=0)
    unfinished_only = run_policy(replace(setup, step_to_return_finished=False), "continuum",
                                 seed=0)
    assert like_vllm["steps"] > unfinished_only["steps"]
    assert like_vllm["idle_waits"] > 1.15 * unfinished_only["idle_waits"], (
        like_vllm["idle_waits"], unfinished_only["idle_waits"])
    engine = json.loads(RUN_21.read_text())["policies"]["continuum"]
    assert unfinished_only["idle_waits"] < like_vllm["idle_waits"] < engine["idle_waits"]


def test_requests_slowed_on_their_way_leave_the_twin_idle_as_often_as_the_engine() -> None:
    # The CPU engine's API server shares the two cores with the engine core: requests
    # sent while it computes reach it mostly once it is idle (benchmarks/twin/
    # frontend.py), so it goes idle after more of its turns than requests arriving
    # independently of it would leave it. With the time outside vLLM a fixed delay
    # before each request, the twin's FCFS goes idle clearly less often than the
    # recorded engine's.
    from dataclasses import replace
    from statistics import mean

    from benchmarks.twin.cpu import CpuSetup, run_policy, with_api_delay

    setup = replace(CpuSetup.like(RUN_21), draw_answer_lag=True, pin_heartbeat_ms=100.0)
    engine_waits = json.loads(RUN_21.read_text())["policies"]["fcfs"]["idle_waits"]
    seeds = (0, 1)
    slowed = with_api_delay(setup, seeds)
    fixed = replace(setup, api_busy_rate=1.0, api_delay_s=setup.gap_s)
    slowed_waits = mean(run_policy(slowed, "fcfs", seed)["idle_waits"] for seed in seeds)
    fixed_waits = mean(run_policy(fixed, "fcfs", seed)["idle_waits"] for seed in seeds)
    assert fixed_waits < 0.9 * engine_waits, (fixed_waits, engine_waits)
    assert abs(slowed_waits / engine_waits - 1) < 0.1, (slowed_waits, engine_waits)
