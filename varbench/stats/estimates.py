"""Statistics with uncertainty: bootstrap correlations over sequences, variance of group estimates.

Two families, both pure functions of tensors / arrays (no models):

- ``correlations``: Pearson (raw and log), Spearman and Kendall correlations of paired per-token
  (or per-sequence) values with percentile bootstrap CIs that resample *sequences* (every token of
  a drawn sequence comes along), because tokens of one sequence are not independent.
- ``variance_stats`` / ``paired_compare``: the docs/science.md section 5 statistics of M independent
  group estimates ``X [M, D]`` against a reference gradient ``g* [D]``, each with a delete-one
  jackknife standard error over the M groups. Everything is computed from the Gram matrix
  ``X X^T`` and ``X g*``, so D may be large (a flat gradient) or small (a sketch) at the same cost.
  Paired comparisons between two schemes that share the same sampled groups jackknife the ratio
  (or difference) jointly, so the shared sampling noise cancels in the SE.

Caveat: the SEs condition on the reference ``g*``; a sampled reference has its own SE, reported
separately by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from varbench._util.checks import UsageError

CORRELATION_METHODS = ("pearson", "pearson_log", "spearman", "kendall")
# Magnitude agreement of y with x (not part of the default methods; ask for them by name):
# loglog_slope = OLS slope of log y on log x (1: proportional), top5_share_y / top5_share_x =
# share of the total held by the top 5% of values, top5_share_y_by_x = share of y's total held
# by the 5% of tokens that x ranks highest (what a weighting by x would concentrate on).
MAGNITUDE_METHODS = ("loglog_slope", "top5_share_y", "top5_share_x", "top5_share_y_by_x")
VARIANCE_STATS = (
    "variance",
    "bias",
    "bias2_debiased",
    "mse",
    "cosine",
    "snr",
    "variance_x_tokens",
    "noise_scale",
    "signal_norm2",
    "projection",
    "cosine_nonzero",
    "frac_zero",
)


def _as_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).ravel()


def _corr(method: str, x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 3 or (method in CORRELATION_METHODS
                      and (np.all(x == x[0]) or np.all(y == y[0]))):
        return float("nan")
    if method == "pearson":
        return float(np.corrcoef(x, y)[0, 1])
    if method == "pearson_log":
        keep = (x > 0) & (y > 0)
        if keep.sum() < 3:
            return float("nan")
        lx, ly = np.log(x[keep]), np.log(y[keep])
        if np.all(lx == lx[0]) or np.all(ly == ly[0]):
            return float("nan")
        return float(np.corrcoef(lx, ly)[0, 1])
    if method == "spearman":
        return float(np.corrcoef(sps.rankdata(x), sps.rankdata(y))[0, 1])
    if method == "kendall":
        return float(sps.kendalltau(x, y).statistic)
    if method == "loglog_slope":
        keep = (x > 0) & (y > 0)
        if keep.sum() < 3:
            return float("nan")
        lx, ly = np.log(x[keep]), np.log(y[keep])
        vx = float(((lx - lx.mean()) ** 2).sum())
        return float(((lx - lx.mean()) * (ly - ly.mean())).sum() / vx) if vx > 0 else float("nan")
    if method in ("top5_share_y", "top5_share_x", "top5_share_y_by_x"):
        k = max(1, int(math.ceil(0.05 * x.size)))
        key = y if method == "top5_share_y" else x
        val = x if method == "top5_share_x" else y
        top = np.argsort(-key, kind="stable")[:k]
        total = float(val.sum())
        return float(val[top].sum() / total) if total > 0 else float("nan")
    raise UsageError(f"method={method!r} is not valid; choose one of "
                     f"{list(CORRELATION_METHODS + MAGNITUDE_METHODS)}")


def correlations(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    seq_ids: np.ndarray | torch.Tensor,
    *,
    methods: Sequence[str] = CORRELATION_METHODS,
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Correlations of paired values ``x``, ``y`` [N] with bootstrap CIs resampling sequences.

    ``seq_ids`` [N] names the sequence each value belongs to (any integers). Each bootstrap draw
    resamples the distinct sequences with replacement and keeps all their values. Returns one row
    per method: ``method, estimate, ci_low, ci_high, se`` (bootstrap std), ``n`` (values),
    ``n_seq``. ``pearson_log`` uses log values and drops non-positive pairs (true norms are
    heavy-tailed; the proxy lies in [0, 2)). NaN where a correlation is undefined (constant input).
    """
    for m in methods:
        if m not in CORRELATION_METHODS + MAGNITUDE_METHODS:
            raise UsageError(
                f"methods contains {m!r}; choose from "
                f"{list(CORRELATION_METHODS + MAGNITUDE_METHODS)}"
            )
    if not 0 < level < 1:
        raise UsageError(f"level={level!r} is not valid; expected a number in (0, 1)")
    x = _as_np(x).astype(np.float64)
    y = _as_np(y).astype(np.float64)
    sid = _as_np(seq_ids)
    if not (x.shape == y.shape == sid.shape):
        raise UsageError(
            f"x, y and seq_ids must have the same length, got {x.size}, {y.size}, {sid.size}"
        )
    # Group value indices by sequence so a draw of sequences maps to a gather of values.
    uniq, inv = np.unique(sid, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv, minlength=uniq.size)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rng = np.random.default_rng(seed)
    boots = {m: np.empty(n_boot) for m in methods}
    for b in range(n_boot):
        pick = rng.integers(0, uniq.size, uniq.size)
        lens = counts[pick]
        # Positions start[pick] + 0..len-1, flattened without a Python loop over sequences.
        base = np.repeat(starts[pick] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
        idx = order[base + np.arange(lens.sum())]
        for m in methods:
            boots[m][b] = _corr(m, x[idx], y[idx])
    alpha = (1 - level) / 2
    rows = []
    for m in methods:
        bs = boots[m][np.isfinite(boots[m])]
        lo, hi = (np.quantile(bs, [alpha, 1 - alpha]) if bs.size else (np.nan, np.nan))
        rows.append(
            {
                "method": m,
                "estimate": _corr(m, x, y),
                "ci_low": float(lo),
                "ci_high": float(hi),
                "se": float(bs.std(ddof=1)) if bs.size > 1 else float("nan"),
                "n": int(x.size),
                "n_seq": int(uniq.size),
            }
        )
    return pd.DataFrame(rows)


def moment_statistics(
    variance: float | torch.Tensor,
    mean_norm2: float | torch.Tensor,
    bias2: float | torch.Tensor,
    tokens: float | torch.Tensor,
    n: float = math.inf,
) -> dict[str, torch.Tensor]:
    """The statistics derived from the moments of ``n`` group estimates (docs/science.md §5).

    ``variance`` V, ``mean_norm2`` = ||g_bar||^2, ``bias2`` = ||g_bar - g*||^2 and ``tokens``
    (mean tokens per group), float64 scalars or tensors (broadcast; a float goes to the host).
    ``n = inf``: exact moments (g_bar = E g_hat, so the V/n corrections vanish). Returns
    float64 tensors of ``variance``, ``bias``, ``bias2_debiased``, ``signal_norm2``, ``snr``,
    ``noise_scale`` and ``variance_x_tokens``: the one definition of each, for the Monte Carlo
    cells (:func:`variance_stats`) and the exact cells alike.
    """
    var, gbar2, b2, tok = (
        v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64, device="cpu")
        for v in (variance, mean_norm2, bias2, tokens)
    )
    signal2 = gbar2 - var / n  # unbiased estimate of ||E g_hat||^2
    tiny = torch.finfo(torch.float64).tiny
    return {
        "variance": var,
        "bias": b2.clamp(min=0).sqrt(),
        "bias2_debiased": b2 - var / n,
        "snr": gbar2 / var.clamp(min=tiny),
        "variance_x_tokens": var * tok,
        # NaN where the signal is not resolved (its unbiased estimate is <= 0).
        "noise_scale": torch.where(signal2 > 0, var / signal2.clamp(min=tiny), torch.nan),
        "signal_norm2": signal2,
    }


