"""varbench.stats: statistics of estimates, below every package that measures.

Variance, bias, MSE, cosine and SNR of M independent gradient estimates with jackknife standard
errors, paired comparisons of estimators on the same groups, and rank/linear correlations with
bootstrap intervals (docs/science.md section 5). The analyses and the estimator regression
checks (``varbench.testing``) use the same functions.
"""

from varbench.stats.estimates import (
    CORRELATION_METHODS,
    MAGNITUDE_METHODS,
    VARIANCE_STATS,
    correlations,
    moment_statistics,
    paired_compare,
    variance_stats,
)

__all__ = ["CORRELATION_METHODS", "MAGNITUDE_METHODS", "VARIANCE_STATS", "correlations",
           "moment_statistics", "paired_compare", "variance_stats"]
