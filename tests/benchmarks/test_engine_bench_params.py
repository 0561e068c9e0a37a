"""The real-engine benchmark tells each policy the engine's measured costs, as a user
would for their hardware: only the parameters the policy declares, valid for it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from benchmarks.engine.__main__ import (
    ProcessCpu,
    RunQueueWait,
    aggregate,
    paired_ratios,
    policy_params,
    round_seeds,
)
from benchmarks.engine.profile import summarize
from sidecar.policies.registry import build_policy, policy_parameters

MEASURED = {"prefill_s_per_token": 2.7e-5, "step_s": 0.0021}


def _as_dict(flags: list[str]) -> dict[str, str]:
    return dict(flag.split("=", 1) for flag in flags)


def test_each_policy_gets_only_the_constants_it_declares() -> None:
    # The step time is measured too, but no policy declares it.
    assert _as_dict(policy_params("adaptive", MEASURED)) == {"prefill_s_per_token": "2.7e-05"}
    assert _as_dict(policy_params("continuum", MEASURED)) == {"prefill_s_per_token": "2.7e-05"}
    assert policy_params("fcfs", MEASURED) == []
    assert policy_params("llmd-ttl", MEASURED) == []


def test_the_daemon_accepts_them_and_they_replace_the_gpu_defaults() -> None:
    policy = build_policy("adaptive", _as_dict(policy_params("adaptive", MEASURED)))
    effective = policy_parameters(policy)
    assert effective["prefill_s_per_token"] == 2.7e-5


def test_a_failed_measurement_leaves_the_defaults() -> None:
    assert policy_params("adaptive", {"prefill_s_per_token": 0.0, "step_s": 0.0021}) == []
    assert policy_params("adaptive", {}) == []


def test_paired_ratios_compare_policies_within_each_round() -> None:
    # The machine is slow in round 2 for everyone: the pairing cancels it.
    runs = {"fcfs": [{"avg_job_duration_s": 4.0}, {"avg_job_duration_s": 8.0}],
            "adaptive": [{"avg_job_duration_s": 3.6}, {"avg_job_duration_s": 7.6}]}
    paired = paired_ratios(runs, "fcfs")
    assert list(paired) == ["adaptive"]
    assert paired["adaptive"]["rounds"] == [0.9, 0.95]
    assert math.isclose(paired["adaptive"]["mean"], 0.925)
    assert math.isclose(paired["adaptive"]["stderr"], 0.025)
    assert paired_ratios({"fcfs": runs["fcfs"][:1], "adaptive": runs["adaptive"][:1]},
                         "fcfs")["adaptive"]["stderr"] == 0.0


def test_each_round_draws_its_own_jobs_only_when_asked() -> None:
    from benchmarks.twin.workload import generate

    assert round_seeds(3, 4, vary=False) == [3, 3, 3, 3]
    assert round_seeds(3, 4, vary=True) == [3, 4, 5, 6]
    # Another seed is another draw of the workload: other arrivals for the same jobs.
    first, second = (generate("reference", 1.5, seed=seed, num_jobs=24)
                     for seed in round_seeds(0, 2, vary=True))
    assert [job.arrival_s for job in first.jobs] != [job.arrival_s for job in second.jobs]


def test_rounds_are_merged_key_by_key_with_the_latency_of_each_turn() -> None:
    def round_(job_s: float, turn1_s: float, queue_s: float | None,
               client_s: float | None = 0.3) -> dict[str, object]:
        scalars = dict.fromkeys(
            ("median_job_duration_s", "p90_job_duration_s", "p95_job_duration_s",
             "prefix_cache_hit_rate", "preemptions", "kv_usage_mean", "kv_usage_max",
             "daemon_reports", "daemon_cpu_s", "learned_prefill_s_per_token",
             "learned_step_s", "decision_mean_s", "fallback_steps"), 1.0)
        return {**scalars, "avg_job_duration_s": job_s, "jobs": 2,
                "vllm_mean_s": {"queue": queue_s},
                "client_request_mean_s": client_s,
                "reports_carried": {"clock": 4.0},
                "per_turn": {"1": {"avg_latency_s": turn1_s, "avg_cached_tokens": 0},
                             "2": {"avg_latency_s": 0.5,
                                   "avg_cached_tokens": 100 * job_s}}}

    merged = aggregate([round_(4.0, 0.3, 0.1), round_(6.0, 0.5, None)])
    assert merged["avg_job_duration_s"] == 5.0
    assert merged["avg_job_duration_s_range"] == [4.0, 6.0]
    assert merged["turn_latency_s"] == {"1": 0.4, "2": 0.5}
    assert merged["turn_cached_tokens"] == {"1": 0, "2": 500.0}
    # A round without a figure (vLLM observed no request) does not drag the mean.
    assert merged["vllm_mean_s"] == {"queue": 0.1}
    assert merged["reports_carried"] == {"clock": 4.0}
    assert merged["client_request_mean_s"] == 0.3
    assert merged["engine_cpu_s"] == {}  # rounds recorded before the engine's CPU
    # A round recorded before the client's own timing: no mean rather than a partial one.
    assert aggregate([round_(4.0, 0.3, 0.1),
                      round_(6.0, 0.5, 0.1, client_s=None)])["client_request_mean_s"] is None


def test_process_cpu_counts_the_seconds_a_process_and_its_children_burn() -> None:
    # The benchmark's server is ``vllm serve``, its child the engine core: here this
    # process and a child that burns 0.3 s and then stays alive (as the core does).
    cpu = ProcessCpu(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nd = time.process_time() + 0.3\n"
                              "while time.process_time() < d: pass\n"
                              "print('burnt', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:  # this process burns 0.3 s
            pass
        burnt = cpu.delta()
    finally:
        child.communicate("")
    assert burnt["server"] >= 0.25
    assert burnt["children"] >= 0.25


def test_the_engine_core_profile_is_summed_by_component() -> None:
    # py-spy's raw format: one collapsed stack (outermost frame first) and its count.
    raw = [
        "thread (1): MainThread;EngineCore.step (vllm/v1/engine/core.py:667);"
        "KvtetherMixin.schedule (vllm_plugin/scheduler.py:160);"
        "EngineAgent.before_schedule (vllm_plugin/agent.py:150) 3\n",
        "thread (1): MainThread;MessageQueue.acquire_read (vllm/distributed/"
        "device_communicators/shm_broadcast.py:864);sched_yield (vllm/distributed/"
        "utils.py:46) 6\n",
        "thread (2): kvtether-link;DaemonLink._run (vllm_plugin/link.py:120);"
        "_consume_request_iterator (grpc/_channel.py:311) 1\n",
        "not a sample line\n",
    ]
    shares = summarize(raw)
    assert shares["samples"] == 10
    assert math.isclose(shares["plugin"], 0.4)  # the link thread's stack counts too
    assert math.isclose(shares["grpc"], 0.1)
    assert math.isclose(shares["spin"], 0.6)
    assert summarize([]) == {"samples": 0.0, "plugin": 0.0, "grpc": 0.0, "spin": 0.0}


def test_a_variant_runs_the_policy_with_a_parameter_set_after_the_constants() -> None:
    flags = policy_params("adaptive@overdue_widening=0", MEASURED)
    assert flags[-1] == "overdue_widening=0"
    assert _as_dict(flags)["prefill_s_per_token"] == "2.7e-05"
    build_policy("adaptive", _as_dict(flags))  # the daemon accepts them
    with pytest.raises(ValueError, match="'nope=1' is not KEY=VALUE for a parameter of adaptive"):
        policy_params("adaptive@nope=1", MEASURED)


def test_a_weight_for_a_daemon_sharing_the_benchmarks_session_is_refused() -> None:
    """The autogroup nice weights the daemon's own session; with the session shared it
    would weight the benchmark's client too. Refused before any engine starts."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--daemon-session", "shared",
         "--daemon-autogroup-nice", "-5"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--daemon-autogroup-nice weights the daemon's own session" in done.stderr


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="Linux schedstat")
def test_run_queue_wait_shows_which_process_waited_for_a_cpu() -> None:
    """With more busy processes than cores, the "server" (here a process that spins
    and has a spinning child, as the API server has the engine core) and its child
    both wait for a CPU, and the readings say so; the client (this process, asleep)
    waits next to nothing."""
    spin = "import time\nd = time.monotonic() + 1.5\nwhile time.monotonic() < d: pass\n"
    server = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys\n"
                               f"c = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
                               f"{spin}c.wait()\n"])
    hogs = [subprocess.Popen([sys.executable, "-c", spin])
            for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.2)  # the server has started its child
        waits = RunQueueWait(server.pid)
        time.sleep(1.0)
        waited = waits.delta()
    finally:
        for process in (server, *hogs):
            process.wait(timeout=30)
    assert set(waited) == {"api_server", "engine", "client"}
    assert waited["api_server"] > 0.05 and waited["engine"] > 0.05, waited
    assert waited["client"] < waited["api_server"], waited