def _stats_from_sums(n, sumsq, ss, sumxg, gg, sumcos, tokens, nnz):
    """Every variance statistic from sufficient sums over n group estimates (broadcasts)."""
    var = (sumsq - ss / n) / (n - 1)
    gbar2 = ss / n**2
    return {
        **moment_statistics(var, gbar2, gbar2 - 2 * sumxg / n + gg, tokens, n),
        "mse": (sumsq - 2 * sumxg) / n + gg,
        "cosine": sumcos / n,
        # E[g_hat] . g* / ||g*||^2: 1 for an unbiased scheme, (G-1)/G for centered
        "projection": sumxg / n / gg,
        # the mean cosine over groups whose estimate is not exactly 0 (an all-agree group's
        # zero estimate has no direction)
        "cosine_nonzero": sumcos / nnz,
        "frac_zero": 1 - nnz / n,
    }


def _jackknife_parts(x: torch.Tensor, ref: torch.Tensor | None, tokens: torch.Tensor | None):
    """Full-sample and leave-one-out statistics of x [M, D]; each value is a dict of tensors."""
    x = x.detach().to(torch.float64)
    M = x.shape[0]
    # only the Gram matrix's diagonal and row sums enter: rows = x (sum_m x_m), O(M D) not
    # the O(M^2 D) of x x^T (at M = 2048 groups, D = 4096 that was most of an analysis)
    sq = (x * x).sum(1)
    rows = x @ x.sum(0)
    ss = rows.sum()
    if ref is None:
        xg = torch.zeros(M, dtype=torch.float64, device=x.device)
        gg = torch.zeros((), dtype=torch.float64, device=x.device)
    else:
        ref = ref.detach().to(torch.float64).reshape(-1)
        xg = x @ ref
        gg = ref @ ref
    norms = sq.sqrt() * gg.sqrt()
    cos = torch.where(norms > 0, xg / norms.clamp(min=1e-300), torch.zeros_like(xg))
    nz = (sq > 0).double()
    tok = (
        torch.ones(M, dtype=torch.float64, device=x.device)
        if tokens is None
        else torch.as_tensor(tokens, dtype=torch.float64, device=x.device).reshape(M)
    )
    full = _stats_from_sums(M, sq.sum(), ss, xg.sum(), gg, cos.sum(), tok.mean(), nz.sum())
    loo = _stats_from_sums(
        M - 1,
        sq.sum() - sq,
        ss - 2 * rows + sq,
        xg.sum() - xg,
        gg,
        cos.sum() - cos,
        (tok.sum() - tok) / (M - 1),
        nz.sum() - nz,
    )
    if ref is None:
        for k in ("bias", "bias2_debiased", "mse", "cosine", "projection", "cosine_nonzero"):
            full[k] = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
            loo[k] = torch.full((M,), float("nan"), dtype=torch.float64, device=x.device)
    return full, loo


