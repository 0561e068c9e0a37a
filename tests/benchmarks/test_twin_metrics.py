"""The twin's result figures: the TTFT histogram's shape."""

from __future__ import annotations

from benchmarks.twin.metrics import TTFT_BUCKETS_MS, histogram


def test_histogram_has_a_fixed_shape_and_counts_everything() -> None:
    counts = histogram([10, 50, 51, 250_000], TTFT_BUCKETS_MS)
    keys = list(counts)
    assert keys[0] == "<=50" and keys[-1] == ">100000"
    assert counts["<=50"] == 2 and counts["<=100"] == 1 and counts[">100000"] == 1
    assert sum(counts.values()) == 4
