"""A long benchmark's progress: one readable line a round on stderr when stderr is not
a terminal (a log file, CI), a bar when it is; stdout, where results go, untouched."""

from __future__ import annotations

import io
import re

import pytest

from benchmarks.common.progress import Progress, progress_line


def test_a_round_line_says_where_the_run_is_and_what_is_left() -> None:
    assert progress_line("engine fcfs round 1/3", 12, 48, "turn", 30.0,
                         "average job 3.1 s") == \
        "engine fcfs round 1/3: 12/48 turns, 30 s elapsed, ~90 s left: average job 3.1 s"
    assert progress_line("soak", 3.02, 10, "min", 181.0, "2400 reports/s") == \
        "soak: 3/10 min, 3 min elapsed, ~7 min left: 2400 reports/s"
    assert progress_line("twin sweep reference", 40, 40, "point", 9000.0) == \
        "twin sweep reference: 40/40 points, 2.5 h elapsed"


def test_without_a_terminal_each_round_is_one_line_on_its_stream(
        capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    with Progress("memory soak", total=3, unit="cycle", stream=stream) as progress:
        for cycle in range(3):
            progress.update(0.5)  # work within a round prints nothing
            progress.round_done(f"{(cycle + 1) * 5} engines", advance=0.5)

    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 3
    pattern = re.compile(r"memory soak: (\d)/3 cycles, \d+ s elapsed(, ~\d+ s left)?: "
                         r"(\d+) engines")
    matches = [pattern.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert [(m.group(1), m.group(3)) for m in matches if m] == \
        [("1", "5"), ("2", "10"), ("3", "15")]
    assert capsys.readouterr().out == ""


def test_on_a_terminal_a_bar_with_each_round_noted_above_it() -> None:
    stream = io.StringIO()
    with Progress("twin sweep quick", total=2, unit="point", stream=stream,
                  tty=True) as progress:
        progress.round_done("blocks=5402 fcfs 2 jps: avg 41.2 s", advance=1)
        progress.round_done("blocks=5402 adaptive 2 jps: avg 30.8 s", advance=1)

    text = stream.getvalue()
    assert "\r" in text  # the bar redraws in place
    assert "blocks=5402 fcfs 2 jps: avg 41.2 s\n" in text
    assert "twin sweep quick" in text and "2/2" in text
