"""Tests of varbench.stats.estimates: correlations with sequence bootstrap, variance statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from varbench.stats.estimates import (
    correlations,
    moment_statistics,
    paired_compare,
    variance_stats,
)


def variance_stats_reference(
    estimates: torch.Tensor, reference: torch.Tensor | None = None
) -> dict[str, float]:
    """Slow reference for ``variance_stats`` values (direct formulas on the vectors, float64):
    the tests' own, independent of the library's sums."""
    x = estimates.detach().double()
    M = x.shape[0]
    gbar = x.mean(0)
    var = float(((x - gbar) ** 2).sum() / (M - 1))
    out = {"variance": var, "snr": float(gbar @ gbar) / var}
    out["signal_norm2"] = float(gbar @ gbar) - var / M
    out["noise_scale"] = var / out["signal_norm2"] if out["signal_norm2"] > 0 else float("nan")
    if reference is not None:
        g = reference.detach().double().reshape(-1)
        out["bias"] = float((gbar - g).norm())
        out["bias2_debiased"] = out["bias"] ** 2 - var / M
        out["mse"] = float(((x - g) ** 2).sum(1).mean())
        cos = [torch.dot(r, g) / (r.norm() * g.norm()) if r.norm() > 0 else torch.tensor(0.0)
               for r in x]
        out["cosine"] = float(torch.stack(cos).mean())
        nz = [c for c, r in zip(cos, x, strict=True) if r.norm() > 0]
        out["cosine_nonzero"] = float(torch.stack(nz).mean()) if nz else float("nan")
        out["projection"] = float(gbar @ g) / float(g @ g)
    return out



def test_correlation_point_estimates_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, size=300)
    y = x * rng.lognormal(size=300)
    seq = np.repeat(np.arange(30), 10)
    df = correlations(x, y, seq, n_boot=50).set_index("method")
    assert df.loc["pearson", "estimate"] == pytest.approx(sps.pearsonr(x, y).statistic, abs=1e-12)
    assert df.loc["pearson_log", "estimate"] == pytest.approx(
        sps.pearsonr(np.log(x), np.log(y)).statistic, abs=1e-12
    )
    assert df.loc["spearman", "estimate"] == pytest.approx(
        sps.spearmanr(x, y).statistic, abs=1e-12
    )
    assert df.loc["kendall", "estimate"] == pytest.approx(sps.kendalltau(x, y).statistic, abs=1e-12)
    assert (df["ci_low"] <= df["estimate"]).all() and (df["estimate"] <= df["ci_high"]).all()
    assert (df["n_seq"] == 30).all()


def test_bootstrap_resamples_whole_sequences():
    # Every token of a sequence carries the same (x, y): resampling sequences keeps each draw
    # perfectly correlated through duplicated points only if whole sequences come along, and a
    # sequence-level effect makes the CI wider than a token-level bootstrap would.
    rng = np.random.default_rng(1)
    seq_x = rng.normal(size=20)
    seq_y = seq_x + rng.normal(size=20)
    x = np.repeat(seq_x, 50) + 1e-3 * rng.normal(size=1000)
    y = np.repeat(seq_y, 50) + 1e-3 * rng.normal(size=1000)
    seq = np.repeat(np.arange(20), 50)
    by_seq = correlations(x, y, seq, methods=["pearson"], n_boot=300, seed=3)
    by_tok = correlations(x, y, np.arange(1000), methods=["pearson"], n_boot=300, seed=3)
    w_seq = float(by_seq["ci_high"].iloc[0] - by_seq["ci_low"].iloc[0])
    w_tok = float(by_tok["ci_high"].iloc[0] - by_tok["ci_low"].iloc[0])
    assert w_seq > 3 * w_tok


def test_correlations_seeded_and_bad_input():
    x, y, s = np.arange(10.0), np.arange(10.0) ** 2, np.arange(10)
    a = correlations(x, y, s, n_boot=20, seed=5)
    b = correlations(x, y, s, n_boot=20, seed=5)
    assert a.equals(b)
    with pytest.raises(ValueError, match="methods"):
        correlations(x, y, s, methods=["cosine"])
    with pytest.raises(ValueError, match="same length"):
        correlations(x, y[:5], s)


@pytest.mark.parametrize("with_ref", [True, False])
def test_variance_stats_match_direct_formulas(with_ref):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(17, 9, generator=g, dtype=torch.float64) + 0.5
    ref = torch.randn(9, generator=g, dtype=torch.float64) if with_ref else None
    got = variance_stats(X, ref)
    want = variance_stats_reference(X, ref)
    for k, v in want.items():
        assert got[k][0] == pytest.approx(v, rel=1e-10, abs=1e-12), k
    if not with_ref:
        assert math.isnan(got["bias"][0]) and math.isnan(got["mse"][0])


def test_exact_moments_give_the_population_statistics():
    """At n = inf (an exact cell's moments) the V/n corrections vanish: bias2_debiased is
    bias2 and signal_norm2 is ||E g||^2, bit for bit; floats go to host float64 tensors."""
    V, S, B, tok = 0.3, 1.7, 0.2, 5.0
    got = moment_statistics(V, S, B, tok)
    assert all(v.dtype == torch.float64 and v.device.type == "cpu" for v in got.values())
    want = {"variance": V, "bias": math.sqrt(B), "bias2_debiased": B, "signal_norm2": S,
            "snr": S / V, "noise_scale": V / S, "variance_x_tokens": V * tok}
    assert {k: float(v) for k, v in got.items()} == want
    assert math.isnan(float(moment_statistics(V, 0.0, B, tok)["noise_scale"]))


def test_jackknife_se_matches_explicit_loop():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(12, 5, generator=g, dtype=torch.float64) + 1.0
    ref = torch.randn(5, generator=g, dtype=torch.float64)
    got = variance_stats(X, ref)
    M = X.shape[0]
    for k in ("variance", "mse", "cosine", "bias", "noise_scale"):
        loo = np.array(
            [variance_stats_reference(torch.cat([X[:j], X[j + 1 :]]), ref)[k] for j in range(M)]
        )
        se = math.sqrt((M - 1) / M * ((loo - loo.mean()) ** 2).sum())
        assert got[k][1] == pytest.approx(se, rel=1e-8), k


def test_variance_se_is_calibrated():
    # The jackknife SE of the variance should match the spread of the estimate across repeats.
    g = torch.Generator().manual_seed(2)
    vals, ses = [], []
    for _ in range(300):
        X = torch.randn(40, 3, generator=g, dtype=torch.float64)
        v, se = variance_stats(X)["variance"]
        vals.append(v)
        ses.append(se)
    emp = float(np.std(vals, ddof=1))
    assert np.mean(ses) == pytest.approx(emp, rel=0.25)
    assert np.mean(vals) == pytest.approx(3.0, rel=0.05)  # tr Cov of a 3-d standard normal


def test_tokens_scale_variance_x_tokens():
    X = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    out = variance_stats(X, tokens=torch.full((10,), 7.0))
    assert out["variance_x_tokens"][0] == pytest.approx(7 * out["variance"][0], rel=1e-12)


def test_paired_compare_small_se_for_shared_noise():
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(50, 6, generator=g, dtype=torch.float64)
    a = 0.5 * noise
    b = noise + 0.01 * torch.randn(50, 6, generator=g, dtype=torch.float64)
    cmp = paired_compare(a, b)
    assert cmp["ratio"] == pytest.approx(0.25, rel=0.02)
    assert cmp["ratio_se"] < 0.01  # shared sampling noise cancels in the paired ratio
    va, vb = variance_stats(a)["variance"], variance_stats(b)["variance"]
    assert cmp["a"] == pytest.approx(va[0]) and cmp["b"] == pytest.approx(vb[0])
    assert cmp["diff"] == pytest.approx(va[0] - vb[0])


def test_variance_stats_bad_input():
    with pytest.raises(ValueError, match="M >= 3"):
        variance_stats(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[M, D\]"):
        variance_stats(torch.zeros(5))
    with pytest.raises(ValueError, match="NaN"):
        variance_stats(torch.full((4, 2), float("nan")))
    with pytest.raises(ValueError, match="D=3"):
        variance_stats(torch.zeros(4, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="stat="):
        paired_compare(torch.zeros(4, 3), torch.zeros(4, 3), stat="nope")
