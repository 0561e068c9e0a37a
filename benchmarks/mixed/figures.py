"""What one policy's round of the mixed workload came to, and how policies compare over
paired rounds. Pure: no engine, no clock; ``__main__`` feeds it what it timed.

A one-shot request is a job of one turn: its latency is its job time, so the average
over all jobs weighs an agent's job and a one-shot request alike, and a policy cannot
buy its agents' speed with the one-shot traffic's latency unseen.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common.stats import estimate, percentile, t_quantile


@dataclass(frozen=True, slots=True)
class AgentTurn:
    turn: int  # 1-based
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


def round_figures(agent_jobs_s: Sequence[float], one_shot_s: Sequence[float],
                  agent_turns: Sequence[AgentTurn]) -> dict[str, Any]:
    """One policy's round: the agents' average job, the one-shot requests' latency,
    the average over all jobs, and the agents' turns by turn."""
    if not agent_jobs_s:
        raise ValueError("a round needs at least one agent job")
    all_jobs = [*agent_jobs_s, *one_shot_s]
    by_turn: dict[int, list[AgentTurn]] = {}
    for turn in agent_turns:
        by_turn.setdefault(turn.turn, []).append(turn)
    return {
        "agents": len(agent_jobs_s),
        "one_shots": len(one_shot_s),
        "agent_job_s": statistics.mean(agent_jobs_s),
        "agent_job_max_s": max(agent_jobs_s),
        "one_shot_s": statistics.mean(one_shot_s) if one_shot_s else None,
        "one_shot_p95_s": percentile(one_shot_s, 0.95) if one_shot_s else None,
        "all_jobs_s": statistics.mean(all_jobs),
        "agent_turns": {str(k): {"latency_s": statistics.mean(t.latency_s for t in v),
                                 "prompt_tokens": statistics.mean(t.prompt_tokens for t in v),
                                 "cached_tokens": statistics.mean(t.cached_tokens for t in v)}
                        for k, v in sorted(by_turn.items())},
    }


FIGURES = ("agent_job_s", "one_shot_s", "all_jobs_s")


def mean_of_rounds(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A policy's rounds: each figure's mean, the agents' cached tokens by turn, and
    the rounds themselves."""
    merged: dict[str, Any] = {
        name: statistics.mean(r[name] for r in rounds)
        if all(r.get(name) is not None for r in rounds) else None
        for name in (*FIGURES, "one_shot_p95_s", "agent_job_max_s")}
    turns = sorted({int(t) for r in rounds for t in r["agent_turns"]})
    merged["agent_cached_tokens"] = {
        str(t): statistics.mean(r["agent_turns"][str(t)]["cached_tokens"] for r in rounds
                                if str(t) in r["agent_turns"]) for t in turns}
    merged["rounds"] = list(rounds)
    return merged


def paired(runs: Mapping[str, Sequence[Mapping[str, Any]]], baseline: str,
           figure: str) -> dict[str, dict[str, Any]]:
    """Each policy's ``figure`` over the baseline's, paired by round: mean, standard
    error and the two-sided 95% interval (Student's t; None for one round)."""
    base = runs[baseline]
    ratios: dict[str, dict[str, Any]] = {}
    for policy, rounds in runs.items():
        if policy == baseline:
            continue
        values = [r[figure] / b[figure] for r, b in zip(rounds, base, strict=True)
                  if r.get(figure) is not None and b.get(figure)]
        if not values:
            continue
        ratio = estimate(values)
        if ratio.rounds < 2:  # one round bounds nothing
            ratios[policy] = {"mean": ratio.mean, "stderr": None, "low95": None,
                              "high95": None, "rounds": values}
            continue
        half = t_quantile(ratio.rounds - 1, 0.975) * ratio.stderr
        ratios[policy] = {"mean": ratio.mean, "stderr": ratio.stderr,
                          "low95": ratio.mean - half, "high95": ratio.mean + half,
                          "rounds": values}
    return ratios
