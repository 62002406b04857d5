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

``planned_groups`` decides how many groups a Monte Carlo cell needs from a pilot's relative SE
(a two-stage rule: the reported groups are drawn apart from the pilot), capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


def _rows(x: torch.Tensor, ref: torch.Tensor, stat: str) -> tuple[torch.Tensor, float]:
    """The rows a of ``stat = sum_m w ||a_m||^2`` and their weight w: the centred estimates
    with 1/(M-1) (variance) or the errors about g* with 1/M (MSE)."""
    M = x.shape[0]
    if stat == "variance":
        return x - x.mean(0), 1.0 / (M - 1)
    return x - ref, 1.0 / M


def _rows_gram(h: torch.Tensor, xa: torch.Tensor, xb: torch.Tensor, ref: torch.Tensor,
               stat: str) -> torch.Tensor:
    """``A B^T`` of two sets' :func:`_rows` read from ``h = X_a X_b^T`` (a Gram matrix when
    a = b): centring costs O(M^2), not O(M^2 K)."""
    if stat == "variance":
        return h - h.mean(1, keepdim=True) - h.mean(0, keepdim=True) + h.mean()
    return h - (xa @ ref)[:, None] - (xb @ ref)[None, :] + float(ref @ ref)


def _quad_cov(a: torch.Tensor, wa: float, b: torch.Tensor, wb: float, K: int,
              ab: torch.Tensor) -> float:
    """Covariance over the CountSketch of ``sum_m wa ||S a_m||^2`` and ``sum_n wb ||S b_n||^2``
    from the sketched rows and their cross Gram ``ab = A B^T``.

    For fixed D-space rows it is ``(2/K) (F - Delta)`` (CountSketch's ``Cov[<Sx, Sy>, <Sz,
    Sw>] = (<x,z><y,w> + <x,w><y,z> - 2 sum_i x_i y_i z_i w_i) / K``), with ``F = sum_{m,n}
    wa wb <a_m, b_n>^2`` and the fourth-moment term ``Delta = sum_i c_{a,i} c_{b,i}``, ``c_{a,i}
    = sum_m wa a_{m,i}^2``. Their sketched analogues (with ``QQ = Q_a Q_b``, ``P = sum_k
    c_{a,k} c_{b,k}`` over buckets) have expectations, over S,

        E[QQ^] = QQ + (2/K) F - (2/K) Delta
        E[F^]  = QQ/K + (1 + 1/K) F - (2/K) Delta
        E[P^]  = QQ/K + (2/K) F + (1 - 3/K) Delta

    solved for (QQ, F, Delta): unbiased plug-ins, Delta kept in [0, F]. K <= 3 leaves the
    system singular: Delta = 0 there, an upper bound."""
    f = wa * wb * float((ab * ab).sum())
    ca, cb = wa * (a * a).sum(0), wb * (b * b).sum(0)
    qq = float(ca.sum()) * float(cb.sum())
    if K <= 3:
        return 2 * f / K
    return _unbiased_cov(qq, f, float(ca @ cb), K)


def _unbiased_cov(qq: float, f: float, p: float, K: int) -> float:
    """``(2/K) (F - Delta)`` from the sketched ``QQ^``, ``F^`` and ``P^`` of
    :func:`_quad_cov` (its 3 x 3 system solved; Delta kept in [0, F]; K > 3)."""
    A = torch.tensor([[1, 2 / K, -2 / K], [1 / K, 1 + 1 / K, -2 / K], [1 / K, 2 / K, 1 - 3 / K]],
                     dtype=torch.float64, device="cpu")
    rhs = torch.tensor([qq, f, p], dtype=torch.float64, device="cpu")
    _, F, d = (float(v) for v in torch.linalg.solve(A, rhs))
    F = max(F, 0.0)
    return 2 * (F - min(max(d, 0.0), F)) / K


