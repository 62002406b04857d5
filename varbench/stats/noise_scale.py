"""The gradient noise scale of M group estimates, with a bootstrap-t interval (docs/science.md,
"Planner").

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018): the simple noise scale
``B = tr Sigma / ||g||^2`` of per-example gradients with covariance Sigma and mean g is the batch
size at which a step's noise equals its signal. varbench's sample unit is one *group* estimate
(``noise_scale = V / signal_norm2`` of :func:`varbench.stats.estimates.moment_statistics`, one
definition); a group of G responses whose estimate has variance V carries per response
``B = G * V / ||E g_hat||^2`` (for the raw estimator, a mean of G i.i.d. terms, exactly
McCandlish's ``tr Sigma / ||g||^2``), so a step of P responses (P / G groups) has
noise-to-signal ratio ``B / P``.

The interval resamples the M groups (the cells' bootstrap-t over groups,
:mod:`varbench.stats.intervals`), on the log scale (B is positive), each resample's
statistic and influence-function SE computed from the Gram matrix ``X X^T`` in O(M^2).
Caveats: a resample whose signal is not resolved (``||g_bar||^2 <= V / M``) has no B and is
dropped (fewer than half resolved: no interval); a sketch's own error is not in the interval.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError
from varbench.stats.estimates import moment_statistics
from varbench.stats.intervals import (
    INTERVAL_METHODS,
    _bootstrap_t,
    _check_gram,
    _se,
    gram_matrix,
)

__all__ = ["noise_scale", "noise_scale_interval"]


def _weighted(gram: torch.Tensor, w: torch.Tensor, group_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B [R], influence values [R, M]) of group weights ``w [R, M]`` (a resample's counts)."""
    n = w.sum(-1, keepdim=True)  # [R, 1]
    gw = w @ gram / n  # [R, M]: x_m . x_bar
    xbar2 = (gw * w).sum(-1, keepdim=True) / n  # ||x_bar||^2
    d = gram.diagonal()[None, :] - 2 * gw + xbar2  # ||x_m - x_bar||^2
    var = (w * d).sum(-1, keepdim=True) / (n - 1)
    stats = moment_statistics(var, xbar2, torch.zeros_like(var), torch.ones_like(var), n)
    b = group_size * stats["noise_scale"]
    signal = stats["signal_norm2"]
    # first-order influence of group m: IF_V = d n/(n-1) - V, IF_{||x_bar||^2} = 2 (x_m.x_bar -
    # ||x_bar||^2), IF_S = IF_{||x_bar||^2} - IF_V / n, and IF_B = G (IF_V - (B/G) IF_S) / S
    if_v = d * n / (n - 1) - var
    if_s = 2 * (gw - xbar2) - if_v / n
    infl = group_size * (if_v - b / group_size * if_s) / signal
    return b[:, 0], infl


def noise_scale(estimates: torch.Tensor, *, group_size: int = 1,
                gram: torch.Tensor | None = None) -> float:
    """Per-response noise scale ``G * V / (||g_bar||^2 - V/M)`` of M group estimates
    ``[M, D]`` of ``group_size`` responses each (NaN when the signal is not resolved)."""
    x = _checked(estimates, group_size, gram)
    g = gram_matrix(x) if gram is None else gram.to(torch.float64)
    one = torch.ones(1, x.shape[0], dtype=torch.float64, device=g.device)
    return float(_weighted(g, one, group_size)[0][0])


def noise_scale_interval(
    estimates: torch.Tensor,
    *,
    group_size: int = 1,
    level: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
    method: str = "studentized",
    gram: torch.Tensor | None = None,
) -> dict[str, float]:
    """``{value, se, ci_low, ci_high}`` of :func:`noise_scale` by bootstrap-t over the M groups
    (``method="normal"``: value x exp(+-z se / value)); ``gram``: :func:`gram_matrix` of the
    estimates if already formed. NaN interval when the signal is not resolved."""
    if method not in INTERVAL_METHODS:
        raise UsageError(f"method={method!r} is not valid; choose one of {list(INTERVAL_METHODS)}")
    x = _checked(estimates, group_size, gram)
    g = (gram_matrix(x) if gram is None else gram.to(torch.float64)).cpu()  # host statistics

    def fn(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, infl = _weighted(g, w, group_size)
        return b, _se(infl, w)

    th, se, lo, hi = _bootstrap_t(fn, x.shape[0], log=True, level=level, n_boot=n_boot,
                                  seed=seed, method=method)
    return {"value": th, "se": se, "ci_low": lo, "ci_high": hi}


def _checked(estimates: torch.Tensor, group_size: int, gram: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(estimates, torch.Tensor) or estimates.dim() != 2 or estimates.shape[0] < 3:
        raise UsageError("estimates must be a [M >= 3, D] tensor of group estimates, got "
                         f"{list(getattr(estimates, 'shape', []))}")
    if not isinstance(group_size, int) or group_size < 1:
        raise UsageError(f"group_size={group_size!r} is not valid; expected an integer >= 1")
    _check_gram(gram, estimates.shape[0])
    return estimates.detach().to(torch.float64)
