"""Bayesian duration estimate: a Normal-Inverse-Gamma posterior on log durations.

Model: ``x = ln(duration_s)`` is Normal(mu, sigma^2) with the conjugate prior
``sigma^2 ~ InvGamma(alpha0, beta0)`` and ``mu | sigma^2 ~ Normal(mu0, sigma^2 / kappa0)``.
From ``n`` samples with mean ``m`` and sum of squared deviations ``S`` (Murphy, "Conjugate
Bayesian analysis of the Gaussian distribution", 2007, section 6)::

    kappa_n = kappa0 + n
    mu_n    = (kappa0 * mu0 + n * m) / kappa_n
    alpha_n = alpha0 + n / 2
    beta_n  = beta0 + S / 2 + kappa0 * n * (m - mu0)^2 / (2 * kappa_n)

The posterior predictive of the next ``x`` is Student-t with ``2 * alpha_n`` degrees of
freedom, location ``mu_n`` and scale ``sqrt(beta_n * (kappa_n + 1) / (alpha_n * kappa_n))``;
its quantile, exponentiated, is a duration quantile that is honest about how few
samples there are (wide at cold start, tightening as samples come in).

The inputs are exactly what the log-bucket sketch keeps (count, sum and sum of squares
of log durations), so the posterior needs no extra storage.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

from sidecar.framework.types import ToolTimeDistribution

# Above this many degrees of freedom the Cornish-Fisher expansion of the t quantile is
# accurate to better than 1e-5 relative, and exact inversion (cached per df) would miss
# its cache on nearly every new sample.
_EXPANSION_MIN_DF = 30.0
_STANDARD_NORMAL = NormalDist()


@dataclass(frozen=True, slots=True)
class NigPrior:
    """Cold-start prior on log durations. Defaults: median duration 1 s (``mu0 = 0``),
    worth one sample (``kappa0 = 1``), and a prior mean of sigma^2 of
    ``beta0 / (alpha0 - 1) = 1`` (durations spread by a factor of about e), held
    loosely (``alpha0 = 2``, i.e. two pseudo-samples' worth of variance evidence)."""

    mean_log_s: float = 0.0
    kappa: float = 1.0
    alpha: float = 2.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.mean_log_s):
            raise ValueError("prior mean_log_s must be finite")
        for name in ("kappa", "alpha", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"prior {name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class NigPosterior:
    mean_log_s: float
    kappa: float
    alpha: float
    beta: float

    @staticmethod
    def from_moments(prior: NigPrior, count: int, sum_log: float, sumsq_log: float) -> NigPosterior:
        """Posterior after ``count`` samples with the given sums of ln(duration_s)."""
        if count <= 0:
            return NigPosterior(prior.mean_log_s, prior.kappa, prior.alpha, prior.beta)
        mean = sum_log / count
        squared_deviations = max(sumsq_log - count * mean * mean, 0.0)
        kappa_n = prior.kappa + count
        return NigPosterior(
            mean_log_s=(prior.kappa * prior.mean_log_s + count * mean) / kappa_n,
            kappa=kappa_n,
            alpha=prior.alpha + count / 2.0,
            beta=prior.beta
            + squared_deviations / 2.0
            + prior.kappa * count * (mean - prior.mean_log_s) ** 2 / (2.0 * kappa_n),
        )

    @staticmethod
    def from_distribution(
        prior: NigPrior, distribution: ToolTimeDistribution | None
    ) -> NigPosterior:
        if distribution is None or distribution.count <= 0:
            return NigPosterior.from_moments(prior, 0, 0.0, 0.0)
        n = distribution.count
        sum_log = distribution.mean_log_s * n
        sumsq_log = (distribution.var_log_s + distribution.mean_log_s**2) * n
        return NigPosterior.from_moments(prior, n, sum_log, sumsq_log)

    @property
    def predictive_df(self) -> float:
        return 2.0 * self.alpha

    @property
    def predictive_scale(self) -> float:
        return math.sqrt(self.beta * (self.kappa + 1.0) / (self.alpha * self.kappa))

    def predictive_quantile_s(self, q: float) -> float:
        """Duration (seconds) below which the next sample falls with probability ``q``,
        ``0 < q < 1``."""
        t = student_t_quantile(self.predictive_df, q)
        return math.exp(self.mean_log_s + t * self.predictive_scale)


def student_t_quantile(df: float, q: float) -> float:
    """Quantile of Student's t with ``df > 0`` degrees of freedom, ``0 < q < 1``."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q!r}")
    if not df > 0.0:
        raise ValueError(f"degrees of freedom must be > 0, got {df!r}")
    if df >= _EXPANSION_MIN_DF:
        return _cornish_fisher_t(df, q)
    return _exact_t_quantile(df, q)


def _cornish_fisher_t(df: float, q: float) -> float:
    # Abramowitz & Stegun 26.7.5.
    z = _STANDARD_NORMAL.inv_cdf(q)
    z2 = z * z
    g1 = (z2 + 1.0) * z / 4.0
    g2 = ((5.0 * z2 + 16.0) * z2 + 3.0) * z / 96.0
    g3 = (((3.0 * z2 + 19.0) * z2 + 17.0) * z2 - 15.0) * z / 384.0
    g4 = ((((79.0 * z2 + 776.0) * z2 + 1482.0) * z2 - 1920.0) * z2 - 945.0) * z / 92160.0
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


@functools.lru_cache(maxsize=4096)
def _exact_t_quantile(df: float, q: float) -> float:
    """Invert the t CDF by bisection on the regularized incomplete beta function.
    Cached: below _EXPANSION_MIN_DF the posterior takes few distinct df values."""
    if q == 0.5:
        return 0.0
    upper_tail = 1.0 - q if q > 0.5 else q
    # For t > 0: P(T > t) = I_x(df/2, 1/2) / 2 with x = df / (df + t^2), increasing in x.
    target = 2.0 * upper_tail
    low, high = 0.0, 1.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if _regularized_incomplete_beta(df / 2.0, 0.5, middle) < target:
            low = middle
        else:
            high = middle
        if high - low <= 1e-15 * high:
            break
    x = (low + high) / 2.0
    t = math.sqrt(df * (1.0 - x) / x)
    return t if q > 0.5 else -t


def _regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    # Modified Lentz's method (Numerical Recipes, 3rd ed., section 6.4).
    tiny = 1e-300
    c = 1.0
    d = 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        m2 = 2 * m
        numerator = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2))
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + numerator / c
        c = c if abs(c) > tiny else tiny
        result *= d * c
        numerator = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + numerator / c
        c = c if abs(c) > tiny else tiny
        step = d * c
        result *= step
        if abs(step - 1.0) < 1e-15:
            break
    return result
