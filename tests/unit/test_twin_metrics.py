"""The twin's result figures: percentiles as numpy computes them, TTFT histogram shape."""

from __future__ import annotations

import pytest

from benchmarks.twin.metrics import TTFT_BUCKETS_MS, histogram, percentile


@pytest.mark.parametrize(("q", "expected"), [(0, 1.0), (50, 2.5), (90, 3.7), (100, 4.0)])
def test_percentile_interpolates_linearly(q: float, expected: float) -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_histogram_has_a_fixed_shape_and_counts_everything() -> None:
    counts = histogram([10, 50, 51, 250_000], TTFT_BUCKETS_MS)
    keys = list(counts)
    assert keys[0] == "<=50" and keys[-1] == ">100000"
    assert counts["<=50"] == 2 and counts["<=100"] == 1 and counts[">100000"] == 1
    assert sum(counts.values()) == 4
