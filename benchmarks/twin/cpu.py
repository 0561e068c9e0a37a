"""The real-engine benchmark's setup in the twin: what the policies' decisions alone do
on vLLM's CPU build, without the real engine's noise.

``benchmarks.engine`` runs the policies on vLLM's CPU build: 24 KV blocks of 128
tokens, the reference workload x0.6 with its tools x0.5, a real HTTP client. A round
there varies by 10-20% with whatever else the 2 cores run, and the daemon answers a
step or more late. Here the same setup runs in the twin's virtual time: vLLM's own
scheduler with the engine's block size, cache and batch limits, the step costs the
daemon learned on that engine, and the time a turn spent outside vLLM's scheduler
(the client, HTTP, the API server) spent on each request's way to it, through an API
server the engine's steps slow down (``frontend.py``). Each seed is
another draw of the same workload (arrivals, prompts, tools); the twin is
deterministic, so a figure here moves only with the code.

    python -m benchmarks.twin cpu --like benchmarks/results/engine/runs/RUN.json --seeds 10

``--like`` takes a real-engine run's workload, its FCFS's learned step costs, time
outside vLLM's scheduler and the steps its answers took (the median of the histogram
the engine reports, for runs that recorded it); flags override it. Where this twin and
that run agree, the policy's decisions explain the real result; where they do not, the
difference lies in what the twin does not model (the spread of the daemon's lag, the
cores the engine shares).
"""

from __future__ import annotations

import functools
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.twin import workload as wl
from benchmarks.twin.frontend import FrontEnd
from benchmarks.twin.lag import TAIL_MEANS_STEPS, DrawnLag, FittedLag, fit
from benchmarks.twin.steptime import StepTimeModel

# The share of the API server's pace left while the CPU engine computes a step
# (benchmarks.twin.frontend). At 0.1 the twin's FCFS goes idle as often as two runs
# of the 2-core CPU engine did (167 times a round against 169, and 182 against 180);
# 1, a fixed delay before each request, gives 122 and 150; 0.3 gives 154. A trace of
# that engine saw 30 of 34 requests sent while it computed reach it only after it
# went idle.
API_BUSY_RATE = 0.1


