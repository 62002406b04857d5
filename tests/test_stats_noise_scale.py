"""varbench.stats.noise_scale: the per-response gradient noise scale and its interval.

References: a brute-force float64 computation from the group estimates themselves (explicit
means and squared distances, no Gram matrix), an enumerated response distribution whose true
B = tr Sigma / ||mu||^2 is known in closed form, and a replicate study of the interval's
coverage on Gaussian per-response gradients with known mean and covariance.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from varbench._util.checks import UsageError
from varbench.stats.estimates import variance_stats
from varbench.stats.intervals import gram_matrix
from varbench.stats.noise_scale import _weighted, noise_scale, noise_scale_interval


def _brute(x: np.ndarray, G: int) -> float:
    """G V / (||x_bar||^2 - V / M) by explicit loops (float64)."""
    M = x.shape[0]
    mean = sum(x[m] for m in range(M)) / M
    V = sum(float(((x[m] - mean) ** 2).sum()) for m in range(M)) / (M - 1)
    S = float((mean**2).sum()) - V / M
    return G * V / S if S > 0 else math.nan


def test_point_estimate_matches_brute_force_and_the_cells_column():
    """Tolerance 1e-12 relative (float64 throughout; only the summation order differs)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64) + 1.5
    for G in (1, 4, 32):
        assert noise_scale(x, group_size=G) == pytest.approx(_brute(x.numpy(), G), rel=1e-12)
    # the group-unit value is the variance cells' noise_scale column (one definition)
    assert noise_scale(x) == pytest.approx(variance_stats(x)["noise_scale"][0], rel=1e-12)
    assert noise_scale(x, gram=gram_matrix(x)) == noise_scale(x)


def test_weighted_resample_equals_the_explicitly_resampled_estimates():
    """A bootstrap weight vector (counts) gives the statistic of the rows it repeats."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, generator=gen, dtype=torch.float64) + 1.0
    idx = torch.randint(0, 9, (9,), generator=gen)
    w = torch.bincount(idx, minlength=9).double()[None]
    b, _ = _weighted(gram_matrix(x), w, 8)
    assert float(b[0]) == pytest.approx(_brute(x[idx].numpy(), 8), rel=1e-12)


def test_enumerated_distribution_recovers_the_closed_form():
    """Responses from a 3-point distribution; group estimate = mean of G draws. Enumerating
    every group of G = 2 (9 ordered pairs) weighted by its probability gives the exact
    E[B-hat's parts]: G V_group = tr Sigma and ||E g_hat||^2 = ||mu||^2, so the exact-moment
    noise scale is tr Sigma / ||mu||^2 (float64, 1e-12)."""
    pts = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
    p = np.array([0.5, 0.3, 0.2])
    mu = p @ pts
    tr_sigma = float(p @ ((pts - mu) ** 2).sum(1))
    truth = tr_sigma / float(mu @ mu)
    G = 2
    groups = list(itertools.product(range(3), repeat=G))
    prob = np.array([np.prod(p[list(g)]) for g in groups])
    est = np.array([pts[list(g)].mean(0) for g in groups])
    mean = prob @ est
    var = float(prob @ ((est - mean) ** 2).sum(1))
    assert G * var / float(mean @ mean) == pytest.approx(truth, rel=1e-12)
    # and the sample statistic converges to it on many groups drawn from the same distribution
    rng = np.random.default_rng(0)
    draws = torch.from_numpy(pts[rng.choice(3, size=(3000, G), p=p)].mean(1))
    iv = noise_scale_interval(draws, group_size=G, method="normal")
    assert iv["value"] == noise_scale(draws, group_size=G)
    assert abs(iv["value"] - truth) < 4 * iv["se"] < 0.1 * truth  # within 4 of its SEs


def test_interval_covers_the_known_truth_in_replicates():
    """Gaussian per-response gradients, mean mu, covariance diag(s^2); groups of G = 4; M = 64
    groups; 200 replicates. Nominal 95%: at least 88% cover (binomial SE 1.5 points: 0.95 - 4.5
    SE), and the normal-on-log interval with the same SE covers too."""
    D, G, M, reps = 6, 4, 64, 200
    mu = torch.full((D,), 0.5, dtype=torch.float64)
    s = torch.linspace(0.5, 1.5, D, dtype=torch.float64)
    truth = float((s**2).sum() / (mu @ mu))  # 4.47 responses
    gen = torch.Generator().manual_seed(7)
    cover = {"studentized": 0, "normal": 0}
    for r in range(reps):
        resp = mu + s * torch.randn(M, G, D, generator=gen, dtype=torch.float64)
        x = resp.mean(1)
        for method in cover:
            iv = noise_scale_interval(x, group_size=G, n_boot=400, seed=r, method=method)
            cover[method] += iv["ci_low"] <= truth <= iv["ci_high"]
    for method, k in cover.items():
        assert k / reps >= 0.88, (method, k)


def test_unresolved_signal_and_bad_input():
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    assert math.isnan(noise_scale(x))  # mean 0: no signal
    iv = noise_scale_interval(x)
    assert math.isnan(iv["ci_low"]) and math.isnan(iv["ci_high"])
    with pytest.raises(UsageError, match=r"estimates must be"):
        noise_scale(torch.zeros(2, 3))
    with pytest.raises(UsageError, match=r"group_size=0"):
        noise_scale(torch.ones(4, 2), group_size=0)
    with pytest.raises(UsageError, match=r"method='bca'"):
        noise_scale_interval(torch.ones(4, 2), method="bca")
    with pytest.raises(UsageError, match=r"gram has shape"):
        noise_scale(torch.ones(4, 2), gram=torch.eye(3))
