"""The log-bucket sketch and the Normal-Inverse-Gamma posterior, against known answers."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.estimators.nig import NigPosterior, NigPrior, student_t_quantile
from sidecar.estimators.sketch import (
    MAX_DURATION_S,
    MIN_DURATION_S,
    LogBucketSketch,
    add_increments,
)

SKETCH = LogBucketSketch()  # 2 % relative accuracy
durations = st.floats(min_value=MIN_DURATION_S, max_value=MAX_DURATION_S)


def fields_of(samples: list[float], sketch: LogBucketSketch = SKETCH) -> dict[str, float]:
    fields: dict[str, float] = {}
    for sample in samples:
        add_increments(fields, sketch.increments(sample))
    return fields


def true_quantile(samples: list[float], q: float) -> float:
    """The sample the sketch's quantile targets: rank max(1, ceil(q * n))."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


# --- sketch --------------------------------------------------------------------------


def test_bucket_mapping_is_ddsketchs() -> None:
    gamma = SKETCH.gamma
    assert gamma == pytest.approx(1.02 / 0.98)
    assert SKETCH.bucket_index(1.0) == 0
    assert SKETCH.bucket_index(gamma) == 1  # gamma**(i-1) < d <= gamma**i
    assert SKETCH.bucket_index(gamma * 1.0001) == 2
    assert SKETCH.bucket_index(1 / gamma) == -1


@pytest.mark.parametrize("duration_s", [0.0, -3.0, float("-inf")])
def test_nonpositive_durations_are_clamped_not_fatal(duration_s: float) -> None:
    increments = SKETCH.increments(duration_s)
    assert increments["count"] == 1.0
    assert math.isfinite(increments["sum_log"])


def test_known_samples_read_back() -> None:
    samples = [0.1 * i for i in range(1, 101)]  # 0.1 .. 10 s
    dist = SKETCH.distribution("ls", fields_of(samples))
    assert dist is not None
    assert dist.count == 100
    assert dist.quantile(0.5) == pytest.approx(5.0, rel=0.02)
    assert dist.quantile(0.9) == pytest.approx(9.0, rel=0.02)
    # The bucket holding 5.0 s counts whole: up to one bucket width (4 %) of extra mass.
    assert 0.5 <= dist.probability_within(5.0) <= 0.52
    assert dist.probability_within(100.0) == 1.0
    assert dist.mean_log_s == pytest.approx(sum(math.log(s) for s in samples) / 100)


def test_empty_hash_has_no_distribution() -> None:
    assert SKETCH.distribution("x", {}) is None
    assert SKETCH.distribution("x", {"count": 0.0}) is None


def test_unknown_fields_are_ignored() -> None:
    fields = fields_of([1.0, 2.0])
    fields["b:not-an-int"] = 3.0
    fields["future_field"] = 7.0
    dist = SKETCH.distribution("x", fields)
    assert dist is not None and dist.count == 2


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(durations, min_size=1, max_size=200),
    q=st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]),
)
def test_quantiles_are_within_the_relative_accuracy(samples: list[float], q: float) -> None:
    dist = SKETCH.distribution("t", fields_of(samples))
    assert dist is not None
    expected = true_quantile(samples, q)
    assert abs(dist.quantile(q) - expected) <= 0.02 * expected * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(durations, min_size=1, max_size=100), seed=st.integers(0, 2**32))
def test_updates_commute(samples: list[float], seed: int) -> None:
    # Any interleaving of writers yields the same statistics: no update depends on
    # another, which is what makes concurrent HINCRBYFLOATs safe.
    shuffled = samples[:]
    random.Random(seed).shuffle(shuffled)
    a, b = fields_of(samples), fields_of(shuffled)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == pytest.approx(b[name], rel=1e-9, abs=1e-9)
    dist_a, dist_b = SKETCH.distribution("t", a), SKETCH.distribution("t", b)
    assert dist_a is not None and dist_b is not None
    assert dist_a.bucket_counts == dist_b.bucket_counts


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(durations, min_size=1, max_size=100), taus=st.lists(durations, min_size=2))
def test_probability_within_is_a_cdf(samples: list[float], taus: list[float]) -> None:
    dist = SKETCH.distribution("t", fields_of(samples))
    assert dist is not None
    probabilities = [dist.probability_within(tau) for tau in sorted(taus)]
    assert all(0.0 <= p <= 1.0 for p in probabilities)
    assert probabilities == sorted(probabilities)