@dataclass(frozen=True, slots=True)
class CpuSetup:
    """The real-engine benchmark's engine and workload (its defaults)."""

    kind: str = "reference"
    jobs: int = 24
    jobs_per_s: float = 1.5
    scale: float = 0.6
    time_scale: float = 0.5
    max_output_tokens: int = 48
    blocks: int = 24
    block_tokens: int = 128
    # What a step costs on the engine (as the daemon learns it): a step, whatever it
    # decodes, plus each prompt token it computes. The AVX-512 CPU engines' figures
    # (benchmarks/results/engine).
    step_s: float = 2.0e-3
    prefill_s_per_token: float = 3.0e-5
    decode_s_per_seq: float = 0.0
    # Attention's cost per (query, key) pair (the twin's StepTimeModel): 0 leaves it
    # in ``prefill_s_per_token`` as the daemon's linear fit does, an average over the
    # contexts the run's prompts were computed after.
    attention_s_per_pair: float = 0.0
    # Seconds a turn spends outside vLLM's scheduler (client, HTTP, the API server).
    gap_s: float = 0.0
    # The API server a request passes on its way to the scheduler (benchmarks.twin.
    # frontend), where the twin spends gap_s: the share of its pace left while the
    # engine computes a step (1: the gap a fixed delay before each request), and its
    # work a request at full pace (None: fitted, with_api_delay, so that requests take
    # gap_s on their way on average, as the run's spent outside the scheduler).
    api_busy_rate: float = API_BUSY_RATE
    api_delay_s: float | None = None
    # Steps the daemon's answers land after the next one (the twin's default: none;
    # an engine whose answers take a median of k steps: k - 1).
    answer_lag_steps: int = 0
    # Instead, each answer applied a number of steps after its report drawn for the
    # policy from the --like run's lags (benchmarks.twin.lag: the lags that, kept in
    # order, land as the run's did); the draws past the run's last bucket (7 steps or
    # more) go on a geometric number of steps with mean ``answer_lag_tail_steps``
    # (None: fitted to the run's lags too). ``like_answer_lags``: the run's answers by
    # lag, {policy: [answers applied k steps late, k = 0, 1, ...]}, a round's.
    draw_answer_lag: bool = False
    answer_lag_tail_steps: float | None = None
    like_answer_lags: dict[str, list[float]] = field(default_factory=dict)
    # The --like run's steps on vLLM's own behaviour for want of a fresh answer, a
    # round's, by policy: printed beside the twin's (the report's lag table).
    like_fallback_steps: dict[str, float] = field(default_factory=dict)
    # And its steps a round (runs since f521b02): the fallback steps' share of them.
    like_engine_steps: dict[str, float] = field(default_factory=dict)
    # And the reports its daemon decided a round. Where a run recorded its steps, the
    # lags are fitted with reports on the run's share of the steps and to its
    # fallback share too (benchmarks.twin.lag.fit): a stall holds back the reports sent
    # during it, a third of its steps' on the CPU engine, not one a step.
    like_reports: dict[str, float] = field(default_factory=dict)
    # And its waits for the answer as the engine went idle (runs since they were
    # counted): the answers 0 steps late, printed beside the twin's.
    like_idle_waits: dict[str, float] = field(default_factory=dict)
    # While pins are held, the plugin reports at least this often (its
    # KVTETHER_PLUGIN_PIN_HEARTBEAT_MS) on the twin's clock. 0, the sweeps' setting: a
    # report every step. --answer-lag-drawn takes the engine's (the plugin's default),
    # so that the twin sends its reports on about as many steps as the engine does.
    pin_heartbeat_ms: float = 0.0
    # The twin's own idle waits a step, by policy, measured by one run of the twin
    # before the drawn-lag runs (with_twin_waits): the fit places the waits where the
    # twin will have them (the engine's, like_idle_waits, are the fallback).
    twin_wait_shares: dict[str, float] = field(default_factory=dict)
    # Step as vLLM's engine core does, one more (empty) step after the last request
    # finishes (simulator.simulate): there the plugin, idle, waits for the answer
    # again. Twin CPU runs before this field did not.
    step_to_return_finished: bool = True

    @classmethod
    def like(cls, run_path: Path, baseline: str = "fcfs") -> CpuSetup:
        """The setup of a ``benchmarks.engine`` result: its workload, and what its
        ``baseline`` run learned a step costs and spent outside vLLM's scheduler a
        request."""
        try:
            data = json.loads(run_path.read_text())
            workload = data["workload"]
            run = data["policies"][baseline]
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"{run_path}: not an engine benchmark result with a "
                             f"{baseline!r} run ({error})") from error
        from benchmarks.common.engine_runs import median_answer_lag_steps

        outside_s = outside_scheduler_s(run)
        # The twin applies an answer at the next step; the engine's median lag less that.
        lag_steps = median_answer_lag_steps(run)
        return cls(
            kind=workload["kind"], jobs=workload["jobs"], jobs_per_s=workload["jobs_per_s"],
            scale=workload["scale"], time_scale=workload["time_scale"],
            blocks=workload["kv_blocks"], block_tokens=workload["block_tokens"],
            step_s=run.get("learned_step_s") or cls.step_s,
            prefill_s_per_token=run.get("learned_prefill_s_per_token")
            or cls.prefill_s_per_token,
            gap_s=max(outside_s, 0.0) if outside_s is not None else 0.0,
            answer_lag_steps=max(lag_steps - 1, 0) if lag_steps is not None else 0,
            like_answer_lags={policy: lags for policy, policy_run in data["policies"].items()
                              if (lags := _answer_lags(policy_run))},
            like_fallback_steps=_per_policy(data, "fallback_steps"),
            like_engine_steps=_per_policy(data, "engine_steps"),
            like_reports=_per_policy(data, "daemon_reports"),
            like_idle_waits=_per_policy(data, "idle_waits"))

    def answer_lag(self, policy: str, seed: int) -> int | Callable[[], int]:
        """What holds the policy's answers back: a fixed number of steps, or a draw
        fitted to the --like run's lags for it (for its name without parameters, or
        else for the baseline FCFS)."""
        if not self.draw_answer_lag:
            return self.answer_lag_steps
        fitted = self.fitted_lag(policy)
        return DrawnLag(fitted.draw_shares, fitted.tail_mean_steps, seed)

    def fitted_lag(self, policy: str) -> FittedLag:
        """The lags the policy's answers are drawn from (:func:`benchmarks.twin.lag.fit`),
        at the run's report share and fallback share where it recorded its steps, with
        idle waits on the share of the steps the twin's engine has them (measured,
        ``twin_wait_shares``; else the run's). The answers 0 steps late are those waits'
        (counted since 18de9e7; before, a run's answers 0 steps late are its waits)."""
        name = self.like_name(policy)
        if name is None:
            raise ValueError(f"{policy}: no answers by lag to draw from (the --like run "
                             "recorded none)")
        recorded = self.like_answer_lags[name]
        steps = self.like_engine_steps.get(name)
        reports = self.like_reports.get(name)
        fallback = self.like_fallback_steps.get(name)
        waited = self.like_idle_waits.get(name, recorded[0])
        twin_waits = self.twin_wait_shares.get(policy)
        # Every answer waited for leaves nothing to draw: drawn as recorded, a report a
        # step (as runs before f521b02 without the twin's waits measured).
        report_share, fallback_share, wait_share = 1.0, None, 0.0
        drawable = sum(recorded[1:]) > 0
        if drawable and steps and reports and fallback is not None:
            # At most half the steps waits: the replay places them beside the reports.
            wait_share = min(twin_waits if twin_waits is not None else waited / steps, 0.5)
            report_share = min(max(reports - waited, 1.0) / steps, 1.0 - wait_share)
            fallback_share = min(fallback / steps, 1.0)
        elif drawable and twin_waits is not None:
            # Runs before f521b02 did not record their steps: a report a step, less the
            # twin's waits.
            wait_share = min(twin_waits, 0.5)
            report_share = 1.0 - wait_share
        return _fit_lag(tuple(recorded), self.answer_lag_tail_steps, report_share,
                        fallback_share, wait_share)

    def like_name(self, policy: str) -> str | None:
        """The --like run's policy whose lags the policy draws from: itself, its name
        without parameters, or else the baseline FCFS."""
        for name in (policy, policy.split("@")[0], "fcfs"):
            if name in self.like_answer_lags:
                return name
        return None

    def lags_of(self, policy: str) -> list[float] | None:
        name = self.like_name(policy)
        return None if name is None else self.like_answer_lags[name]

    def workload(self, seed: int) -> wl.Workload:
        """The seed's jobs; the time outside the scheduler is the front end's
        (``front``)."""
        base = wl.generate(self.kind, self.jobs_per_s, seed=seed, num_jobs=self.jobs)
        return wl.scaled(base, self.scale, self.time_scale, self.max_output_tokens)

    def front(self) -> FrontEnd:
        delay_s = self.gap_s if self.api_delay_s is None else self.api_delay_s
        return FrontEnd(delay_s=delay_s, busy_rate=self.api_busy_rate)

    def step_model(self) -> StepTimeModel:
        return StepTimeModel(fixed_s=self.step_s, prefill_s_per_token=self.prefill_s_per_token,
                             decode_s_per_seq=self.decode_s_per_seq, kv_read_s_per_token=0.0,
                             attention_s_per_pair=self.attention_s_per_pair)