def _jk_se(loo: torch.Tensor) -> float:
    M = loo.shape[0]
    if not torch.isfinite(loo).all():
        return float("nan")
    return float(((M - 1) / M * ((loo - loo.mean()) ** 2).sum()).sqrt())


def _check_estimates(estimates: torch.Tensor, ref: torch.Tensor | None) -> None:
    if not isinstance(estimates, torch.Tensor) or estimates.dim() != 2:
        raise UsageError(
            "estimates must be a [M, D] tensor of group estimates, got "
            f"{getattr(estimates, 'shape', type(estimates).__name__)}"
        )
    if estimates.shape[0] < 3:
        raise UsageError(
            f"estimates has M={estimates.shape[0]} groups; the jackknife needs M >= 3"
        )
    if not torch.isfinite(estimates).all():
        raise UsageError("estimates contains NaN or inf")
    if ref is not None and ref.numel() != estimates.shape[1]:
        raise UsageError(
            f"reference has {ref.numel()} entries, expected D={estimates.shape[1]} "
            "(the second dimension of estimates)"
        )


def variance_stats(
    estimates: torch.Tensor,
    reference: torch.Tensor | None = None,
    *,
    tokens: torch.Tensor | None = None,
) -> dict[str, tuple[float, float]]:
    """Variance statistics of M group estimates with jackknife SEs: ``{name: (value, se)}``.

    ``estimates`` [M, D]: one gradient estimate (flat or sketched) per independent group.
    ``reference`` [D]: g*, or None (bias, MSE and cosine are then NaN). ``tokens`` [M]: tokens
    sampled by each group (for ``variance_x_tokens``; 1 if None). Statistics (docs/science.md §5):
    ``variance`` = 1/(M-1) sum ||g_m - g_bar||^2; ``bias`` = ||g_bar - g*||; ``bias2_debiased`` =
    ||g_bar - g*||^2 - V/M; ``mse`` = mean ||g_m - g*||^2; ``cosine`` = mean cos(g_m, g*);
    ``snr`` = ||g_bar||^2 / V; ``variance_x_tokens`` = V * mean tokens; ``signal_norm2`` =
    ||g_bar||^2 - V/M (unbiased for ||E g_hat||^2); ``noise_scale`` = V / signal_norm2, the simple
    noise scale B_simple = tr Sigma / ||G||^2 with one *group* as the sample unit
    (NaN when signal_norm2 <= 0); ``projection`` = mean g_m . g* / ||g*||^2 (the scale of E g_hat
    along g*); ``cosine_nonzero`` = mean cosine over the groups with g_m != 0; ``frac_zero`` =
    share of groups with g_m = 0 exactly.
    Caveat: SEs are delete-one jackknife over groups and condition on g*.
    """
    _check_estimates(estimates, reference)
    full, loo = _jackknife_parts(estimates, reference, tokens)
    return {k: (float(full[k]), _jk_se(loo[k])) for k in VARIANCE_STATS}


