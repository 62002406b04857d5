"""stats.intervals' exact-cell sketch SDs (``QuadForm``, ``form_sketch_var``, ``exact_pair_sd``;
issue 30) against brute force, float64.

The data: R = 10 rows in D = 300 coordinates with two heavy coordinates (the fourth-moment term
``sum_i A_ii^2`` a sizeable share of ``||A||_F^2``), and two positive semi-definite forms on them
sharing a low-rank part (two schemes' covariances on one table: their sketch errors strongly
correlated). References: (1) the structured O(R^2) sums equal the K x K matrix ``A_S`` formed
explicitly, to 1e-9; (2) the exact D-space variance ``(2/K)(||A||_F^2 - sum A_ii^2)`` and the
mean plug-in over N_PLUGIN draws are within TOL of the variance of ``tr(S A S^T)`` over N_DRAWS
fresh CountSketch draws (Monte Carlo error of the latter ~1.5%), as are the log ratio's and the
difference's of the two forms (the ratio's first-order expansion adds < 1%).
"""

from __future__ import annotations

import pytest
import torch

from varbench.stats.intervals import (
    QuadForm,
    _unbiased_cov,
    exact_pair_sd,
    exact_sketch_sd,
    form_sketch_var,
)

D, K, R = 300, 32, 10
N_DRAWS = 20_000
N_PLUGIN = 300
TOL = 0.08


def _data():
    g = torch.Generator().manual_seed(11)
    scale = torch.ones(D, dtype=torch.float64)
    scale[:2] = 12.0
    V = torch.randn(R, D, generator=g, dtype=torch.float64) * scale
    U = torch.randn(R, 2, generator=g, dtype=torch.float64)
    wa = torch.rand(R, generator=g, dtype=torch.float64) + 0.2
    wb = 0.7 * wa + 0.3 * torch.rand(R, generator=g, dtype=torch.float64)
    Ca = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=torch.float64)
    Cb = torch.tensor([[0.8, 0.1], [0.1, 0.9]], dtype=torch.float64)
    return V, QuadForm(wa, U, Ca), QuadForm(wb, U, Cb)


def _matrix(f: QuadForm, V: torch.Tensor) -> torch.Tensor:
    return V.T @ (torch.diag(f.w) + f.U @ f.C @ f.U.T) @ V


def _sketch(V, n, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(0, K, (n, D), generator=g)
    s = torch.randint(0, 2, (n, D), generator=g, dtype=torch.float64) * 2 - 1
    src = s[:, None, :] * V[None]
    return torch.zeros(n, R, K, dtype=torch.float64).scatter_add_(
        2, h[:, None, :].expand_as(src), src)


def _traces(f: QuadForm, VS: torch.Tensor) -> torch.Tensor:
    H = VS @ VS.transpose(1, 2)
    Z = f.U.T @ H @ f.U
    return (H.diagonal(dim1=1, dim2=2) @ f.w) + (f.C * Z).sum((1, 2))


@pytest.fixture(scope="module")
def draws():
    V, fa, fb = _data()
    ta, tb = [], []
    for c in range(N_DRAWS // 2000):
        VS = _sketch(V, 2000, 500 + c)
        ta.append(_traces(fa, VS))
        tb.append(_traces(fb, VS))
    return torch.cat(ta), torch.cat(tb)


def test_form_sums_equal_the_formed_sketched_matrix():
    """The O(R^2) trace, ||A_S||_F^2 and bucket term of form_sketch_var equal those of the
    K x K matrix formed explicitly (float64, 1e-9), for a form with signed weights and for a
    combination of two forms."""
    V, fa, fb = _data()
    VS = _sketch(V, 3, 9)
    signed = QuadForm(fa.w - 0.9, fa.U, fa.C)
    for f in (fa, signed, fa.combine(0.5, fb, -1.3)):
        for i in range(3):
            A = _matrix(f, VS[i])
            want = _unbiased_cov(float(A.trace()) ** 2, float((A * A).sum()),
                                 float((A.diagonal() ** 2).sum()), K)
            assert form_sketch_var(f, VS[i], K) == pytest.approx(want, rel=1e-9)
            assert f.trace(VS[i] @ VS[i].T) == pytest.approx(float(A.trace()), rel=1e-9)


def test_form_sketch_var_matches_sketch_draws(draws):
    """Mean plug-in variance and the exact D-space variance within TOL of the variance of
    tr(S A S^T) over N_DRAWS draws; the formula without the fourth-moment term is off by more
    (so the comparison can fail)."""
    V, fa, fb = _data()
    want = float(draws[0].var())
    A = _matrix(fa, V)
    exact = 2 * float((A * A).sum() - (A.diagonal() ** 2).sum()) / K
    assert exact == pytest.approx(want, rel=TOL)
    assert abs(2 * float((A * A).sum()) / K / want - 1) > 2 * TOL
    VS = _sketch(V, N_PLUGIN, 77)
    got = sum(exact_sketch_sd({"v": fa}, VS[i], K)["v"] ** 2 for i in range(N_PLUGIN))
    assert got / N_PLUGIN == pytest.approx(want, rel=TOL)


def test_exact_pair_sd_matches_sketch_draws(draws):
    """The log ratio and the difference of two forms on one draw: mean plug-in variance within
    TOL of the brute force; the correlation-free ``sd_a/a + sd_b/b`` is several times the true
    SD here, so the test can fail."""
    V, fa, fb = _data()
    a, b = draws
    VS = _sketch(V, N_PLUGIN, 78)
    vals = [exact_pair_sd({"v": fa}, {"v": fb}, VS[i], K)["v"] for i in range(N_PLUGIN)]
    lr = sum(v["log_ratio"] ** 2 for v in vals) / N_PLUGIN
    df = sum(v["diff"] ** 2 for v in vals) / N_PLUGIN
    assert lr == pytest.approx(float((a.log() - b.log()).var()), rel=TOL)
    assert df == pytest.approx(float((a - b).var()), rel=TOL)
    bound = float(a.std() / a.mean() + b.std() / b.mean())
    assert bound > 2 * float((a.log() - b.log()).std())