@functools.cache
def _fit_lag(recorded: tuple[float, ...], tail_mean_steps: float | None,
             report_share: float = 1.0, fallback_share: float | None = None,
             wait_share: float = 0.0) -> FittedLag:
    """A run's lags fitted once per process (a few seconds each)."""
    return fit(recorded, TAIL_MEANS_STEPS if tail_mean_steps is None else (tail_mean_steps,),
               report_share=report_share, fallback_share=fallback_share,
               wait_share=wait_share)


def outside_scheduler_s(run: dict[str, Any]) -> float | None:
    """What a request of ``run`` spent, on average, outside vLLM's scheduler: the
    client's time less vLLM's queue, prefill and decode (the engine core's, from the
    request queued to its last token). vLLM's e2e counts from the API server's receipt,
    so it holds the request's wait in the API server, which is the twin's API server's
    (frontend.py): the FCFS requests of a saturated 9x run took 51.5 ms outside e2e and
    181.5 ms outside the scheduler. Runs without the three phases: outside e2e."""
    from benchmarks.common.engine_runs import outside_vllm_s

    client_s = run.get("client_request_mean_s")
    phases = run.get("vllm_mean_s") or {}
    if client_s is not None and all(phases.get(phase) is not None
                                    for phase in ("queue", "prefill", "decode")):
        return float(client_s - phases["queue"] - phases["prefill"] - phases["decode"])
    return outside_vllm_s(run)