def test_field_count_is_bounded() -> None:
    extreme = [MIN_DURATION_S / 10, MAX_DURATION_S * 10]
    indices = {SKETCH.bucket_index(d) for d in extreme}
    span = max(indices) - min(indices)
    assert span < 500  # a hash never grows past a few hundred fields


def test_accuracy_is_validated() -> None:
    with pytest.raises(ValueError, match="relative_accuracy"):
        LogBucketSketch(relative_accuracy=0.0)


# --- Student t and the NIG posterior ---------------------------------------------------


@pytest.mark.parametrize(
    ("df", "q", "expected"),
    [
        (1.0, 0.975, 12.7062),
        (2.0, 0.975, 4.3027),
        (4.0, 0.9, 1.5332),
        (10.0, 0.975, 2.2281),
        (30.0, 0.975, 2.0423),
        (100.0, 0.99, 2.3642),
        (5.0, 0.5, 0.0),
        (3.0, 0.05, -2.3534),
    ],
)
def test_student_t_quantiles_match_tables(df: float, q: float, expected: float) -> None:
    assert student_t_quantile(df, q) == pytest.approx(expected, abs=2e-4)


@settings(max_examples=60, deadline=None)
@given(df=st.floats(min_value=0.5, max_value=200.0), q=st.floats(min_value=0.01, max_value=0.99))
def test_student_t_is_symmetric_and_monotone(df: float, q: float) -> None:
    assert student_t_quantile(df, q) == pytest.approx(-student_t_quantile(df, 1 - q), abs=1e-6)
    assert student_t_quantile(df, min(q + 0.005, 0.995)) >= student_t_quantile(df, q)


def test_prior_predictive_quantile() -> None:
    prior = NigPrior()  # mu0 0, kappa0 1, alpha0 2, beta0 1
    posterior = NigPosterior.from_moments(prior, 0, 0.0, 0.0)
    scale = math.sqrt(1.0 * 2.0 / (2.0 * 1.0))
    assert posterior.predictive_quantile_s(0.9) == pytest.approx(math.exp(1.5332 * scale), rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-5.0, max_value=5.0), min_size=1, max_size=30))
def test_batch_posterior_equals_one_sample_at_a_time(logs: list[float]) -> None:
    prior = NigPrior(mean_log_s=0.3, kappa=2.0, alpha=1.5, beta=0.7)
    batch = NigPosterior.from_moments(prior, len(logs), sum(logs), sum(x * x for x in logs))
    current = prior
    for x in logs:
        step = NigPosterior.from_moments(current, 1, x, x * x)
        current = NigPrior(step.mean_log_s, step.kappa, step.alpha, step.beta)
    assert batch.mean_log_s == pytest.approx(current.mean_log_s, abs=1e-9)
    assert batch.kappa == pytest.approx(current.kappa)
    assert batch.alpha == pytest.approx(current.alpha)
    assert batch.beta == pytest.approx(current.beta, rel=1e-9, abs=1e-9)


def test_posterior_learns_a_lognormal_from_the_sketch() -> None:
    rng = random.Random(3)
    samples = [math.exp(rng.gauss(math.log(2.0), 0.5)) for _ in range(2000)]
    dist = SKETCH.distribution("t", fields_of(samples))
    posterior = NigPosterior.from_distribution(NigPrior(), dist)
    assert posterior.predictive_quantile_s(0.5) == pytest.approx(2.0, rel=0.05)
    assert posterior.predictive_quantile_s(0.9) == pytest.approx(
        2.0 * math.exp(1.2816 * 0.5), rel=0.05
    )


def test_prior_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="alpha"):
        NigPrior(alpha=0.0)
