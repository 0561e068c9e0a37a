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
from dataclasses import asdict, dataclass, field
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


@dataclass(frozen=True, slots=True)
class Job:
    job_id: str
    arrival_s: float
    turns: tuple[Turn, ...]


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
            "jobs": [{"job_id": j.job_id, "arrival_s": round(j.arrival_s, 6),
                      "turns": [asdict(t) for t in j.turns]} for j in self.jobs],
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @property
    def max_context_tokens(self) -> int:
        return max((t.prompt_tokens + t.output_tokens for j in self.jobs for t in j.turns),
                   default=0)


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
        obj = _keys(raw_job, where, {"job_id", "arrival_s", "turns"}, set())
        job_id = obj["job_id"]
        if not isinstance(job_id, str) or not job_id:
            raise WorkloadError(f"{where}.job_id", "expected a non-empty string")
        if job_id in seen:
            raise WorkloadError(f"{where}.job_id", f"duplicate {job_id!r}")
        seen.add(job_id)
        arrival_s = _number(obj["arrival_s"], f"{where}.arrival_s")
        raw_turns = obj["turns"]
        if not isinstance(raw_turns, list) or not raw_turns:
            raise WorkloadError(f"{where}.turns", "expected a non-empty list")
        turns: list[Turn] = []
        for k, raw_turn in enumerate(raw_turns):
            at = f"{where}.turns[{k}]"
            t = _keys(raw_turn, at, {"prompt_tokens", "output_tokens", "is_last_step"},
                      {"tool", "tool_time_s"})
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
            turns.append(Turn(prompt, output, tool, tool_time_s, last))
        jobs.append(Job(job_id, arrival_s, tuple(turns)))
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
    """One turn of a generated job: the mean prompt length it reaches, its answer's
    length, and the tool the answer calls."""

    prompt_tokens: int
    output_tokens_mean: int
    tool: str | None
    # Tool time: ("uniform", low_s, high_s) or ("lognormal", median_s, sigma).
    tool_time: tuple[str, float, float]