def _per_policy(data: dict[str, Any], key: str) -> dict[str, float]:
    """A figure of each policy's run in an engine result, where it was recorded."""
    return {policy: float(run[key]) for policy, run in data["policies"].items()
            if run.get(key) is not None}


def _answer_lags(run: dict[str, Any]) -> list[float] | None:
    """A run's answers by lag as a list (index: steps late), or None where it recorded
    none."""
    from benchmarks.common.engine_runs import answers_by_lag

    by_lag = answers_by_lag(run)
    if sum(by_lag.values()) <= 0:
        return None
    return [float(by_lag.get(lag, 0.0)) for lag in range(max(by_lag) + 1)]


def engine_config(setup: CpuSetup) -> Any:
    """vLLM's CPU build as ``tests.support.launch`` starts it: the OpenAI server's CPU
    batch limits (128 sequences, 2,048 tokens a step), max-model-len 2,048."""
    from benchmarks.twin.simulator import EngineConfig

    return EngineConfig(num_blocks=setup.blocks, block_size=setup.block_tokens,
                        max_model_len=2048, max_num_seqs=128, max_num_batched_tokens=2048)


def run_policy(setup: CpuSetup, policy: str, seed: int) -> dict[str, Any]:
    """One seed of one policy (``name@KEY=VALUE@...`` sets parameters) through the
    real daemon; the twin's summary of it."""
    from benchmarks.twin.daemon import learned_step_costs, running_daemon
    from benchmarks.twin.metrics import summarize
    from benchmarks.twin.simulator import VirtualClock, build_engine, simulate

    name, *params = policy.split("@")
    workload = setup.workload(seed)
    config = engine_config(setup)
    clock = VirtualClock()
    with running_daemon(name, params) as daemon:
        scheduler = build_engine(name, config, clock, daemon.address,
                                 setup.answer_lag(policy, seed), setup.pin_heartbeat_ms)
        try:
            result = simulate(workload, scheduler, setup.step_model(), config, clock,
                              step_to_return_finished=setup.step_to_return_finished,
                              front=setup.front())
            learned = learned_step_costs(daemon.address)
        finally:
            scheduler.shutdown()
    summary = summarize(result, policy, setup.jobs_per_s)
    summary["seed"] = seed
    summary["answers_by_lag_steps"] = result.answers_by_lag_steps
    summary["fallback_steps"] = result.plugin_counters.get("fallback_steps")
    summary["idle_waits"] = result.plugin_counters.get("idle_waits")
    summary["steps"] = result.steps
    summary["api_s"] = result.api_s_mean
    # The prompt token's cost the daemon learned from the twin's steps, as the engine
    # benchmark records it: with an attention term it depends on the contexts the
    # policy's tokens were computed after.
    learned_s = float(learned[0].get("prefill_s_per_token", 0.0)) if learned else 0.0
    summary["learned_prefill_s_per_token"] = learned_s or None  # None: not learned
    summary["prefill_share"] = prefill_share(result.prefill_tokens_by_s, learned_s or None,
                                             policy)
    return summary


