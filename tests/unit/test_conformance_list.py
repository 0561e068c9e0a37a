"""The conformance run's list of expected differences (scripts/conformance.py): what it
accepts, what it refuses, and how a run is judged against it."""

from __future__ import annotations

import pytest

from scripts.conformance import (
    EXPECTED,
    MODE_NAMES,
    ExpectedListError,
    RunResult,
    judge,
    parse_expected,
    releases_to_run,
    report,
)
from tests.support.engine import requires_vllm

RELEASES = ("0.32.0", "0.33.0")
FILE = "tests/v1/core/test_scheduler.py"


def entries(text: str) -> list:
    return parse_expected(text, RELEASES, "list")


def run(mode: str = "fcfs", release: str = "0.32.0", **outcomes: str) -> RunResult:
    return RunResult(release, mode, {
        f"{FILE}::{name}": {"outcome": outcome, "message": f"{name} message"}
        for name, outcome in outcomes.items()}, seconds=1.0)


@requires_vllm
def test_the_committed_list_parses() -> None:
    parse_expected(EXPECTED.read_text(), releases_to_run(), str(EXPECTED))


def test_an_entry_without_a_reason_is_refused() -> None:
    with pytest.raises(ExpectedListError, match=r"difference #1 \(.*::test_a\): reason"):
        entries(f'[[difference]]\ntests = ["{FILE}::test_a"]\n')
    with pytest.raises(ExpectedListError, match="reason"):
        entries(f'[[difference]]\ntests = ["{FILE}::test_a"]\nreason = "  "\n')


def test_a_todo_reason_from_the_report_is_refused() -> None:
    with pytest.raises(ExpectedListError, match="still TODO"):
        entries(f'[[difference]]\ntests = ["{FILE}::test_a"]\nreason = "TODO: boom"\n')


@pytest.mark.parametrize(("field", "value", "message"), [
    ("modes", '["fcfs-open"]', r"modes: 'fcfs-open' is not one of no-daemon"),
    ("releases", '["0.31.0"]', r"releases: '0.31.0' is not one of 0.32.0, 0.33.0"),
    ("modes", "[]", "modes: expected a non-empty list"),
    ("why", '"x"', "unknown field 'why'"),
])
def test_bad_fields_are_named(field: str, value: str, message: str) -> None:
    with pytest.raises(ExpectedListError, match=message):
        entries(f'[[difference]]\ntests = ["{FILE}::test_a"]\nreason = "r"\n{field} = {value}\n')


def test_a_test_that_is_not_a_node_id_or_listed_twice_is_refused() -> None:
    with pytest.raises(ExpectedListError, match="tests: expected a list of pytest node ids"):
        entries('[[difference]]\ntests = ["test_a"]\nreason = "r"\n')
    with pytest.raises(ExpectedListError, match="tests: expected a list"):
        entries(f'[[difference]]\ntests = "{FILE}::test_a"\nreason = "r"\n')
    twice = f'[[difference]]\ntests = ["{FILE}::test_a"]\nreason = "r"\nmodes = ["fcfs"]\n'
    with pytest.raises(ExpectedListError, match=r"test_a is listed twice for vLLM 0.32.0 in "
                                                r"mode fcfs \(differences #1 and #2\)"):
        entries(twice + twice.replace('["fcfs"]', '["fcfs", "no-daemon"]'))


def test_listed_failures_are_expected_and_anything_else_is_unexpected() -> None:
    listed = entries(f'[[difference]]\ntests = ["{FILE}::test_listed"]\nreason = "r"\n'
                     f'modes = ["fcfs"]\n')
    verdict = judge(run(test_listed="failed", test_ok="passed", test_new="failed",
                        test_skipped="skipped"), listed)
    assert (verdict.passed, verdict.expected) == (1, 1)
    assert verdict.unexpected == [f"{FILE}::test_new failed: test_new message",
                                  f"{FILE}::test_skipped skipped: test_skipped message"]
    # The entry is for fcfs only: in another mode the same failure is unexpected.
    assert len(judge(run("no-daemon", test_listed="failed"), listed).unexpected) == 1


def test_a_stale_entry_fails() -> None:
    listed = entries(f'[[difference]]\ntests = ["{FILE}::test_fixed"]\nreason = "r"\n'
                     f'[[difference]]\ntests = ["{FILE}::test_gone"]\nreason = "r"\n')
    verdict = judge(run(test_fixed="passed"), listed)
    assert [line.split(" ")[0:2] for line in verdict.unexpected] == [
        [f"{FILE}::test_fixed", "passed"], [f"{FILE}::test_gone", "is"]]


def test_an_entry_without_parameters_covers_each_parametrisation() -> None:
    listed = entries(f'[[difference]]\ntests = ["{FILE}::test_p"]\nreason = "r"\n')
    verdict = judge(run(**{"test_p[1]": "failed", "test_p[2]": "passed"}), listed)
    assert verdict.expected == 1 and "test_p[2] passed" in verdict.unexpected[0]


def test_the_report_reads_back_as_the_list() -> None:
    listed = entries(f'[[difference]]\ntests = ["{FILE}::test_a"]\nreason = "kept"\n')
    results = [run(mode, release, **{"test_a[x]": "failed", "test_b": "passed"})
               for release in RELEASES for mode in MODE_NAMES]
    results.append(run("fcfs", "0.33.0", test_c="error", test_d="failed"))
    text = report(results, listed, RELEASES)
    assert 'reason = "TODO: error: test_c message"' in text
    with pytest.raises(ExpectedListError, match="still TODO"):
        entries(text)
    again = entries(text.replace("TODO: ", ""))
    assert [(e.tests, e.releases, e.modes, e.reason) for e in again] == [
        ((f"{FILE}::test_a",), RELEASES, MODE_NAMES, "kept"),
        ((f"{FILE}::test_c",), ("0.33.0",), ("fcfs",), "error: test_c message"),
        ((f"{FILE}::test_d",), ("0.33.0",), ("fcfs",), "failed: test_d message"),
    ]