def sketch_sd(estimates: torch.Tensor, reference: torch.Tensor, K: int, *,
              gram: torch.Tensor | None = None,
              mean: torch.Tensor | None = None) -> dict[str, float]:
    """Standard deviation, over the random CountSketch, of variance, MSE and projection.

    The variance is ``sum_m ||S u_m||^2 / (M-1)`` (u centred), the MSE ``sum_m ||S e_m||^2 / M``
    (e = x - g*): a sketched quadratic whose variance is ``(2/K) (||C||_F^2 - sum_i C_ii^2)``
    (:func:`_quad_cov`, C the D-space second moment), ``||C||_F^2`` read from the sketched
    Gram matrix and the fourth-moment term ``sum_i C_ii^2`` from its per-bucket analogue. The
    projection ``<S g_bar, S g*> / ||S g*||^2`` has both sides sketched by one S; to first
    order its error is ``<S y, S g*> / ||g*||^2`` with ``y = g_bar - p g*`` (the part of g_bar
    off g*), so ``Var = (||y||^2 ||g*||^2 - 2 sum_i y_i^2 g*_i^2) / (K ||g*||^4)``: near 0 when
    g_bar is along g*, as the reference's own sketch error cancels. All plug-ins from the
    sketched vectors, the sample taken as fixed (float64; tested against sketch draws).
    ``mean``: the exact ``E g_hat`` (an exact cell's projection is at it, not at the sample's
    g_bar: y is then exact, 0 where E g_hat is along g*, as for reward-only schemes with two
    reward levels).
    """
    x = estimates.detach().to(torch.float64)
    ref = reference.detach().to(torch.float64).reshape(-1)
    M = x.shape[0]
    _check_gram(gram, M)
    G = gram_matrix(x) if gram is None else gram.to(torch.float64)
    out = {}
    for stat in ("variance", "mse"):
        a, w = _rows(x, ref, stat)
        out[stat] = _quad_cov(a, w, a, w, K, _rows_gram(G, x, x, ref, stat)) ** 0.5
    gg = float(ref @ ref)
    if gg > 0:
        gbar = x.mean(0) if mean is None else mean.detach().to(torch.float64).reshape(-1)
        y = gbar - float(gbar @ ref) / gg * ref
        # the sketched y = S g_bar - p S g* is S y less its own error along S g*, so
        # E[||y||^2 ||g*||^2] = (1 - 1/K) ||y||^2 ||g*||^2 and E[sum_k y_k^2 g*_k^2] =
        # (1 - 3/K) Delta + ||y||^2 ||g*||^2 / K (first order; <y, g*> = 0): solved for both
        yg = float(y @ y) * gg / (1 - 1 / K)
        d = 0.0 if K <= 3 else min(max(
            (float((y * y) @ (ref * ref)) - yg / K) / (1 - 3 / K), 0.0), yg / 2)
        out["projection"] = max(yg - 2 * d, 0.0) ** 0.5 / (K ** 0.5 * gg)
    else:  # g* = 0 (every reference response scored the same): the projection is undefined
        out["projection"] = float("nan")
    return out


@dataclass(frozen=True)
class QuadForm:
    """A D-space matrix known through sketched rows: ``A = V^T (diag(w) + U C U^T) V`` for rows
    ``V [R, K]`` (shared by every form of one table: the sketched ``S v_j``), ``w [R]``, ``U
    [R, c]``, ``C [c, c]`` symmetric (float64, host). An exact cell's covariance of ``g_hat``
    (its variance ``tr A``) or second moment about g* (its MSE) is one
    (:func:`~varbench.analysis.oracle.exact_moments`' ``forms``); signed weights are fine."""

    w: torch.Tensor
    U: torch.Tensor
    C: torch.Tensor

    def combine(self, a: float, other: QuadForm, b: float) -> QuadForm:
        """The form of ``a A + b B`` (the same rows)."""
        c1, c2 = self.C.shape[0], other.C.shape[0]
        C = torch.zeros(c1 + c2, c1 + c2, dtype=torch.float64, device="cpu")
        C[:c1, :c1], C[c1:, c1:] = a * self.C, b * other.C
        return QuadForm(a * self.w + b * other.w, torch.cat([self.U, other.U], 1), C)

    def trace(self, gram: torch.Tensor) -> float:
        """``tr A`` from the rows' Gram matrix ``V V^T`` (the exact sketched value)."""
        return float(self.w @ gram.diagonal() + (self.C * (self.U.T @ gram @ self.U)).sum())