def prefill_share(tokens_by_s: Sequence[int], learned_s_per_token: float | None,
                  policy: str) -> dict[str, float] | None:
    """The share of its time the engine spent computing prompts, as adaptive reads it
    each second (the daemon's ``PrefillRate``: prompt tokens a second over the last
    10 s, times the cost of a token learned by the end of the run), summarized as the
    engine benchmark summarizes the gauge it samples (``benchmarks.engine.
    prefill_share``): mean, median, maximum and the time at or above the policy's
    ``saturated_prefill_share``. None without a learned cost or a prompt token."""
    from benchmarks.common.engine_runs import saturated_at, summarize_prefill_share
    from sidecar.runtime.steptime import PrefillRate

    if not learned_s_per_token or not tokens_by_s:
        return None
    rate = PrefillRate()
    rate.add(0.0, 0)
    shares = []
    for second, tokens in enumerate(tokens_by_s, start=1):
        rate.add(float(second), tokens)
        per_s = rate.per_s()
        shares.append(0.0 if per_s is None else per_s * learned_s_per_token)
    return summarize_prefill_share(shares, saturated_at(policy))


def with_api_delay(setup: CpuSetup, seeds: Sequence[int], say: Any = None,
                   baseline: str = "fcfs", tolerance: float = 0.02) -> CpuSetup:
    """``setup`` with the API server's work a request (``api_delay_s``) such that the
    ``baseline``'s requests take ``gap_s`` on their way to the scheduler on average over
    ``seeds``, as the --like run's spent outside vLLM's scheduler: the requests the
    engine's steps slow down take longer than that work. Costs up to four more runs
    of the baseline on each seed."""
    if setup.api_delay_s is not None:
        return setup
    delay_s = setup.gap_s
    if setup.gap_s > 0.0 and setup.api_busy_rate < 1.0:
        for _ in range(4):
            api_s = statistics.mean(
                run_policy(replace(setup, api_delay_s=delay_s), baseline, seed)["api_s"]
                for seed in seeds)
            if say is not None:
                say(f"the API server's work {delay_s * 1000:.1f} ms a request: "
                    f"{api_s * 1000:.1f} ms on the way, the run's {setup.gap_s * 1000:.1f} ms "
                    f"outside the scheduler ({baseline}, seeds {min(seeds)}-{max(seeds)})")
            if abs(api_s - setup.gap_s) <= tolerance * setup.gap_s:
                break
            delay_s *= setup.gap_s / api_s
    return replace(setup, api_delay_s=delay_s)


def with_twin_waits(setup: CpuSetup, policies: Sequence[str], seed: int,
                    say: Any = None) -> CpuSetup:
    """With drawn lags, ``setup`` with the twin's own idle waits a step for each policy,
    from one more run of it on ``seed``: the fit replays the waits at the rate the
    twin's engine goes idle (an idle wait lands every answer sent), not the engine's.
    They differ most where the twin's API server does not slow requests while the
    engine computes (``api_busy_rate`` 1: FCFS 150 waits a round against the engine's
    180; 182 at the default 0.1; frontend.py)."""
    if not setup.draw_answer_lag:
        return setup
    shares = {}
    for policy in policies:
        summary = run_policy(setup, policy, seed)
        if summary.get("idle_waits") is not None and summary["steps"]:
            shares[policy] = summary["idle_waits"] / summary["steps"]
            if say is not None:
                say(f"{policy}: the twin's engine waited for its answers on "
                    f"{shares[policy]:.1%} of its steps (seed {seed})")
    return replace(setup, twin_wait_shares=shares)


