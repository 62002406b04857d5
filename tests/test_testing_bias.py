"""varbench.testing.bias: the mean-zero test behind the bias checks (false-alarm rate and
power)."""

from __future__ import annotations

import torch

from varbench.testing.bias import mean_zero_pvalue


def test_mean_zero_test_false_alarm_rate_and_power():
    """p-values of data with mean 0 are ~uniform: over 400 seeded datasets, the count below 0.05
    lies in the binomial 1e-4 two-sided band [6, 38]; a shifted mean is detected."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.linspace(0.2, 3.0, 12)  # unequal variances: the chi-square weighting matters
    low = 0
    for _ in range(400):
        x = torch.randn(300, 12, generator=gen, dtype=torch.float64) * scales
        low += mean_zero_pvalue(x) < 0.05
    assert 6 <= low <= 38, low
    x = torch.randn(300, 12, generator=gen, dtype=torch.float64) * scales + 0.3
    assert mean_zero_pvalue(x) < 1e-6
