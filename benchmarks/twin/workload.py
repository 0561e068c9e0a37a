"""Agent workloads for the twin: a file format (JSON), its check, and two generators.

A workload is a list of jobs; a job arrives at ``arrival_s`` and runs its turns in
order: turn k is sent, the model answers ``output_tokens`` tokens, the tool runs for
``tool_time_s``, then turn k+1 is sent. Each turn's prompt is the previous turn's
context (its prompt and its output) plus new tokens (tool output, the next user
message), so ``prompt_tokens[k+1] >= prompt_tokens[k] + output_tokens[k]``. The
simulator derives token ids from the job id, so one job's turns share their prefix
exactly and two jobs share nothing. The format, field by field, is in README.md.

    {"format": "kvtether-twin-workload/v1", "name": "...", "max_output_tokens": 150,
     "jobs": [{"job_id": "job_0000", "arrival_s": 0.31,
               "turns": [{"prompt_tokens": 92, "output_tokens": 21, "tool": "ls",
                          "tool_time_s": 0.08, "is_last_step": false}, ...]}]}
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

FORMAT = "kvtether-twin-workload/v1"


class WorkloadError(ValueError):
    """A workload that does not follow the format; ``field`` names the bad field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    tool: str | None  # the tool this turn's answer calls (None: no tool / last step)
    tool_time_s: float  # how long that tool runs before the next turn is sent
    is_last_step: bool
    # Which answer the model gave, for jobs that run a shared script: jobs with the
    # same script and the same answers so far have identical contexts. None: an
    # answer no other job gives (the job's context is its own from here on).
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Job:
    job_id: str
    arrival_s: float
    turns: tuple[Turn, ...]
    # Jobs naming the same script share their first prompt and, while their answers
    # agree, every later one (same system prompt, task, tool outputs). None: the job
    # shares no token with any other job.
    script: str | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    jobs: tuple[Job, ...]
    max_output_tokens: int = 150
    description: str = ""
    generator: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "description": self.description,
            "max_output_tokens": self.max_output_tokens,
            "generator": self.generator,
            "jobs": [_job_json(j) for j in self.jobs],
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @property
    def max_context_tokens(self) -> int:
        return max((t.prompt_tokens + t.output_tokens for j in self.jobs for t in j.turns),
                   default=0)


