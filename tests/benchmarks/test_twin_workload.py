"""The twin's workloads: the reference generator, token ids, arrivals, the file format."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks.twin import workload as wl

REFERENCE_PROMPTS = [92, 469, 811, 1343, 1655, 2241, 2665, 2915]


@pytest.fixture(scope="module")
def reference() -> wl.Workload:
    return wl.generate("reference", 2.0, seed=3, num_jobs=40)


def test_reference_turn_prompts_grow_as_the_reference_benchmark(reference: wl.Workload) -> None:
    for job in reference.jobs:
        assert [t.prompt_tokens for t in job.turns] == REFERENCE_PROMPTS
        for before, after in zip(job.turns, job.turns[1:], strict=False):
            # Each prompt holds the previous context (prompt + answer) and new tokens.
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
        assert all(1 <= t.output_tokens <= 150 for t in job.turns)
        assert [t.is_last_step for t in job.turns] == [False] * 7 + [True]


def test_reference_tools_and_tool_times(reference: wl.Workload) -> None:
    for job in reference.jobs:
        assert [t.tool for t in job.turns] == ["ls", "cat", "cat", "grep", "pytest", "cat",
                                               "patch", None]
        times = [t.tool_time_s for t in job.turns]
        assert 2.0 <= times[4] <= 5.0  # the test run
        assert all(0.05 <= s <= 0.3 for i, s in enumerate(times[:7]) if i != 4)
        assert times[7] == 0.0


def test_one_jobs_turns_share_their_prefix_and_jobs_share_nothing(
        reference: wl.Workload) -> None:
    streams = [wl.job_tokens(job, reference.max_output_tokens) for job in reference.jobs]
    for job, tokens in zip(reference.jobs, streams, strict=True):
        assert len(tokens) == job.turns[-1].prompt_tokens + job.turns[-1].output_tokens
        for turn in job.turns:
            if turn.output_tokens < 150:  # a stopped answer ends with the stop token
                assert tokens[turn.prompt_tokens + turn.output_tokens - 1] == wl.STOP_TOKEN_ID
    # Distinct from the first block (vLLM hashes 16-token blocks, chained).
    firsts = {tuple(tokens[:16]) for tokens in streams}
    assert len(firsts) == len(streams)
    # The same job always gets the same tokens.
    assert wl.job_tokens(reference.jobs[0], 150) == streams[0]


def test_agreeing_jobs_share_context_until_their_first_own_answer() -> None:
    shared = wl.generate("reference", 2.0, seed=1, num_jobs=30, answer_agreement=0.8)
    jobs = shared.jobs
    streams = [wl.job_tokens(job, 150) for job in jobs]

    def agreed_turns(job: wl.Job) -> int:
        count = 0
        for turn in job.turns:
            if turn.answer is None:
                break
            count += 1
        return count

    a, b = jobs[0], jobs[1]
    common = min(agreed_turns(a), agreed_turns(b))
    # Both gave the common answer to the first `common` turns: the next prompt is shared.
    shared_tokens = a.turns[common].prompt_tokens
    assert streams[0][:shared_tokens] == streams[1][:shared_tokens]
    # Long answers are every job's own: nothing after turn 7's prompt is shared.
    for i, j in ((0, 1), (2, 3)):
        start = jobs[i].turns[6].prompt_tokens
        assert streams[i][start:start + 16] != streams[j][start:start + 16]


def test_arrivals_are_poisson_with_the_given_rate() -> None:
    rate = 8.0
    arrivals = wl.poisson_arrivals(random.Random(5), rate, duration_s=500.0)
    # Count: mean rate * T, standard deviation sqrt(rate * T) (4 sigma band).
    assert abs(len(arrivals) - rate * 500) < 4 * math.sqrt(rate * 500)
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)
    assert len(wl.poisson_arrivals(random.Random(5), rate, num_jobs=756)) == 756


def test_the_same_job_is_the_same_at_every_load() -> None:
    low = wl.generate("reference", 1.0, seed=2, num_jobs=5)
    high = wl.generate("reference", 12.0, seed=2, num_jobs=5)
    assert [j.turns for j in low.jobs] == [j.turns for j in high.jobs]
    assert [j.arrival_s for j in low.jobs] != [j.arrival_s for j in high.jobs]


def test_long_workload_has_eleven_turns_and_lognormal_tool_times() -> None:
    long = wl.generate("long", 4.0, seed=0, num_jobs=200)
    assert {len(j.turns) for j in long.jobs} == {11}
    assert long.max_context_tokens < 4096
    installs = [j.turns[4].tool_time_s for j in long.jobs]
    # Median 6 s, log-normal: the median of logs is log(6), a long right tail.
    assert math.exp(statistics.median(math.log(s) for s in installs)) == pytest.approx(6, rel=0.2)
    assert max(installs) > 2 * statistics.median(installs)


# --- the file format ------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path: Path) -> None:
    original = wl.generate("reference", 2.0, seed=0, num_jobs=3, answer_agreement=0.5)
    path = tmp_path / "w.json"
    original.save(path)
    loaded = wl.load(path)
    assert loaded.jobs == original.jobs
    assert loaded.max_output_tokens == 150


def _valid() -> dict[str, Any]:
    return json.loads(json.dumps(wl.generate("reference", 2.0, seed=0, num_jobs=2).to_json()))


def _break(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(_valid())
    node: Any = data
    *parents, leaf = path.replace("[", ".").replace("]", "").split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is _DELETE:
        del node[leaf]
    elif leaf.isdigit():
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "field", "problem"),
    [
        ("format", "v0", "format", "expected"),
        ("jobs", [], "jobs", "non-empty"),
        ("jobs[1].job_id", "job_00000", "jobs[1].job_id", "duplicate"),
        ("jobs[0].arrival_s", -1, "jobs[0].arrival_s", ">= 0"),
        ("jobs[0].turns[2].tool_time_s", -0.5, "jobs[0].turns[2].tool_time_s", ">= 0"),
        ("jobs[0].turns[2].tool_time_s", "fast", "jobs[0].turns[2].tool_time_s", "number"),
        ("jobs[0].turns[3].prompt_tokens", 100, "jobs[0].turns[3].prompt_tokens",
         "previous turn's context"),
        ("jobs[0].turns[1].output_tokens", 151, "jobs[0].turns[1].output_tokens",
         "max_output_tokens"),
        ("jobs[0].turns[1].output_tokens", 0, "jobs[0].turns[1].output_tokens", ">= 1"),
        ("jobs[0].turns[7].is_last_step", False, "jobs[0].turns[7].is_last_step", "last turn"),
        ("jobs[0].turns[0].is_last_step", 1, "jobs[0].turns[0].is_last_step", "true or false"),
        ("jobs[0].turns[0].tool", "", "jobs[0].turns[0].tool", "non-empty"),
        ("jobs[0].turns[0].prompt", 5, "jobs[0].turns[0].prompt", "unknown field"),
        ("jobs[1].turns[0].prompt_tokens", _DELETE, "jobs[1].turns[0].prompt_tokens", "missing"),
    ],
)
def test_a_bad_field_is_named(path: str, value: Any, field: str, problem: str) -> None:
    with pytest.raises(wl.WorkloadError, match=problem) as caught:
        wl.from_json(_break(path, value))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_a_minimal_hand_written_trace_is_valid() -> None:
    trace = {"format": wl.FORMAT, "jobs": [{"job_id": "a", "arrival_s": 0, "turns": [
        {"prompt_tokens": 50, "output_tokens": 10, "tool": "ls", "tool_time_s": 0.1,
         "is_last_step": False},
        {"prompt_tokens": 80, "output_tokens": 5, "is_last_step": True}]}]}
    loaded = wl.from_json(trace)
    assert loaded.jobs[0].turns[1].tool is None and loaded.max_context_tokens == 85


# --- scaled: the real-engine benchmark's workload -----------------------------------


def _engine_formula(job: wl.Job, scale: float, time_scale: float, max_output: int
                    ) -> list[tuple[int, int, float]]:
    """How benchmarks.engine scaled a turn before it used ``scaled`` (prompt target,
    max_tokens, sleep), its answers exactly max_tokens long (ignore_eos)."""
    turns, context = [], 0
    for turn in job.turns:
        target = max(context + 1, round(turn.prompt_tokens * scale))
        output = max(1, min(max_output, round(turn.output_tokens * scale)))
        turns.append((target, output,
                      0.0 if turn.is_last_step else turn.tool_time_s * time_scale))
        context = target + output
    return turns


def test_scaled_is_what_the_engine_benchmark_sends(reference: wl.Workload) -> None:
    small = wl.scaled(reference, 0.6, 0.5, 48)
    assert [j.arrival_s for j in small.jobs] == [j.arrival_s for j in reference.jobs]
    for job, before in zip(small.jobs, reference.jobs, strict=True):
        engine = _engine_formula(before, 0.6, 0.5, 48)
        assert [(t.prompt_tokens, t.output_tokens) for t in job.turns] == [
            (prompt, output) for prompt, output, _ in engine]
        assert [t.tool_time_s for t in job.turns] == pytest.approx(
            [sleep_s for _, _, sleep_s in engine], abs=1e-6)
        for previous, turn in itertools.pairwise(job.turns):
            assert turn.prompt_tokens >= previous.prompt_tokens + previous.output_tokens + 1
        assert all(1 <= t.output_tokens <= 48 for t in job.turns)
        # The twin can build its tokens: a turn's prompt is the context so far.
        assert len(wl.job_tokens(job, small.max_output_tokens)) == (
            job.turns[-1].prompt_tokens + job.turns[-1].output_tokens)


@pytest.mark.parametrize(("args", "named"), [
    ((0.0, 0.5, 48), "tokens 0.0"), ((0.6, -1.0, 48), "tool_time -1.0"),
    ((0.6, 0.5, 0), "max_output_tokens 0"),
])
def test_scaled_names_a_bad_argument(reference: wl.Workload, args: tuple[Any, ...],
                                     named: str) -> None:
    with pytest.raises(ValueError, match=named):
        wl.scaled(reference, *args)