def paired_compare(
    estimates_a: torch.Tensor,
    estimates_b: torch.Tensor,
    reference: torch.Tensor | None = None,
    *,
    stat: str = "variance",
    tokens_a: torch.Tensor | None = None,
    tokens_b: torch.Tensor | None = None,
) -> dict[str, float]:
    """Compare ``stat`` of two schemes evaluated on the SAME M sampled groups (paired design).

    ``estimates_a``, ``estimates_b`` [M, D]: row m of both comes from the same group m. Returns
    ``ratio`` = stat_a / stat_b and ``diff`` = stat_a - stat_b, each with a jackknife SE that
    deletes group m from both at once (so the shared sampling noise cancels).
    """
    if stat not in VARIANCE_STATS:
        raise UsageError(f"stat={stat!r} is not valid; choose one of {list(VARIANCE_STATS)}")
    _check_estimates(estimates_a, reference)
    _check_estimates(estimates_b, reference)
    if estimates_a.shape[0] != estimates_b.shape[0]:
        raise UsageError(
            f"paired schemes need the same groups: M={estimates_a.shape[0]} vs "
            f"{estimates_b.shape[0]}"
        )
    fa, la = _jackknife_parts(estimates_a, reference, tokens_a)
    fb, lb = _jackknife_parts(estimates_b, reference, tokens_b)
    a, b, a_l, b_l = fa[stat], fb[stat], la[stat], lb[stat]
    ratio = float(a / b) if float(b) != 0 else float("nan")
    return {
        "a": float(a),
        "b": float(b),
        "ratio": ratio,
        "ratio_se": _jk_se(a_l / b_l) if math.isfinite(ratio) else float("nan"),
        "diff": float(a - b),
        "diff_se": _jk_se(a_l - b_l),
    }

