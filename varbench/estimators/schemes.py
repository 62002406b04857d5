"""Group-baseline advantage schemes (docs/science.md §2.1): raw, centered, normalized, rloo, topk,
opo, reinforce_pp_baseline, passk. OTB lives in ``otb.py``.

All of these read the return ``R_i`` (:func:`outcome_rewards`: the outcome reward, or the sum of
token rewards) and broadcast a per-response advantage over the response's valid tokens.

Precision: group means are taken of ``R - min_j R_j`` rather than ``R``. For the nearby rewards
of a near-constant group the subtraction is exact (Sterbenz), so float32 keeps the full relative
precision of the reward *differences* and an all-equal group gives exactly 0.

Groups of size G = 1 follow the ``conventions`` option (``SchemeOptions.conventions``):
``"varbench"`` (default): normalized and rloo have no baseline and return A = R; centered, topk
and opo follow their formula and return 0. ``"verl"`` (verl 0.9.1's loop estimators): every
baseline of a lone response is 0, so A = R (normalized: R / (1 + eps), verl's std of 1);
``"trl"`` (TRL 1.16.0): the group mean is the response itself, A = 0.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError
from varbench.estimators.registry import (
    SchemeOptions,
    register_scheme,
    returns_of,
    valid_lengths,
)

__all__ = ["group_centered", "batch_whiten"]


def _broadcast(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # The registry's final torch.where zeroes masked positions; an expanded view avoids a copy.
    return adv.unsqueeze(-1).expand(mask.shape)


def group_centered(R: torch.Tensor) -> torch.Tensor:
    """``[P, G] -> [P, G]`` ``R_i - mean_j R_j``, computed from ``R - min_j R_j`` (exact shift)."""
    d = R - R.amin(dim=1, keepdim=True)
    return d - d.mean(dim=1, keepdim=True)


def _lone(R: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions, varbench: str,
          verl_scale: float = 1.0) -> torch.Tensor:
    """Advantages of G = 1 groups under ``opts.conventions``; ``varbench``: "R" or "0"."""
    keep = {"varbench": varbench == "R", "verl": True, "trl": False}[opts.conventions]
    if not keep:
        return _broadcast(torch.zeros_like(R), mask)
    return _broadcast(R / verl_scale if opts.conventions == "verl" else R, mask)


@register_scheme("raw")
def raw(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """REINFORCE without baseline: ``A_{i,t} = R_i``. Unbiased; every all-agree group keeps R."""
    return _broadcast(returns_of(rewards, mask), mask)


@register_scheme("centered")
def centered(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Dr. GRPO: ``A_{i,t} = R_i - mean_j R_j``.

    Caveat: the mean contains sample i, so ``E[g_hat] = (G-1)/G g*`` (a positive rescaling).
    """
    R = returns_of(rewards, mask)
    if R.shape[1] == 1:
        return _lone(R, mask, opts, "0")
    return _broadcast(group_centered(R), mask)