def form_sketch_var(form: QuadForm, rows: torch.Tensor, K: int, *,
                    gram: torch.Tensor | None = None) -> float:
    """Variance over the CountSketch of ``tr(S A S^T)`` for a fixed D-space ``A`` seen through
    its sketched form (:class:`QuadForm`), ``(2/K) (||A||_F^2 - sum_i A_ii^2)``, by the
    unbiased plug-ins of :func:`_quad_cov` (``QQ^ = (tr A_S)^2``, ``F^ = ||A_S||_F^2``, ``P^ =
    sum_k (A_S)_kk^2``, A_S the sketched matrix). From the whole form, not a sample of it: an
    exact cell's sketch SD without the sampling noise and the ``sum_m ||a_m||^4 / M`` excess
    of a plug-in over M sampled groups (which made exact-sketched ratios' intervals 1.2-2x
    too wide: docs/science.md, coverage). ``rows`` ``[R, K]``; ``gram`` its ``V V^T`` if
    formed. Cost O(R^2 (K + c)); A_S itself (K x K) is never formed."""
    V = rows.detach().to(torch.float64)
    H = V @ V.T if gram is None else gram.to(torch.float64)
    w, U, C = form.w, form.U, form.C
    Y = H @ U  # [R, c]
    Z = U.T @ Y  # U^T H U
    tr = float(w @ H.diagonal() + (C * Z).sum())
    # ||V^T W V||_F^2 = tr(W H W H), W = diag(w) + U C U^T, term by term (no R x R product)
    CZ = C @ Z
    f = float(w @ (H * H) @ w + 2 * (C * (Y.T @ (w[:, None] * Y))).sum() + (CZ * CZ.T).sum())
    Q = U.T @ V  # [c, K]
    diag = w @ (V * V) + ((C @ Q) * Q).sum(0)  # (A_S)_kk
    if K <= 3:
        return max(2 * f / K, 0.0)
    return _unbiased_cov(tr * tr, f, float(diag @ diag), K)


def exact_sketch_sd(forms: dict[str, QuadForm], rows: torch.Tensor, K: int, *,
                    gram: torch.Tensor | None = None) -> dict[str, float]:
    """``{stat: sd}``: the CountSketch's SD of exact cells' ``tr(S A S^T)`` per stat (variance,
    MSE) from their forms (:func:`form_sketch_var`)."""
    H = gram if gram is not None else rows.double() @ rows.double().T
    return {k: form_sketch_var(f, rows, K, gram=H) ** 0.5 for k, f in forms.items()}