def compare(setup: CpuSetup, policies: Sequence[str], seeds: Sequence[int],
            say: Any = None) -> dict[str, list[dict[str, Any]]]:
    """Every policy on every seed: {policy: [summary per seed]}."""
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    for seed in seeds:
        for policy in policies:
            summary = run_policy(setup, policy, seed)
            runs[policy].append(summary)
            if say is not None:
                say(f"seed {seed} {policy}: {summary['avg_duration_s']:.3f} s a job, "
                    f"hits {summary['prefix_cache_hit_rate']:.1%}")
    return runs


def report(setup: CpuSetup, runs: dict[str, list[dict[str, Any]]], baseline: str) -> str:
    """Per policy: the average job, hits, pinned blocks and maximum TTFT over the seeds,
    and, paired by seed with the baseline's (mean +- standard error), its average job
    and the prompt token's cost the daemon learned (as ``benchmarks.engine.paired``
    prints the engine's)."""
    from benchmarks.common.stats import estimate

    lines = [f"twin, vLLM CPU setup: {setup.blocks} blocks of {setup.block_tokens} tokens, "
             f"{setup.jobs} {setup.kind} jobs at {setup.jobs_per_s:g}/s x{setup.scale:g}, "
             f"tools x{setup.time_scale:g} + {setup.gap_s:.3f} s outside the scheduler ("
             + front_words(setup) + "), step "
             f"{setup.step_s * 1e3:.2f} ms + {setup.prefill_s_per_token:.2e} s a prompt "
             f"token + {setup.attention_s_per_pair:.2e} s an attention pair, answers "
             + ("late as the --like run's (drawn, below)" if setup.draw_answer_lag
                else f"{setup.answer_lag_steps} step(s) late")
             + (f", pins re-reported every {setup.pin_heartbeat_ms:g} ms"
                if setup.pin_heartbeat_ms > 0 else ""),
             f"{'policy':<36}{'avg job s':>10}{'hits':>8}{'pinned blocks':>15}"
             f"{'provisional':>13}{'max TTFT s':>12}{f'/ {baseline}, paired':>26}"
             f"{'learned s/token / its':>24}"]
    for policy, summaries in runs.items():
        pairs = list(zip(summaries, runs[baseline], strict=True))
        ratio = estimate([s["avg_duration_s"] / b["avg_duration_s"] for s, b in pairs])
        learned = [s["learned_prefill_s_per_token"] / b["learned_prefill_s_per_token"]
                   for s, b in pairs
                   if s.get("learned_prefill_s_per_token")
                   and b.get("learned_prefill_s_per_token")]
        learned_text = "-"
        if len(learned) == len(pairs):
            cost = estimate(learned)
            learned_text = f"{cost.mean:.3f} +- {cost.stderr:.3f}"
        lines.append(
            f"{policy:<36}{statistics.fmean(s['avg_duration_s'] for s in summaries):>10.3f}"
            f"{statistics.fmean(s['prefix_cache_hit_rate'] for s in summaries):>8.1%}"
            f"{statistics.fmean(s['pinned_blocks_avg'] for s in summaries):>15.1f}"
            f"{statistics.fmean(s.get('provisional_blocks_avg') or 0.0 for s in summaries):>13.1f}"
            f"{max(s['ttft_ms']['max'] for s in summaries) / 1e3:>12.2f}"
            f"{f'{ratio.mean:.3f} +- {ratio.stderr:.3f}':>26}{learned_text:>24}")
    lines.append(f"{len(next(iter(runs.values())))} seeds")
    lines += seed_ratio_lines(runs, baseline)
    lines += turn_latency_lines(runs)
    lines += cached_tokens_lines(runs)
    lines += prefill_share_lines(runs)
    lines += answer_lag_lines(setup, runs)
    return "\n".join(lines)