def _job_json(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {"job_id": job.job_id, "arrival_s": round(job.arrival_s, 6)}
    if job.script is not None:
        out["script"] = job.script
    turns = []
    for turn in job.turns:
        item = asdict(turn)
        if item["answer"] is None:
            del item["answer"]
        turns.append(item)
    out["turns"] = turns
    return out


# --- reading and checking ---------------------------------------------------------------

def load(path: Path | str) -> Workload:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise WorkloadError("(file)", f"not JSON: {error}") from None
    return from_json(data)


def _number(value: Any, where: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(where, f"expected a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise WorkloadError(where, f"must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(where, f"expected an integer, got {value!r}")
    if value < minimum:
        raise WorkloadError(where, f"must be >= {minimum}, got {value!r}")
    return value


def _keys(obj: Any, where: str, required: set[str], optional: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WorkloadError(where, f"expected an object, got {type(obj).__name__}")
    for key in sorted(required - obj.keys()):
        raise WorkloadError(f"{where}.{key}" if where else key, "missing")
    for key in sorted(obj.keys() - required - optional):
        raise WorkloadError(f"{where}.{key}" if where else key, "unknown field")
    return obj


def from_json(data: Any) -> Workload:
    """Check a decoded workload file and build it; raises WorkloadError naming the first
    bad field (``jobs[3].turns[2].tool_time_s: ...``)."""
    top = _keys(data, "", {"format", "jobs"},
                {"name", "description", "max_output_tokens", "generator"})
    if top["format"] != FORMAT:
        raise WorkloadError("format", f"expected {FORMAT!r}, got {top['format']!r}")
    max_output = _integer(top.get("max_output_tokens", 150), "max_output_tokens", 1)
    name = top.get("name", "")
    if not isinstance(name, str):
        raise WorkloadError("name", "expected a string")
    generator = top.get("generator", {})
    if not isinstance(generator, dict):
        raise WorkloadError("generator", "expected an object")
    if not isinstance(top["jobs"], list) or not top["jobs"]:
        raise WorkloadError("jobs", "expected a non-empty list")
    jobs = []
    seen: set[str] = set()
    for j, raw_job in enumerate(top["jobs"]):
        where = f"jobs[{j}]"
        obj = _keys(raw_job, where, {"job_id", "arrival_s", "turns"}, {"script"})
        job_id = obj["job_id"]
        if not isinstance(job_id, str) or not job_id:
            raise WorkloadError(f"{where}.job_id", "expected a non-empty string")
        if job_id in seen:
            raise WorkloadError(f"{where}.job_id", f"duplicate {job_id!r}")
        seen.add(job_id)
        arrival_s = _number(obj["arrival_s"], f"{where}.arrival_s")
        script = obj.get("script")
        if script is not None and (not isinstance(script, str) or not script):
            raise WorkloadError(f"{where}.script", "expected a non-empty string or null")
        raw_turns = obj["turns"]
        if not isinstance(raw_turns, list) or not raw_turns:
            raise WorkloadError(f"{where}.turns", "expected a non-empty list")
        turns: list[Turn] = []
        for k, raw_turn in enumerate(raw_turns):
            at = f"{where}.turns[{k}]"
            t = _keys(raw_turn, at, {"prompt_tokens", "output_tokens", "is_last_step"},
                      {"tool", "tool_time_s", "answer"})
            prompt = _integer(t["prompt_tokens"], f"{at}.prompt_tokens", 1)
            output = _integer(t["output_tokens"], f"{at}.output_tokens", 1)
            if output > max_output:
                raise WorkloadError(f"{at}.output_tokens",
                                    f"{output} exceeds max_output_tokens {max_output}")
            if turns:
                context = turns[-1].prompt_tokens + turns[-1].output_tokens
                if prompt < context:
                    raise WorkloadError(
                        f"{at}.prompt_tokens",
                        f"{prompt} < previous turn's context {context} (prompt + output): "
                        "a turn's prompt must contain the previous turn's context")
            tool = t.get("tool")
            if tool is not None and (not isinstance(tool, str) or not tool):
                raise WorkloadError(f"{at}.tool", "expected a non-empty string or null")
            tool_time_s = _number(t.get("tool_time_s", 0.0), f"{at}.tool_time_s")
            last = t["is_last_step"]
            if not isinstance(last, bool):
                raise WorkloadError(f"{at}.is_last_step", f"expected true or false, got {last!r}")
            if last != (k == len(raw_turns) - 1):
                raise WorkloadError(f"{at}.is_last_step",
                                    "must be true on the job's last turn and only there")
            answer = t.get("answer")
            if answer is not None and (not isinstance(answer, str) or not answer):
                raise WorkloadError(f"{at}.answer", "expected a non-empty string or null")
            turns.append(Turn(prompt, output, tool, tool_time_s, last, answer))
        jobs.append(Job(job_id, arrival_s, tuple(turns), script))
    jobs.sort(key=lambda job: (job.arrival_s, job.job_id))
    return Workload(name=name, jobs=tuple(jobs), max_output_tokens=max_output,
                    description=str(top.get("description", "")), generator=generator)


# --- generators -------------------------------------------------------------------------

def poisson_arrivals(rng: random.Random, jobs_per_s: float, duration_s: float | None = None,
                     num_jobs: int | None = None) -> list[float]:
    """Arrival times of a Poisson process: exponential gaps of mean 1/jobs_per_s, until
    ``duration_s`` (the reference benchmark's loop) or for exactly ``num_jobs`` jobs."""
    if jobs_per_s <= 0:
        raise ValueError("jobs_per_s must be > 0")
    if (duration_s is None) == (num_jobs is None):
        raise ValueError("give exactly one of duration_s and num_jobs")
    arrivals: list[float] = []
    now = 0.0
    while True:
        now += rng.expovariate(jobs_per_s)
        if duration_s is not None and now > duration_s:
            return arrivals
        arrivals.append(now)
        if num_jobs is not None and len(arrivals) >= num_jobs:
            return arrivals


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One turn of a generated job: the prompt length it reaches, its answer's mean
    length, and the tool the answer calls."""

    prompt_tokens: int
    output_tokens_mean: int
    tool: str | None
    # Tool time: ("uniform", low_s, high_s) or ("lognormal", median_s, sigma).
    tool_time: tuple[str, float, float]
    # A short answer (one bash line) that jobs running the same script may give
    # word for word; a long one (a patch, a summary) is every job's own.
    short_answer: bool = True


# The reference A/B benchmark (reference/continuum-kv-pinning-verification.txt):
# per-turn average prompt tokens 92 ... 2915 (its output JSON), tools and tool times
# from its TOOL_TIME_DISTRIBUTIONS (turn 1 find/ls, 2-3 cat, 4 grep, 5 pytest 2-5 s,
# 6 cat, 7 patch). Answer lengths are not published: these means are fitted to FCFS's
# per-turn latencies at 8 jobs/s (``calibrate --fit``, benchmarks/twin/fit.py; FCFS
# only): a first answer with a plan (30), short bash blocks (9-17), the patch (60), a
# closing summary (19).
REFERENCE_TURNS: tuple[TurnSpec, ...] = (
    TurnSpec(92, 30, "ls", ("uniform", 0.05, 0.15)),
    TurnSpec(469, 9, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(811, 15, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(1343, 17, "grep", ("uniform", 0.08, 0.20)),
    TurnSpec(1655, 9, "pytest", ("uniform", 2.0, 5.0)),
    TurnSpec(2241, 10, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(2665, 60, "patch", ("uniform", 0.10, 0.30), short_answer=False),
    TurnSpec(2915, 19, None, ("uniform", 0.0, 0.0), short_answer=False),
)
# How often a job's short answer is the one most jobs give, fitted the same way: with
# jobs sharing nothing the reference's FCFS figures are out of a 5090's reach (README).
REFERENCE_ANSWER_AGREEMENT = 0.966

# A longer agent (SWE-style, 11 turns) with log-normal tool times: heavier tails, two
# test runs, a slow dependency install; context grows to ~3,500 tokens.
LONG_TURNS: tuple[TurnSpec, ...] = (
    TurnSpec(120, 12, "ls", ("lognormal", 0.08, 0.5)),
    TurnSpec(420, 12, "cat", ("lognormal", 0.06, 0.5)),
    TurnSpec(800, 16, "grep", ("lognormal", 0.15, 0.7)),
    TurnSpec(1150, 12, "cat", ("lognormal", 0.06, 0.5)),
    TurnSpec(1400, 14, "pip install", ("lognormal", 6.0, 0.6)),
    TurnSpec(1700, 10, "pytest", ("lognormal", 3.0, 0.8)),
    TurnSpec(2250, 120, "sed", ("lognormal", 0.05, 0.5), short_answer=False),
    TurnSpec(2500, 10, "pytest", ("lognormal", 3.0, 0.8)),
    TurnSpec(2950, 14, "git diff", ("lognormal", 0.1, 0.5)),
    TurnSpec(3200, 60, "python", ("lognormal", 1.0, 1.0), short_answer=False),
    TurnSpec(3500, 40, None, ("uniform", 0.0, 0.0), short_answer=False),
)

GENERATORS: dict[str, tuple[tuple[TurnSpec, ...], str]] = {
    "reference": (REFERENCE_TURNS, "the reference A/B benchmark's 8-turn agent"),
    "long": (LONG_TURNS, "an 11-turn SWE-style agent with log-normal tool times"),
}


def _tool_time_s(rng: random.Random, spec: tuple[str, float, float]) -> float:
    kind, p1, p2 = spec
    if kind == "uniform":
        return rng.uniform(p1, p2)
    if kind == "lognormal":
        return rng.lognormvariate(math.log(p1), p2)
    raise ValueError(f"unknown tool-time distribution {kind!r}")


def _answer_length(rng: random.Random, mean: int, spread: float, cap: int) -> int:
    if mean >= cap:
        return cap
    low = max(1, round(mean * (1 - spread)))
    high = max(low, round(mean * (1 + spread)))
    return min(cap, rng.randint(low, high))


def generate(kind: str, jobs_per_s: float, seed: int = 0, duration_s: float | None = 100.0,
             num_jobs: int | None = None, max_output_tokens: int = 150,
             output_spread: float = 0.5, answer_agreement: float = 0.0,
             answer_tokens: dict[int, int] | None = None,
             turns: Sequence[TurnSpec] | None = None) -> Workload:
    """A workload of ``kind`` ("reference" or "long") with Poisson arrivals.

    Answer lengths are uniform in mean * [1 - spread, 1 + spread] (capped at
    ``max_output_tokens``; ``answer_tokens`` {turn: mean} overrides the spec's means);
    each turn's new tokens bring its prompt to the spec's ``prompt_tokens`` (at least
    one new token), so one job's context grows as the reference's does.

    ``answer_agreement`` = 0 (default): every job is its own conversation and shares no
    token with any other. ``answer_agreement`` = p > 0: every job runs the same script
    (system prompt, task, canned tool outputs — as the reference benchmark's client
    does) and each short answer is, with probability p, the answer most jobs give
    (same tokens, same length); otherwise it is the job's own. Jobs whose answers have
    agreed so far share their whole context, which vLLM's prefix cache serves across
    jobs; after its first own answer a job's context is its own. Long answers (a
    patch, a summary) are always a job's own."""
    specs, description = GENERATORS[kind] if turns is None else (tuple(turns), "custom")
    if not 0.0 <= answer_agreement <= 1.0:
        raise ValueError("answer_agreement must be in [0, 1]")
    means = {k + 1: spec.output_tokens_mean for k, spec in enumerate(specs)}
    means.update(answer_tokens or {})
    if num_jobs is not None:
        duration_s = None
    # float(): 8 and 8.0 are the same load and must give the same arrivals.
    arrivals = poisson_arrivals(random.Random(f"arrivals:{seed}:{float(jobs_per_s)}"),
                                jobs_per_s,
                                duration_s=duration_s, num_jobs=num_jobs)
    jobs = []
    for index, arrival_s in enumerate(arrivals):
        job_id = f"job_{index:05d}"
        # Per-job randomness depends on (seed, job) only: the same job has the same turns
        # at every load.
        rng = random.Random(f"job:{seed}:{index}")
        built: list[Turn] = []
        on_script = answer_agreement > 0
        for k, spec in enumerate(specs):
            prompt = spec.prompt_tokens
            if built:
                prompt = max(prompt, built[-1].prompt_tokens + built[-1].output_tokens + 1)
            mean = means[k + 1]
            answer = None
            agrees = rng.random() < answer_agreement  # drawn always: same stream for all p
            on_script = on_script and spec.short_answer and agrees
            if on_script:
                answer = "common"
                # The common answer has the same length in every job.
                output = _answer_length(random.Random(f"answer:{seed}:{k}"), mean,
                                        output_spread, max_output_tokens)
            else:
                output = _answer_length(rng, mean, output_spread, max_output_tokens)
            last = k == len(specs) - 1
            built.append(Turn(prompt_tokens=prompt, output_tokens=output,
                              tool=None if last else spec.tool,
                              tool_time_s=0.0 if last else round(
                                  _tool_time_s(rng, spec.tool_time), 6),
                              is_last_step=last, answer=answer))
        jobs.append(Job(job_id, round(arrival_s, 6), tuple(built),
                        script=kind if answer_agreement > 0 else None))
    return Workload(
        name=f"{kind}-{jobs_per_s:g}jps-seed{seed}"
        + (f"-agree{answer_agreement:g}" if answer_agreement else ""),
        description=description,
        jobs=tuple(jobs),
        max_output_tokens=max_output_tokens,
        generator={"kind": kind, "jobs_per_s": jobs_per_s, "seed": seed,
                   "duration_s": duration_s, "num_jobs": num_jobs,
                   "output_spread": output_spread, "answer_agreement": answer_agreement,
                   "answer_tokens": means},
    )


def scaled(workload: Workload, tokens: float, tool_time: float,
           max_output_tokens: int) -> Workload:
    """``workload`` shrunk to a smaller engine, as the real-engine benchmark sends it
    (``benchmarks.engine``): every prompt and answer x ``tokens`` (answers at least 1
    and at most ``max_output_tokens``; a prompt at least one token past the context
    before it), every tool x ``tool_time``. Arrivals are kept. (The time a turn spends
    outside the engine is the twin's API server's: ``frontend.py``.)"""
    if tokens <= 0.0 or tool_time < 0.0 or max_output_tokens < 1:
        raise ValueError(f"scaled: tokens {tokens!r} must be > 0, tool_time {tool_time!r} "
                         f">= 0, max_output_tokens {max_output_tokens!r} >= 1")
    jobs = []
    for job in workload.jobs:
        turns, context = [], 0
        for turn in job.turns:
            prompt = max(context + 1, round(turn.prompt_tokens * tokens))
            output = max(1, min(max_output_tokens, round(turn.output_tokens * tokens)))
            wait_s = 0.0 if turn.is_last_step else turn.tool_time_s * tool_time
            turns.append(replace(turn, prompt_tokens=prompt, output_tokens=output,
                                 tool_time_s=round(wait_s, 6)))
            context = prompt + output
        jobs.append(replace(job, turns=tuple(turns)))
    return replace(workload, jobs=tuple(jobs), max_output_tokens=max_output_tokens,
                   name=f"{workload.name}-x{tokens:g}-tools-x{tool_time:g}",
                   generator={**workload.generator, "scaled": {
                       "tokens": tokens, "tool_time": tool_time,
                       "max_output_tokens": max_output_tokens}})


# --- token ids --------------------------------------------------------------------------

# Ids the simulated model writes: the stop token ends a turn that does not hit the cap
# (Llama 3's <|eot_id|>); content tokens avoid the special-token range.
STOP_TOKEN_ID = 128009
_CONTENT_LOW, _CONTENT_HIGH = 1000, 128000


def _random_tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    span = _CONTENT_HIGH - _CONTENT_LOW
    return [_CONTENT_LOW + rng.randrange(span) for _ in range(count)]


def job_tokens(job: Job, max_output_tokens: int) -> list[int]:
    """Every token of a job's final context, in order: turn k's prompt is the first
    ``prompt_tokens[k]`` of them and its answer the next ``output_tokens[k]``.

    A segment's tokens are drawn from a seed that names what it depends on: without a
    script, the job id (jobs share nothing); with one, the script and the answers so
    far (jobs that agree share everything up to their first different answer, after
    which each continues on its own)."""
    tokens: list[int] = []
    history = f"script:{job.script}" if job.script is not None else None
    for k, turn in enumerate(job.turns):
        owner = history if history is not None else f"job:{job.job_id}"
        tokens += _random_tokens(f"in:{owner}:{k}", turn.prompt_tokens - len(tokens))
        if history is not None and turn.answer is not None:
            history = f"{history}/{turn.answer}"
        else:
            history = None
        owner = history if history is not None else f"job:{job.job_id}"
        answer = _random_tokens(f"out:{owner}:{k}", turn.output_tokens)
        if turn.output_tokens < max_output_tokens:
            answer[-1] = STOP_TOKEN_ID
        tokens += answer
    return tokens
