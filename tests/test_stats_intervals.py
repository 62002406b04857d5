"""stats.intervals: the shared Gram matrix gives what each function forms on its own, and the
sketch SD from one Gram matrix equals its direct vector formulas (float64)."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import UsageError
from varbench.stats.intervals import (
    gram_matrix,
    group_intervals,
    paired_ratio_interval,
    sketch_sd,
)


def _data(seed=0, M=30, D=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=torch.float64) ** 3 + 0.3
    y = x * 0.5 + torch.randn(M, D, generator=g, dtype=torch.float64)
    ref = torch.randn(D, generator=g, dtype=torch.float64)
    return x, y, ref


def test_sketch_sd_equals_its_direct_vector_formulas():
    x, _, ref = _data()
    M, K = x.shape[0], 32
    u = x - x.mean(0)
    cu = u @ u.T / (M - 1)
    e = x - ref
    ce = e @ e.T / M
    gbar = x.mean(0)
    gg = float(ref @ ref)
    want = {"variance": float(2 * (cu * cu).sum() / K) ** 0.5,
            "mse": float(2 * (ce * ce).sum() / K) ** 0.5,
            "projection": ((float(gbar @ gbar) * gg + float(gbar @ ref) ** 2) / K) ** 0.5 / gg}
    for got in (sketch_sd(x, ref, K), sketch_sd(x, ref, K, gram=gram_matrix(x))):
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-12), k


def test_a_shared_gram_matrix_changes_nothing():
    x, y, ref = _data(1)
    gx, gy = gram_matrix(x), gram_matrix(y)
    assert torch.allclose(gx, x @ x.T, rtol=0, atol=0)
    for method in ("studentized", "normal"):
        a = group_intervals(x, ref, method=method, n_boot=300, gram=gx)
        b = group_intervals(x, ref, method=method, n_boot=300)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-12), (method, k)
        for stat in ("variance", "mse"):
            a = paired_ratio_interval(x, y, ref, stat=stat, method=method, n_boot=300,
                                      gram_a=gx, gram_b=gy)
            b = paired_ratio_interval(x, y, ref, stat=stat, method=method, n_boot=300)
            assert a == pytest.approx(b, rel=1e-12)


def test_a_gram_matrix_of_the_wrong_shape_is_refused():
    x, y, ref = _data(2)
    with pytest.raises(UsageError, match=r"gram has shape \[5, 5\]"):
        group_intervals(x, ref, gram=torch.zeros(5, 5, dtype=torch.float64))
    with pytest.raises(UsageError, match="gram_b"):
        paired_ratio_interval(x, y, ref, gram_b=torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(UsageError, match="gram"):
        sketch_sd(x, ref, 8, gram=torch.zeros(2, 2, dtype=torch.float64))