def answer_lag_lines(setup: CpuSetup, runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each policy's answers by how many steps late the plugin applied them (shares of
    its answers, over the seeds), its fallback steps a run and their share of its
    steps, and its waits for the answer as the engine went idle, beside the --like
    run's (a round's), and with drawn lags what was drawn (the fit's tail and error):
    how close the twin's lag is to the engine's."""
    rows: list[tuple[str, list[float], float | None, float | None, float | None]] = []
    notes = []

    def mean_of(summaries: list[dict[str, Any]], key: str) -> float | None:
        figures = [s[key] for s in summaries if s.get(key) is not None]
        return statistics.fmean(figures) if figures else None

    for policy, summaries in runs.items():
        counts = [s["answers_by_lag_steps"] for s in summaries if s.get("answers_by_lag_steps")]
        if counts:
            summed = [float(sum(column)) for column in zip(*counts, strict=True)]
            rows.append((f"{policy} (twin)", summed, mean_of(summaries, "fallback_steps"),
                         mean_of(summaries, "steps"), mean_of(summaries, "idle_waits")))
        lags = setup.like_answer_lags.get(policy)
        if lags:
            rows.append((f"{policy} (--like run)", lags, setup.like_fallback_steps.get(policy),
                         setup.like_engine_steps.get(policy),
                         setup.like_idle_waits.get(policy)))
        if setup.draw_answer_lag and setup.lags_of(policy) is not None:
            fitted = setup.fitted_lag(policy)
            notes.append(f"  {policy}: drawn " + " ".join(
                f"{share:.1%}" for share in fitted.draw_shares)
                + f", the last bucket + {fitted.tail_mean_steps:g} steps on average; kept "
                  f"in order, reports on {fitted.report_share:.0%} of the steps and idle "
                  f"waits on {fitted.wait_share:.0%}, they land within {fitted.error:.1%} "
                  f"of the run's, {fitted.fallback_share:.1%} of the steps without a "
                  "fresh answer")
    if not rows:
        return []
    buckets = max(len(row[1]) for row in rows)
    lines = [f"{'answers by steps late':<36}"
             + "".join(f"{f'{k}+' if k == buckets - 1 else k:>7}" for k in range(buckets))
             + f"{'fallback steps':>16}{'of steps':>10}{'idle waits':>12}"]
    for name, shares, fallback, steps, waits in rows:
        answers = sum(shares) or 1.0
        lines.append(f"{name:<36}" + "".join(
            f"{(shares[k] if k < len(shares) else 0.0) / answers:>7.1%}" for k in range(buckets))
            + (f"{fallback:>16.0f}" if fallback is not None else f"{'-':>16}")
            + (f"{fallback / steps:>10.1%}" if fallback is not None and steps
               else f"{'-':>10}")
            + (f"{waits:>12.0f}" if waits is not None else f"{'-':>12}"))
    return lines + notes


def seed_ratio_lines(runs: dict[str, list[dict[str, Any]]], baseline: str) -> list[str]:
    """Each policy's average job over the baseline's, seed by seed. An engine run
    without ``--vary-seed`` ran one draw (its workload's seed) every round: the twin's
    figure for that seed, not the mean over seeds, is the one to set beside it."""
    seeds = [s["seed"] for s in runs[baseline]]
    if len(seeds) < 2:
        return []
    lines = [f"{f'/ {baseline}, by seed':<36}" + "".join(f"{seed:>7}" for seed in seeds)]
    for policy, summaries in runs.items():
        if policy != baseline:
            lines.append(f"{policy:<36}" + "".join(
                f"{s['avg_duration_s'] / b['avg_duration_s']:>7.3f}"
                for s, b in zip(summaries, runs[baseline], strict=True)))
    return lines


def prefill_share_lines(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each policy's prefill share over the seeds (their summaries averaged): the
    engine benchmark's "prefill share" table."""
    rows = []
    for policy, summaries in runs.items():
        shares = [s["prefill_share"] for s in summaries if s.get("prefill_share")]
        if shares:
            rows.append(f"{policy:<36}" + "".join(
                f"{statistics.fmean(share[key] for share in shares):>7.2f}"
                for key in ("mean", "p50", "max"))
                + f"{statistics.fmean(share['time_saturated'] for share in shares):>11.0%}"
                + f"{shares[0]['saturated_at']:>6.2f}")
    if not rows:
        return []
    return [f"{'prefill share':<36}{'mean':>7}{'p50':>7}{'max':>7}{'saturated':>11}"
            f"{'at':>6}", *rows]


def turn_latency_lines(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each policy's average time from a turn's request to its last token, by the
    turn's place in its job, over the seeds: the engine benchmark's "turn latency"
    table (there the client's clock, so also the time outside vLLM)."""
    return _by_turn_lines(runs, "turn latency s", lambda s, turn: (
        s["per_turn_avg_latency_ms"][turn] / 1e3
        if turn in (s.get("per_turn_avg_latency_ms") or {}) else None), digits=2)


def cached_tokens_lines(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each policy's prompt tokens a turn found cached, by turn, over the seeds: the
    engine benchmark's "cached tokens" table (what the pins kept for the job's return)."""
    def cached(s: dict[str, Any], turn: str) -> float | None:
        rate = (s.get("per_turn_prefix_cache_hit_rate") or {}).get(turn)
        prompt = (s.get("per_turn_avg_prompt_tokens") or {}).get(turn)
        return None if rate is None or prompt is None else rate * prompt

    return _by_turn_lines(runs, "cached tokens", cached, digits=0)


def _by_turn_lines(runs: dict[str, list[dict[str, Any]]], title: str,
                   figure: Callable[[dict[str, Any], str], float | None],
                   digits: int) -> list[str]:
    """A table of ``figure(summary, turn)`` by turn, each cell averaged over the seeds
    that have it; no table when no seed has any turn."""
    turns = sorted({int(turn) for summaries in runs.values() for s in summaries
                    for turn in s.get("per_turn_avg_latency_ms") or {}})
    if not turns:
        return []
    lines = [f"{title:<36}" + "".join(f"{turn:>7}" for turn in turns)]
    for policy, summaries in runs.items():
        cells = []
        for turn in turns:
            values = [value for s in summaries
                      if (value := figure(s, str(turn))) is not None]
            cells.append(f"{statistics.fmean(values):>7.{digits}f}" if values else f"{'-':>7}")
        lines.append(f"{policy:<36}" + "".join(cells))
    return lines


def result_json(setup: CpuSetup, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The setup and, per policy and seed, the figures the report reads (the twin's
    full summaries carry time series; these do not)."""
    keep = ("seed", "avg_duration_s", "p95_duration_s", "prefix_cache_hit_rate",
            "preemptions", "pinned_blocks_avg", "provisional_blocks_avg", "kv_usage_avg",
            "ttft_ms", "learned_prefill_s_per_token", "per_turn_avg_latency_ms",
            "per_turn_prefix_cache_hit_rate", "per_turn_avg_prompt_tokens", "prefill_share",
            "answers_by_lag_steps", "fallback_steps", "steps", "idle_waits", "api_s")
    return {"setup": asdict(setup),
            "policies": {policy: [{key: s.get(key) for key in keep} for s in summaries]
                         for policy, summaries in runs.items()}}


def front_words(setup: CpuSetup) -> str:
    front = setup.front()
    if front.busy_rate >= 1.0:
        return "before each request"
    return (f"an API server's {front.delay_s * 1e3:.1f} ms a request, at "
            f"{front.busy_rate:.0%} of its pace while the engine computes")


def with_overrides(setup: CpuSetup, **overrides: Any) -> CpuSetup:
    """``setup`` with every override that is not None."""
    return replace(setup, **{k: v for k, v in overrides.items() if v is not None})
