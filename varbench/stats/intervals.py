"""Intervals for group statistics that hold for heavy-tailed per-group values, and adaptive M.

Per-token squared gradient norms are heavy tailed (a rare, improbable response has a gradient
norm orders of magnitude above a typical one), so the per-group terms behind a variance or an
MSE have a large kurtosis. A jackknife SE with a normal interval then undercovers at the M
groups an analysis can afford: the SE is itself estimated from the few large groups, and the
sampling distribution of the statistic is right-skewed.

``group_intervals`` therefore uses a *studentized bootstrap over groups* (bootstrap-t): each
resample of the M groups recomputes the statistic and its own influence-function SE, and the
interval is ``[theta - t_hi se, theta - t_lo se]`` with t's quantiles. Positive statistics
(variance, MSE, ratios of them) are studentized on the log scale, where the sampling
distribution is closer to symmetric. Every statistic is a function of the Gram matrix of the
estimates (``X X^T``), ``X g*`` and ``||g*||^2``, so a resample costs O(M^2), whatever the
dimension of the vectors.

Supported statistics: ``variance`` (trace of the covariance), ``mse`` (mean ||g_m - g*||^2),
``projection`` (mean g_m . g* / ||g*||^2), and paired ratios of variance or MSE between two
schemes evaluated on the same groups (``paired_ratio_interval``).

``adaptive_groups`` decides how many groups a Monte Carlo cell needs: the smallest M (in steps)
at which every tracked relative SE meets the target, capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from varbench._util.checks import UsageError, check_choice

INTERVAL_STATS = ("variance", "mse", "projection")
INTERVAL_METHODS = ("studentized", "normal")
_POSITIVE = {"variance", "mse"}


def gram_matrix(estimates: torch.Tensor) -> torch.Tensor:
    """``X X^T`` [M, M] in float64 of M estimates ``X [M, D]``: computed once, it can be handed
    to :func:`group_intervals`, :func:`paired_ratio_interval` and :func:`sketch_sd` (``gram=``),
    which otherwise each form it (O(M^2 D) apiece)."""
    x = estimates.detach().to(torch.float64)
    return x @ x.T


def _check_gram(gram: torch.Tensor | None, M: int, arg: str = "gram") -> None:
    if gram is not None and tuple(gram.shape) != (M, M):
        raise UsageError(f"{arg} has shape {list(gram.shape)}, expected [{M}, {M}] "
                         "(gram_matrix of the estimates)")


class _Parts:
    """Gram-matrix summaries of M estimates ``X [M, D]`` against ``g* [D]`` (float64); the
    Gram matrix (only the variance needs it) is ``gram`` or formed on first use."""

    def __init__(self, x: torch.Tensor, ref: torch.Tensor,
                 gram: torch.Tensor | None = None) -> None:
        self._x = x.detach().to(torch.float64)
        ref = ref.detach().to(torch.float64).reshape(-1)
        self._gram = None if gram is None else gram.to(torch.float64)
        self.sq = (self._x * self._x).sum(1)
        self.xg = self._x @ ref
        self.gg = float(ref @ ref)

    @property
    def gram(self) -> torch.Tensor:
        if self._gram is None:
            self._gram = self._x @ self._x.T
        return self._gram

    def stat(self, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(theta [B], influence values [B, M]) of statistic ``name`` under weights w [B, M]."""
        n = w.sum(-1, keepdim=True)  # [B, 1]
        if name == "variance":
            gw = w @ self.gram / n  # [B, M]: x_m . x_bar
            xbar2 = (gw * w).sum(-1, keepdim=True) / n
            d = self.sq - 2 * gw + xbar2  # ||x_m - x_bar||^2
            theta = (w * d).sum(-1, keepdim=True) / (n - 1)
            return theta[:, 0], d * n / (n - 1) - theta
        if name == "mse":
            e = (self.sq - 2 * self.xg + self.gg).expand_as(w)
        elif name == "projection":
            e = (self.xg / self.gg).expand_as(w)
        else:
            raise UsageError(f"stat={name!r} is not valid; choose one of {list(INTERVAL_STATS)}")
        theta = (w * e).sum(-1, keepdim=True) / n
        return theta[:, 0], e - theta


