"""stats.intervals: the shared Gram matrix gives what each function forms on its own, and the
sketch SD from one Gram matrix equals its direct vector formulas (float64; the formulas
against sketch draws: test_stats_intervals_sketch.py)."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import UsageError
from varbench.stats.intervals import (
    _quad_cov,
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


def test_sketch_sd_from_the_gram_matrix_equals_its_direct_vector_formulas():
    """The variance's and MSE's ``||C||_F^2`` read from the Gram matrix (centred in place) give
    what the direct rows' ``A A^T`` give, with or without a passed Gram matrix."""
    x, _, ref = _data()
    M, K = x.shape[0], 32
    u = x - x.mean(0)
    e = x - ref
    want = {"variance": _quad_cov(u, 1 / (M - 1), u, 1 / (M - 1), K, u @ u.T) ** 0.5,
            "mse": _quad_cov(e, 1 / M, e, 1 / M, K, e @ e.T) ** 0.5}
    a, b = sketch_sd(x, ref, K), sketch_sd(x, ref, K, gram=gram_matrix(x))
    assert a == pytest.approx(b, rel=1e-12)
    for k, v in want.items():
        assert a[k] == pytest.approx(v, rel=1e-10), k


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


def test_planned_groups_is_the_two_stage_rule():
    """M = pilot (rel / target)^2 rounded up to whole steps, within [floor, cap]; NaN: cap."""
    from varbench.stats.intervals import planned_groups

    kw = {"pilot": 16, "step": 16, "floor": 64, "cap": 512}
    assert planned_groups(0.2, target=0.1, **kw) == 64  # 64 groups meet it: the floor
    assert planned_groups(0.5, target=0.1, **kw) == 400  # 16 * 25 = 400 = 25 steps
    assert planned_groups(0.51, target=0.1, **kw) == 432  # 416.2 -> 27 steps of 16
    assert planned_groups(2.0, target=0.1, **kw) == 512  # capped
    assert planned_groups(float("nan"), target=0.1, **kw) == 512
    with pytest.raises(UsageError, match="floor <= cap"):
        planned_groups(0.2, target=0.1, pilot=16, step=16, floor=64, cap=32)
    with pytest.raises(UsageError, match="target"):
        planned_groups(0.2, target=0.0, **kw)