# The reference A/B benchmark (reference/continuum-kv-pinning-verification.txt):
# per-turn average prompt tokens 92 ... 2915 (its output JSON), tools and tool times
# from its TOOL_TIME_DISTRIBUTIONS (turn 1 find/ls, 2-3 cat, 4 grep, 5 pytest 2-5 s,
# 6 cat, 7 patch). Output lengths are not published: turn 7 writes the patch (the
# 150-token cap, as its 3.7 s latency at 8 jobs/s shows); the other turns answer with
# one short bash block. These are workload facts set once in the FCFS calibration.
REFERENCE_TURNS: tuple[TurnSpec, ...] = (
    TurnSpec(92, 10, "ls", ("uniform", 0.05, 0.15)),
    TurnSpec(469, 10, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(811, 10, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(1343, 12, "grep", ("uniform", 0.08, 0.20)),
    TurnSpec(1655, 8, "pytest", ("uniform", 2.0, 5.0)),
    TurnSpec(2241, 10, "cat", ("uniform", 0.05, 0.10)),
    TurnSpec(2665, 150, "patch", ("uniform", 0.10, 0.30)),
    TurnSpec(2915, 24, None, ("uniform", 0.0, 0.0)),
)

# A longer agent (SWE-style, 11 turns) with log-normal tool times: heavier tails, two
# test runs, a slow dependency install; context grows to ~3,500 tokens.
LONG_TURNS: tuple[TurnSpec, ...] = (
    TurnSpec(120, 20, "ls", ("lognormal", 0.08, 0.5)),
    TurnSpec(420, 20, "cat", ("lognormal", 0.06, 0.5)),
    TurnSpec(800, 28, "grep", ("lognormal", 0.15, 0.7)),
    TurnSpec(1150, 20, "cat", ("lognormal", 0.06, 0.5)),
    TurnSpec(1400, 24, "pip install", ("lognormal", 6.0, 0.6)),
    TurnSpec(1700, 16, "pytest", ("lognormal", 3.0, 0.8)),
    TurnSpec(2250, 120, "sed", ("lognormal", 0.05, 0.5)),
    TurnSpec(2500, 16, "pytest", ("lognormal", 3.0, 0.8)),
    TurnSpec(2950, 24, "git diff", ("lognormal", 0.1, 0.5)),
    TurnSpec(3200, 60, "python", ("lognormal", 1.0, 1.0)),
    TurnSpec(3500, 40, None, ("uniform", 0.0, 0.0)),
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


def generate(kind: str, jobs_per_s: float, seed: int = 0, duration_s: float | None = 100.0,
             num_jobs: int | None = None, max_output_tokens: int = 150,
             output_spread: float = 0.5, turns: Sequence[TurnSpec] | None = None) -> Workload:
    """A workload of ``kind`` ("reference" or "long") with Poisson arrivals.

    Each answer's length is uniform in mean * [1 - spread, 1 + spread] (capped at
    ``max_output_tokens``); the new tokens of turn k+1 make its prompt exactly the
    spec's ``prompt_tokens`` (at least one new token), so prompt lengths per turn are
    the spec's and one job's context grows as the reference's does."""
    specs, description = GENERATORS[kind] if turns is None else (tuple(turns), "custom")
    if num_jobs is not None:
        duration_s = None
    arrivals = poisson_arrivals(random.Random(f"arrivals:{seed}:{jobs_per_s}"), jobs_per_s,
                                duration_s=duration_s, num_jobs=num_jobs)
    jobs = []
    for index, arrival_s in enumerate(arrivals):
        job_id = f"job_{index:05d}"
        # Per-job randomness depends on (seed, job) only: the same job has the same turns
        # at every load.
        rng = random.Random(f"job:{seed}:{index}")
        built: list[Turn] = []
        for k, spec in enumerate(specs):
            prompt = spec.prompt_tokens
            if built:
                prompt = max(prompt, built[-1].prompt_tokens + built[-1].output_tokens + 1)
            low = max(1, round(spec.output_tokens_mean * (1 - output_spread)))
            high = max(low, round(spec.output_tokens_mean * (1 + output_spread)))
            output = min(max_output_tokens, rng.randint(low, high))
            if spec.output_tokens_mean >= max_output_tokens:
                output = max_output_tokens
            last = k == len(specs) - 1
            built.append(Turn(prompt_tokens=prompt, output_tokens=output,
                              tool=None if last else spec.tool,
                              tool_time_s=0.0 if last else round(
                                  _tool_time_s(rng, spec.tool_time), 6),
                              is_last_step=last))
        jobs.append(Job(job_id, arrival_s, tuple(built)))
    return Workload(
        name=f"{kind}-{jobs_per_s:g}jps-seed{seed}",
        description=description,
        jobs=tuple(jobs),
        max_output_tokens=max_output_tokens,
        generator={"kind": kind, "jobs_per_s": jobs_per_s, "seed": seed,
                   "duration_s": duration_s, "num_jobs": num_jobs,
                   "output_spread": output_spread},
    )


# --- token ids --------------------------------------------------------------------------

# Ids the simulated model writes: the stop token ends a turn that does not hit the cap
# (Llama 3's <|eot_id|>); content tokens avoid the special-token range.
STOP_TOKEN_ID = 128009
_CONTENT_LOW, _CONTENT_HIGH = 1000, 128000


def job_tokens(job: Job, max_output_tokens: int) -> list[int]:
    """Every token of a job's final context, in order: turn k's prompt is the first
    ``prompt_tokens[k]`` of them and its answer the next ``output_tokens[k]``. Random per
    job id (so jobs share no prefix) and fixed for it (so its turns share theirs)."""
    last = job.turns[-1]
    length = last.prompt_tokens + last.output_tokens
    rng = random.Random(f"tokens:{job.job_id}")
    span = _CONTENT_HIGH - _CONTENT_LOW
    tokens = [_CONTENT_LOW + rng.randrange(span) for _ in range(length)]
    for turn in job.turns:
        if turn.output_tokens < max_output_tokens:
            tokens[turn.prompt_tokens + turn.output_tokens - 1] = STOP_TOKEN_ID
    return tokens