def _se(infl: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Influence-function SE ``sqrt(sum_m w_m IF_m^2) / n`` (the delta method)."""
    n = w.sum(-1)
    return (w * infl**2).sum(-1).clamp(min=0).sqrt() / n


def _bootstrap_t(fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], M: int, *,
                 log: bool, level: float, n_boot: int, seed: int,
                 method: str) -> tuple[float, float, float, float]:
    """(theta, se, lo, hi) of ``fn(weights) -> (theta [B], se [B])`` by bootstrap-t over M."""
    one = torch.ones(1, M, dtype=torch.float64, device="cpu")  # host statistics
    th, se = (float(v[0]) for v in fn(one))
    z = _z(level)
    if not math.isfinite(th) or not math.isfinite(se):
        return th, se, float("nan"), float("nan")
    if log and th <= 0:
        return th, se, float("nan"), float("nan")
    if se == 0:  # a deterministic value (e.g. rloo / centered = (G/(G-1))^2 on shared groups)
        return th, se, th, th
    if method == "normal":
        if log:
            return th, se, th * math.exp(-z * se / th), th * math.exp(z * se / th)
        return th, se, th - z * se, th + z * se
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, M, (n_boot, M), generator=g, device="cpu")
    w = torch.zeros(n_boot, M, dtype=torch.float64, device="cpu").scatter_add_(
        1, idx, torch.ones(n_boot, M, dtype=torch.float64, device="cpu"))
    tb, sb = fn(w)
    if log:
        ok = (tb > 0) & (sb > 0)
        t = (tb[ok].log() - math.log(th)) / (sb[ok] / tb[ok])
        c, s = math.log(th), se / th
    else:
        ok = sb > 0
        t = (tb[ok] - th) / sb[ok]
        c, s = th, se
    if t.numel() < n_boot // 2:
        return th, se, float("nan"), float("nan")
    alpha = (1 - level) / 2
    qlo, qhi = (float(v) for v in torch.quantile(t, torch.tensor([alpha, 1 - alpha],
                                                                  dtype=t.dtype, device=t.device)))
    lo, hi = c - qhi * s, c - qlo * s
    if log:  # a degenerate t* distribution (few distinct groups) can reach beyond exp's range
        return th, se, math.exp(min(lo, 700.0)), math.exp(min(hi, 700.0))
    return th, se, lo, hi


def _z(level: float) -> float:
    if not 0 < level < 1:
        raise UsageError(f"level={level!r} is not valid; expected a number in (0, 1)")
    half = torch.tensor((1 + level) / 2, device="cpu")
    return float(torch.distributions.Normal(*torch.tensor([0.0, 1.0], device="cpu")).icdf(half))


def group_intervals(
    estimates: torch.Tensor,
    reference: torch.Tensor,
    *,
    stats: tuple[str, ...] = INTERVAL_STATS,
    level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
    method: str = "studentized",
    gram: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """``{stat: {value, se, ci_low, ci_high}}`` for M group estimates ``[M, D]`` against g* [D].
    ``gram``: :func:`gram_matrix` of the estimates, if already formed.

    ``method``: ``studentized`` (bootstrap-t over groups; log scale for variance and MSE) or
    ``normal`` (value +- z SE with the influence-function SE; on the log scale for the positive
    statistics). The SE is the influence-function (delta-method) SE over groups. Caveat: the
    intervals condition on g*; a sketch's own error is not in them (see the caller).
    """
    check_choice("method", method, INTERVAL_METHODS)
    if estimates.dim() != 2 or estimates.shape[0] < 3:
        raise UsageError(f"estimates must be [M >= 3, D], got {list(estimates.shape)}")
    M = estimates.shape[0]
    _check_gram(gram, M)
    parts = _Parts(estimates, reference, gram)
    out = {}
    for k, name in enumerate(stats):
        def fn(w, name=name):
            th, infl = parts.stat(name, w)
            return th, _se(infl, w)
        th, se, lo, hi = _bootstrap_t(fn, M, log=name in _POSITIVE, level=level, n_boot=n_boot,
                                      seed=seed + k, method=method)
        out[name] = {"value": th, "se": se, "ci_low": lo, "ci_high": hi}
    return out


def paired_ratio_interval(
    estimates_a: torch.Tensor,
    estimates_b: torch.Tensor,
    reference: torch.Tensor,
    *,
    stat: str = "variance",
    level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
    method: str = "studentized",
    gram_a: torch.Tensor | None = None,
    gram_b: torch.Tensor | None = None,
) -> dict[str, float]:
    """``{value, se, ci_low, ci_high}`` of stat_a / stat_b on the SAME M groups (paired).
    ``gram_a``, ``gram_b``: :func:`gram_matrix` of each, if already formed.

    The bootstrap resamples groups jointly for both schemes, and the SE is the delta-method SE
    of the ratio (influence ``(IF_a - r IF_b) / b``), so the shared sampling noise cancels.
    Studentized on the log scale.
    """
    check_choice("stat", stat, ("variance", "mse"))
    check_choice("method", method, INTERVAL_METHODS)
    if estimates_a.shape[0] != estimates_b.shape[0]:
        raise UsageError(f"paired schemes need the same groups: M={estimates_a.shape[0]} vs "
                         f"{estimates_b.shape[0]}")
    _check_gram(gram_a, estimates_a.shape[0], "gram_a")
    _check_gram(gram_b, estimates_b.shape[0], "gram_b")
    pa, pb = _Parts(estimates_a, reference, gram_a), _Parts(estimates_b, reference, gram_b)

    def fn(w):
        a, ia = pa.stat(stat, w)
        b, ib = pb.stat(stat, w)
        r = a / b
        return r, _se((ia - r[:, None] * ib) / b[:, None], w)

    th, se, lo, hi = _bootstrap_t(fn, estimates_a.shape[0], log=True, level=level,
                                  n_boot=n_boot, seed=seed, method=method)
    return {"value": th, "se": se, "ci_low": lo, "ci_high": hi}


def sketch_sd(estimates: torch.Tensor, reference: torch.Tensor, K: int, *,
              gram: torch.Tensor | None = None) -> dict[str, float]:
    """Standard deviation, over the random CountSketch, of variance, MSE and projection.

    For a CountSketch S with K buckets and fixed x, y: ``Var[<Sx, Sy>] <= (||x||^2 ||y||^2 +
    <x, y>^2) / K`` (``varbench.grads.vectors.CountSketch``). The variance is ``tr C`` of the
    covariance C = sum_m u_m u_m^T / (M-1) (u centred), whose sketch has variance
    ``<= 2 ||C||_F^2 / K``; ``||C||_F^2`` is read from the (sketched) centred Gram matrix.
    Likewise the MSE with the second moment about g*, and the projection with
    ``(||g_bar||^2 ||g*||^2 + (g_bar . g*)^2) / K`` over ``||g*||^4``. These are plug-in upper
    bounds (they drop the negative fourth-moment term): added in quadrature to an SE they make
    intervals conservative, never optimistic, about the sketch.
    """
    x = estimates.detach().to(torch.float64)
    ref = reference.detach().to(torch.float64).reshape(-1)
    M = x.shape[0]
    _check_gram(gram, M)
    G = gram_matrix(x) if gram is None else gram.to(torch.float64)
    # both Gram matrices from X X^T: centred (u = x - x_bar) and about g* (e = x - g*)
    r = G.sum(1) / M  # x_m . x_bar
    s = float(r.sum()) / M  # ||x_bar||^2
    cu = (G - r[:, None] - r[None, :] + s) / (M - 1)
    xg = x @ ref
    gg = float(ref @ ref)
    ce = (G - xg[:, None] - xg[None, :] + gg) / M
    gbar_ref = float(xg.mean())
    # g* = 0 (every reference response scored the same): the projection is undefined
    proj = (((s * gg + gbar_ref ** 2) / K) ** 0.5 / gg if gg > 0 else float("nan"))
    return {"variance": float(2 * (cu * cu).sum() / K) ** 0.5,
            "mse": float(2 * (ce * ce).sum() / K) ** 0.5, "projection": proj}


def adaptive_groups(rel_se: Callable[[int], float], *, start: int, step: int, cap: int,
                    target: float) -> tuple[int, float, bool]:
    """Grow M from ``start`` by ``step`` until ``rel_se(M) <= target`` or M reaches ``cap``.

    ``rel_se(M)`` evaluates the largest tracked relative SE with the first M groups (the caller
    samples more as needed). Returns ``(M, rel_se, met)``. Caveat: stopping on an estimated SE
    favours samples whose SE happens to be small; ``start`` should not be tiny (>= 32).
    """
    if start < 3 or step < 1 or cap < start:
        raise UsageError(f"adaptive M needs 3 <= start <= cap and step >= 1; got start={start}, "
                         f"step={step}, cap={cap}")
    M = start
    r = rel_se(M)
    while r > target and M < cap:
        M = min(cap, M + step)
        r = rel_se(M)
    return M, r, r <= target