def exact_pair_sd(forms_a: dict[str, QuadForm], forms_b: dict[str, QuadForm],
                  rows: torch.Tensor, K: int, *,
                  gram: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
    """``{stat: {log_ratio, diff}}``: SDs over ONE CountSketch draw of two exact cells'
    ``log(a / b)`` (first order: ``tr(S (A/a - B/b) S^T)``) and ``a - b``, each the variance of
    one difference form (:func:`form_sketch_var`), not ``V_a + V_b - 2 C_ab``: the two errors
    are nearly equal (one S), their difference 1e-2 of either, so a difference of separately
    clamped terms would be mostly rounding and clamp."""
    H = gram if gram is not None else rows.double() @ rows.double().T
    out = {}
    for k in forms_a:
        fa, fb = forms_a[k], forms_b[k]
        a, b = fa.trace(H), fb.trace(H)
        rel = (form_sketch_var(fa.combine(1 / a, fb, -1 / b), rows, K, gram=H) ** 0.5
               if a > 0 and b > 0 else float("nan"))
        out[k] = {"log_ratio": rel,
                  "diff": form_sketch_var(fa.combine(1.0, fb, -1.0), rows, K, gram=H) ** 0.5}
    return out


def sketch_pair_sd(estimates_a: torch.Tensor, estimates_b: torch.Tensor,
                   reference: torch.Tensor, K: int, *, stats: tuple[str, ...] = ("variance", "mse"),
                   gram_a: torch.Tensor | None = None,
                   gram_b: torch.Tensor | None = None) -> dict[str, dict[str, float]]:
    """``{stat: {log_ratio, diff}}``: SDs over the CountSketch of ``log(stat_a / stat_b)`` and
    ``stat_a - stat_b`` for two schemes' estimates on the SAME groups and ONE sketch draw:
    ``Var(log a - log b) = V_a/a^2 + V_b/b^2 - 2 C_ab/(a b)`` (first order) with the covariance
    ``C_ab`` of the two errors (:func:`_quad_cov` of their cross Gram matrix, one O(M^2 K)
    product for every stat). The two errors are strongly positively correlated (one S), so
    this is much smaller than ``sd_a/a + sd_b/b``."""
    for st in stats:
        check_choice("stat", st, ("variance", "mse"))
    xa = estimates_a.detach().to(torch.float64)
    xb = estimates_b.detach().to(torch.float64)
    ref = reference.detach().to(torch.float64).reshape(-1)
    if xa.shape != xb.shape:
        raise UsageError(f"paired schemes need the same groups: {list(xa.shape)} vs "
                         f"{list(xb.shape)}")
    M = xa.shape[0]
    _check_gram(gram_a, M, "gram_a")
    _check_gram(gram_b, M, "gram_b")
    ga = gram_matrix(xa) if gram_a is None else gram_a.to(torch.float64)
    gb = gram_matrix(xb) if gram_b is None else gram_b.to(torch.float64)
    h = xa @ xb.T
    out = {}
    for stat in stats:
        a, wa = _rows(xa, ref, stat)
        b, wb = _rows(xb, ref, stat)
        aa, bb = _rows_gram(ga, xa, xa, ref, stat), _rows_gram(gb, xb, xb, ref, stat)
        va, vb = _quad_cov(a, wa, a, wa, K, aa), _quad_cov(b, wb, b, wb, K, bb)
        cab = _quad_cov(a, wa, b, wb, K, _rows_gram(h, xa, xb, ref, stat))
        qa, qb = wa * float(aa.diagonal().sum()), wb * float(bb.diagonal().sum())
        diff = max(va + vb - 2 * cab, 0.0) ** 0.5
        rel = (max(va / qa**2 + vb / qb**2 - 2 * cab / (qa * qb), 0.0) ** 0.5
               if qa > 0 and qb > 0 else float("nan"))
        out[stat] = {"log_ratio": rel, "diff": diff}
    return out


def widen(st: dict[str, float], sd: float, z: float, *, log: bool = False) -> dict[str, float]:
    """Add a sketch standard deviation in quadrature to an SE and to both sides of an interval
    ``{value, se, ci_low, ci_high}``; ``log``: ``sd`` is of ``log value`` and the sides are
    widened on the log scale (a ratio's interval stays positive)."""
    if sd == 0 or not math.isfinite(sd):
        return st
    v = st["value"]
    if not log:
        return {**st, "se": math.hypot(st["se"], sd),
                "ci_low": v - math.hypot(v - st["ci_low"], z * sd),
                "ci_high": v + math.hypot(st["ci_high"] - v, z * sd)}
    if not v > 0 or not st["ci_low"] > 0:
        return {**st, "se": math.hypot(st["se"], v * sd)}
    lo, hi = math.log(st["ci_low"] / v), math.log(st["ci_high"] / v)
    return {**st, "se": math.hypot(st["se"], v * sd),
            "ci_low": v * math.exp(-math.hypot(lo, z * sd)),
            "ci_high": v * math.exp(math.hypot(hi, z * sd))}


def planned_groups(pilot_rel_se: float, *, pilot: int, step: int, floor: int, cap: int,
                   target: float) -> int:
    """Groups of the reported sample by a two-stage (Stein) rule: the largest tracked relative
    SE of a pilot of ``pilot`` groups, scaled as ``1/sqrt(M)``, meets ``target`` at
    ``pilot (rel / target)^2`` groups; rounded up to whole steps, within [floor, cap].

    The reported intervals then rest on groups drawn apart from the pilot, so M does not depend
    on their own SE: growing M until the sample's own SE met the target favoured samples whose
    SE happened to be small (0.91-0.92 coverage, docs/science.md). An unknown pilot SE (NaN):
    the cap."""
    if pilot < 3 or step < 1 or cap < floor or floor < 1:
        raise UsageError(f"the two-stage M needs pilot >= 3, step >= 1 and 1 <= floor <= cap; "
                         f"got pilot={pilot}, step={step}, floor={floor}, cap={cap}")
    if not target > 0:
        raise UsageError(f"target={target!r} is not valid; expected a relative SE > 0")
    if not math.isfinite(pilot_rel_se):
        return cap
    need = pilot * (pilot_rel_se / target) ** 2
    return int(min(cap, max(floor, step * math.ceil(need / step))))