@register_scheme("normalized")
def normalized(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """GRPO: ``A_{i,t} = (R_i - mu) / (sigma + eps)``; sigma unbiased unless ``unbiased_std=False``.

    Options: ``eps`` (1e-6), ``unbiased_std`` (True). G = 1 returns A = R (no std exists;
    ``conventions``: verl R / (1 + eps), trl 0). TRL's ``scale_rewards="group"`` is ``eps=1e-4``.
    Bound (any reward scale, exact arithmetic): ``|A_i| <= (G-1)/sqrt(G)`` with the unbiased std,
    ``|A_i| <= sqrt(G-1)`` with the biased one; a near-constant group (1.0 vs 1.00001) therefore
    gets O(1) advantages, not ~0: normalisation amplifies tiny reward differences to full size.
    Biased estimator of the policy gradient (1/sigma depends on the sample).
    """
    R = returns_of(rewards, mask)
    if R.shape[1] == 1:
        # verl's lone std is torch.tensor(1.0), float32: its divisor is float32(1 + eps)
        scale = float(torch.tensor(1.0, dtype=torch.float32) + opts.eps)
        return _lone(R, mask, opts, "R", verl_scale=scale)
    c = group_centered(R)
    sigma = c.std(dim=1, keepdim=True, correction=1 if opts.unbiased_std else 0)
    return _broadcast(c / (sigma + opts.eps), mask)


@register_scheme("rloo")
def rloo(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Leave-one-out: ``A_i = R_i - mean_{j != i} R_j = G/(G-1) (R_i - mu)``. Unbiased.

    G = 1 returns A = R (an empty leave-one-out mean: no baseline).
    """
    R = returns_of(rewards, mask)
    G = R.shape[1]
    if G == 1:
        return _lone(R, mask, opts, "R")
    return _broadcast(group_centered(R) * (G / (G - 1)), mask)


@register_scheme("topk")
def topk(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Centered advantage kept only where ``R_i >= `` the group's k-th largest reward, else 0.

    Option ``k`` (1; k > G keeps everyone). Ties at the k-th reward are all kept, so the result
    is permutation-equivariant. Caveat: this changes the objective (it is not an unbiased
    gradient of expected reward); measure its bias.
    """
    R = returns_of(rewards, mask)
    k = min(opts.k, R.shape[1])
    kth = R.topk(k, dim=1).values[:, k - 1 : k]
    return _broadcast(torch.where(R >= kth, group_centered(R), 0), mask)


@register_scheme("opo")
def opo(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Length-weighted optimal baseline: ``A_i = R_i - sum_j |o_j| R_j / sum_j |o_j|``.

    ``|o_j|`` is the number of valid tokens of response j. Caveat: the baseline contains the
    sample (O(1/G) bias, as for centered).
    """
    R = returns_of(rewards, mask)
    if R.shape[1] == 1:
        return _lone(R, mask, opts, "0")
    L = valid_lengths(mask).to(R.dtype)  # [P, G]
    d = R - R.amin(dim=1, keepdim=True)
    b = (L * d).sum(1, keepdim=True) / L.sum(1, keepdim=True).clamp(min=1)
    return _broadcast(d - b, mask)


@register_scheme("reinforce_pp_baseline", batch_coupled=True)
def reinforce_pp_baseline(
    rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions
) -> torch.Tensor:
    """REINFORCE++-baseline: centered per group, then whitened over the batch's valid tokens.

    ``c_{i,t} = R_i - mu_group``; ``A = (c - mean(c)) / sqrt(var(c) + whiten_eps)`` with the
    token-weighted batch mean and Bessel-corrected variance (as verl's ``masked_whiten``).
    Caveat: batch-coupled (a group's advantages depend on the other groups), and the batch
    re-centring gives an all-agree group ``-mean(c)/std`` rather than 0 (0 when all responses
    have equal length, since then mean(c) = 0).
    """
    R = returns_of(rewards, mask)
    lone = R.shape[1] == 1 and opts.conventions == "verl"  # verl: a lone response keeps R
    c = R if lone else group_centered(R)  # [P, G]
    L = valid_lengths(mask).to(c.dtype)
    return _broadcast(batch_whiten(c, L, opts.whiten_eps, verl=opts.conventions == "verl"), mask)


def batch_whiten(
    c: torch.Tensor, lengths: torch.Tensor, eps: float, *, verl: bool = False
) -> torch.Tensor:
    """``(c - mu) / sqrt(var + eps)`` with mu, var over every valid token of the batch.

    ``c``: per-response values (any shape, e.g. ``[P, G]`` or ``[B]``), broadcast over each
    response's ``lengths`` valid tokens; the variance is Bessel-corrected over tokens, as verl's
    ``masked_whiten``. ``verl=True`` also takes verl's means over ``n + 1e-8`` tokens (its
    ``masked_mean``). Used by reinforce_pp_baseline and by adapters for unequal group sizes.
    """
    n = lengths.sum()
    if verl:
        mu = (c * lengths).sum() / (n + 1e-8)
        var = (lengths * (c - mu) ** 2).sum() / (n + 1e-8) * (n / (n - 1).clamp(min=1))
    else:
        mu = (c * lengths).sum() / n
        var = (lengths * (c - mu) ** 2).sum() / (n - 1).clamp(min=1)
    return (c - mu) * torch.rsqrt(var + eps)


def batch_std(R: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of every response's return in the batch (0-dim; 0 for one response)."""
    return R.reshape(-1).std() if R.numel() > 1 else R.new_zeros(())


def _binom_ratio(a: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """``C(a, k) / C(b, k)`` for integer tensors a <= b (0 when a < k), as a product of k terms."""
    out = torch.ones_like(a, dtype=torch.float64)
    for j in range(k):  # k terms, not a loop over groups or tokens
        out = out * (a - j).clamp(min=0).double() / (b - j)
    return out


@register_scheme("passk")
def passk(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Analytic pass@k advantage for binary rewards (N = G samples, N- of them failed).

    ``Rbar = 1 - C(N-, k)/C(N, k)``, ``sigma = sqrt(Rbar (1 - Rbar))``; correct responses get
    ``(1 - Rbar)/sigma``, failed ones ``(1 - Rbar - C(N- - 1, k-1)/C(N-1, k-1))/sigma``: the mean
    over the k-subsets containing the response of (subset max - Rbar)/sigma. All-agree groups
    (sigma = 0) get 0. Option ``k`` (1; k = 1 equals normalized with the biased std, eps 0).
    Raises ValueError for rewards outside {0, 1} or k > G.
    """
    R = returns_of(rewards, mask)
    N = R.shape[1]
    if opts.k > N:
        raise UsageError(f"k={opts.k} is not valid for passk with G={N}; expected 1 <= k <= G")
    if not bool(((R == 0) | (R == 1)).all()):
        raise UsageError("passk needs binary rewards in {0, 1}; got other values")
    n_fail = (R == 0).sum(1, keepdim=True)  # [P, 1]
    rbar = 1 - _binom_ratio(n_fail, N, opts.k)
    sigma = torch.sqrt(rbar * (1 - rbar))
    fail_hit = _binom_ratio(n_fail - 1, N - 1, opts.k - 1)
    num = torch.where(R == 1, 1 - rbar, 1 - rbar - fail_hit)
    adv = torch.where(sigma > 0, num / torch.where(sigma > 0, sigma, 1), 0)
    return _broadcast(adv.to(R.dtype), mask)


@register_scheme("normalized_batch", batch_coupled=True)
def normalized_batch(
    rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions
) -> torch.Tensor:
    """TRL's ``scale_rewards="batch"``: ``A_i = (R_i - mu_group) / (sigma_batch + eps)``.

    sigma_batch: the Bessel-corrected std of all returns of the batch (TRL's ``nanstd``); TRL
    adds ``eps=1e-4``. Caveat: batch-coupled (one group's advantages depend on the others' rewards
    through sigma_batch), and biased like normalized. G = 1 follows ``conventions`` (varbench and
    trl: 0, the group mean is the response; verl has no such estimator: R / (sigma + eps)).
    """
    R = returns_of(rewards, mask)
    lone = R.shape[1] == 1 and opts.conventions == "verl"
    c = R if lone else group_centered(R)
    return _broadcast(c / (batch_std(R) + opts.eps), mask)
