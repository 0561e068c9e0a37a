"""How one policy's time on the real engine differs from another's, pooled over the
rounds of several benchmark runs, and where the difference lies: inside vLLM (what a
policy's decisions can change) or outside it (HTTP, the API server and the client,
sharing the machine's cores).

    .venv/bin/python -m benchmarks.engine.paired runs/a.json runs/b.json --baseline fcfs
        [--exclude runs/b.json:1]

``--exclude FILE:ROUND`` leaves out a round something else on the machine disturbed (a
test suite run beside the benchmark: the README says which and why), so the pooled
figure with and without it can both be re-made from the committed files.

A 2% difference in the average job is about what the rounds' spread hides: a round's
job time is mostly its tools' sleeps and the client's time outside vLLM, which varies
from round to round with whatever else the 2 cores run. vLLM's own histograms time
each request from the API server's arrival to its finish, so the per-request split
tells whether a policy moved the part it controls. Every figure is paired by round
(the policies of a round run back to back on the same arrivals) and given as mean +-
standard error over the rounds, with the one-sided 95% upper bound.

Pairing cancels the drift between rounds, not within one: a shared machine can run
slower during one policy's half-minute than during the next one's, and the job ratio
follows it. The daemon learns
what a prompt token costs from each run's own steps, and the report gives the policy's
learned cost over the baseline's and the job ratio at equal learned cost
(:func:`speed_adjusted_ratio`, a covariate adjustment). The adjustment is valid only
where the policy does not move the cost it learns, and the pinning policies do, a
little: on the six saturated VMs their runs learned a dearer token than FCFS's beside
them (adaptive 1.023 +- 0.008, continuum 1.021 +- 0.009, pooled over the VMs), on
the three fast ones a cheaper one (0.995 +- 0.007, 0.980 +- 0.008). There the adjusted
ratio leans toward the policy by about the slope times that, so the verdicts stay on
the plain paired ratio; the adjusted one says how much of a gap the machine's speed
could explain. An idle probe timed between runs (a 1,600-token prompt) does not
follow the runs' speed, which changes within a run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.engine_runs import outside_vllm_s
from benchmarks.common.stats import Estimate, estimate, t_quantile

Round = dict[str, dict[str, Any]]  # policy -> that policy's result in one round

# Per-request figures, in seconds, from one policy's result in one round.
REQUEST_SPLIT: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "client": lambda run: run.get("client_request_mean_s"),
    "vllm e2e": lambda run: run.get("vllm_mean_s", {}).get("e2e"),
    "  queue": lambda run: run.get("vllm_mean_s", {}).get("queue"),
    "  prefill": lambda run: run.get("vllm_mean_s", {}).get("prefill"),
    "  decode": lambda run: run.get("vllm_mean_s", {}).get("decode"),
    "outside vllm": lambda run: outside_vllm_s(run),
}


def parse_excluded(specs: Sequence[str], paths: Sequence[Path]) -> dict[int, set[int]]:
    """``--exclude FILE:ROUND`` (ROUND counted from 1, as the benchmark prints it) as
    {index of the file among ``paths``: {round indexes from 0}}."""
    excluded: dict[int, set[int]] = {}
    for spec in specs:
        name, colon, number = spec.rpartition(":")
        if not colon or not number.isdigit() or int(number) < 1:
            raise ValueError(f"--exclude {spec!r}: not FILE:ROUND with ROUND from 1")
        matches = [i for i, path in enumerate(paths) if str(path) == name]
        if not matches:
            raise ValueError(f"--exclude {spec!r}: {name!r} is not one of the results given")
        for index in matches:
            excluded.setdefault(index, set()).add(int(number) - 1)
    return excluded


def load_rounds(paths: Sequence[Path],
                excluded: dict[int, set[int]] | None = None) -> list[Round]:
    """Every round of every run, each as ``{policy: result}``, less the ``excluded``
    ones (by file index, then round index; a round disturbed by something else the
    machine ran, named on the command line so the pooled figure can be re-made). Rounds
    pair only within a run (its policies ran back to back); a policy missing from a run
    is missing from its rounds."""
    excluded = excluded or {}
    rounds: list[Round] = []
    for file_index, path in enumerate(paths):
        try:
            policies = json.loads(path.read_text())["policies"]
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"{path}: not an engine benchmark result ({error})") from error
        counts = {policy: len(result["rounds"]) for policy, result in policies.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(f"{path}: policies ran different numbers of rounds: {counts}")
        total = min(counts.values(), default=0)
        skipped = excluded.get(file_index, set())
        if any(index >= total for index in skipped):
            raise ValueError(f"{path}: --exclude names a round past its {total}")
        for index in range(total):
            if index not in skipped:
                rounds.append({policy: result["rounds"][index]
                               for policy, result in policies.items()})
    return rounds


# A run's speed: the seconds a prompt token took, learned by the daemon from the run's
# steps (0 where it had not learned it). Higher: a slower machine.
LEARNED_S_PER_TOKEN = "learned_prefill_s_per_token"


@dataclass(frozen=True, slots=True)
class SpeedAdjusted:
    """A job ratio at equal machine speed, with what it rests on."""

    ratio: float
    stderr: float
    upper95: float
    rounds: int
    slope: float  # d log(job ratio) / d log(speed ratio)
    speed_ratio: Estimate  # the policy's learned seconds a token over the baseline's


def speed_adjusted_ratio(rounds: Sequence[Round], policy: str, baseline: str
                         ) -> SpeedAdjusted | None:
    """The policy's average job over the baseline's at equal machine speed: the log
    job ratio of each round regressed on its log ratio of learned seconds a token
    (policy over baseline), read at a ratio of 1. The intercept's standard error counts
    the slope's uncertainty; the bound is Student's with n - 2 degrees of freedom.
    None with fewer than 4 rounds where both runs learned the cost, or no spread."""
    pairs = [(math.log(a / b), math.log(r[policy]["avg_job_duration_s"]
                                         / r[baseline]["avg_job_duration_s"]))
             for r in rounds if policy in r and baseline in r
             if (a := r[policy].get(LEARNED_S_PER_TOKEN))
             and (b := r[baseline].get(LEARNED_S_PER_TOKEN))]
    count = len(pairs)
    if count < 4:
        return None
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    try:
        slope, intercept = statistics.linear_regression(xs, ys)
    except statistics.StatisticsError:  # one speed in every round: nothing to adjust by
        return None
    x_mean = statistics.mean(xs)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    residual = math.sqrt(sum((y - intercept - slope * x) ** 2 for x, y in pairs)
                         / (count - 2))
    log_stderr = residual * math.sqrt(1 / count + x_mean ** 2 / sxx)
    ratio = math.exp(intercept)
    return SpeedAdjusted(
        ratio=ratio, stderr=ratio * log_stderr,
        upper95=math.exp(intercept + t_quantile(count - 2, 0.95) * log_stderr),
        rounds=count, slope=slope, speed_ratio=estimate([math.exp(x) for x in xs]))


def job_ratio(rounds: Sequence[Round], policy: str, baseline: str) -> Estimate:
    """The policy's average job over the baseline's, paired by round."""
    return estimate([r[policy]["avg_job_duration_s"] / r[baseline]["avg_job_duration_s"]
                     for r in rounds if policy in r and baseline in r])


@dataclass(frozen=True, slots=True)
class GeometricRatio:
    """The rounds' ratios averaged on a log scale: ``exp(mean(log ratio))``, and the
    factor one standard error of that mean multiplies or divides it by."""

    ratio: float
    factor: float
    rounds: int

    @property
    def upper95(self) -> float:
        return self.ratio * math.pow(self.factor, t_quantile(self.rounds - 1, 0.95))


def geometric_job_ratio(rounds: Sequence[Round], policy: str, baseline: str
                        ) -> GeometricRatio:
    """The policy's average job over the baseline's, paired by round and averaged on a
    log scale. The plain mean of ratios leans above 1 by about half their variance
    whichever policy is on top: where rounds spread by 25-30%, A / B and B / A both
    read 3-4% above 1. The geometric mean is the same comparison read
    either way round (A / B is 1 over B / A)."""
    logs = [math.log(r[policy]["avg_job_duration_s"] / r[baseline]["avg_job_duration_s"])
            for r in rounds if policy in r and baseline in r]
    spread = estimate(logs)
    return GeometricRatio(math.exp(spread.mean), math.exp(spread.stderr), spread.rounds)


def request_split(rounds: Sequence[Round], policy: str, baseline: str
                  ) -> dict[str, Estimate]:
    """Per request, the policy's seconds minus the baseline's, paired by round, for
    each figure of ``REQUEST_SPLIT`` (rounds recorded before a figure was are left
    out of that figure)."""
    split = {}
    for name, figure in REQUEST_SPLIT.items():
        differences = [a - b for r in rounds if policy in r and baseline in r
                       if (a := figure(r[policy])) is not None
                       and (b := figure(r[baseline])) is not None]
        if differences:
            split[name] = estimate(differences)
    return split


def ttft_ratios(rounds: Sequence[Round], policy: str, baseline: str
                ) -> dict[str, Estimate]:
    """The policy's 99th-percentile and longest wait for a first token over the
    baseline's, paired by round (rounds recorded before the engine timed requests are
    left out): the tail a job-level order may lengthen."""
    ratios = {}
    for stat in ("p99", "max"):
        values = [a[stat] / b[stat] for r in rounds if policy in r and baseline in r
                  if (a := r[policy].get("ttft_s")) and (b := r[baseline].get("ttft_s"))
                  and b[stat] > 0]
        if values:
            ratios[stat] = estimate(values)
    return ratios


def turns_per_job(rounds: Sequence[Round], policy: str) -> float:
    """Requests a job makes: what turns a per-request difference into a job's."""
    for r in rounds:
        per_turn = r.get(policy, {}).get("per_turn")
        if per_turn:
            return float(len(per_turn))
    return math.nan


