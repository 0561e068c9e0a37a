"""What every benchmark reports with: one percentile, exact Student-t bounds, one shape
of result file."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.common.results import describe_machine, write_result
from benchmarks.common.stats import estimate, percentile, t_quantile

TWENTY = [0.8, 1.9, 0.3, 4.2, 2.2, 1.1, 0.9, 3.3, 2.8, 0.4,
          1.5, 5.6, 0.7, 2.1, 1.2, 0.6, 3.9, 1.8, 2.6, 1.0]


@pytest.mark.parametrize(("q", "expected"), [(0.0, 1.0), (0.5, 2.5), (0.9, 3.7), (1.0, 4.0)])
def test_the_percentile_interpolates_between_closest_ranks(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_the_percentile_is_the_standard_one() -> None:
    """numpy's default, statistics.quantiles(method="inclusive"), R's type 7: a reader's
    own check of a figure gets it back."""
    assert percentile(TWENTY, 0.5) == statistics.median(TWENTY)
    deciles = statistics.quantiles(TWENTY, n=10, method="inclusive")
    assert [percentile(TWENTY, k / 10) for k in range(1, 10)] == pytest.approx(deciles)
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError, match="quantile"):
        percentile(TWENTY, 50)


@pytest.mark.parametrize(("degrees", "table"), [(1, 12.706), (2, 4.303), (10, 2.228),
                                                (30, 2.042), (1000, 1.962)])
def test_the_t_quantile_is_exact(degrees: int, table: float) -> None:
    assert t_quantile(degrees, 0.975) == pytest.approx(table, abs=5e-4)


def test_the_upper_bound_of_two_rounds_uses_t_at_one_degree() -> None:
    bound = estimate([1.0, 1.2])
    assert bound.stderr == pytest.approx(0.1)
    assert bound.upper95 == pytest.approx(1.1 + 6.314 * 0.1, abs=1e-3)
    assert estimate([1.0]).upper95 == math.inf, "one round bounds nothing"
    assert t_quantile(0, 0.95) == math.inf


def test_a_result_says_what_it_was_measured_on(tmp_path: Path) -> None:
    path = tmp_path / "out" / "result.json"
    written = write_result(path, {"command": "python -m benchmarks.x", "rows": [1, 2]})
    document = json.loads(path.read_text())
    assert document == written
    assert list(document)[:4] == ["kvtether_git_rev", "python", "machine", "date_utc"]
    assert document["machine"]["cpus"] >= 1
    assert document["rows"] == [1, 2]
    assert str(document["machine"]["cpus"]) in describe_machine(document["machine"])
    with pytest.raises(ValueError, match="machine"):
        write_result(path, {"machine": "x86_64, 2 cores"})