def report(rounds: Sequence[Round], baseline: str) -> str:
    policies = sorted({p for r in rounds for p in r if p != baseline})
    lines = [f"{len(rounds)} paired rounds; baseline {baseline}"]
    for policy in policies:
        ratio = job_ratio(rounds, policy, baseline)
        turns = turns_per_job(rounds, policy)
        lines.append(f"\n{policy} / {baseline}, average job: {ratio.mean:.3f} +- "
                     f"{ratio.stderr:.3f} (one-sided 95% bound {ratio.upper95:.3f}, "
                     f"{ratio.rounds} rounds)")
        geometric = geometric_job_ratio(rounds, policy, baseline)
        lines.append(f"  geometric mean {geometric.ratio:.3f} x/ {geometric.factor:.3f} "
                     f"(bound {geometric.upper95:.3f}; read either way round, 1 / that of "
                     f"{baseline} / {policy})")
        lines.append(f"  {f'ms a request, {policy} - {baseline}':<34}{'mean':>8}{'stderr':>9}"
                     f"{'95% bound':>11}{f'x{turns:g} turns':>12}")
        for name, difference in request_split(rounds, policy, baseline).items():
            lines.append(f"  {name:<34}{difference.mean * 1e3:>8.2f}"
                         f"{difference.stderr * 1e3:>9.2f}{difference.upper95 * 1e3:>11.2f}"
                         f"{difference.mean * turns * 1e3:>12.1f}")
        adjusted = speed_adjusted_ratio(rounds, policy, baseline)
        if adjusted is not None:
            balance = adjusted.speed_ratio
            lines.append(f"  its runs' learned s/token over {baseline}'s {balance.mean:.3f} +- "
                         f"{balance.stderr:.3f}; were that all the machine's, the job "
                         f"ratio at equal speed {adjusted.ratio:.3f} +- {adjusted.stderr:.3f}"
                         f" (bound {adjusted.upper95:.3f}, slope {adjusted.slope:.2f}, "
                         f"{adjusted.rounds} rounds)")
        for stat, ratio in ttft_ratios(rounds, policy, baseline).items():
            lines.append(f"  {f'{stat} first-token wait / {baseline}':<34}{ratio.mean:>8.3f}"
                         f"{ratio.stderr:>9.3f}{ratio.upper95:>11.3f}  ({ratio.rounds} rounds)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path,
                        help="engine.json files written by python -m benchmarks.engine")
    parser.add_argument("--baseline", default="fcfs")
    parser.add_argument("--exclude", action="append", default=[], metavar="FILE:ROUND",
                        help="leave out that round of that file (from 1, as the benchmark "
                             "numbers them): one something else on the machine disturbed")
    args = parser.parse_args(argv)
    try:
        rounds = load_rounds(args.results, parse_excluded(args.exclude, args.results))
    except ValueError as error:
        parser.error(str(error))
    paired = [r for r in rounds if args.baseline in r]
    if len(paired) < 2:
        parser.error(f"need at least 2 rounds with the baseline {args.baseline!r}, "
                     f"found {len(paired)}")
    print(report(paired, args.baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
