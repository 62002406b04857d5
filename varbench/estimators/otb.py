"""Optimal Token Baseline (docs/science.md §2.2): ``otb``, ``otb_loo`` and the baseline accessor.

    W_t^i = sum_{j<=t} w_j^i m_j^i          G_t^i = sum_{k>=t} r_k^i m_k^i
    B_t   = sum_i G_t^i W_t^i m_t^i / (sum_i W_t^i m_t^i + baseline_eps)
    A_t^i = (G_t^i - B_t) m_t^i

Positions t are aligned across a group by *generated-token count* (``compact=True``): each
response is conceptually compacted to its mask = 1 tokens, B is computed per compacted position,
then read back at the original positions. Vectorised as a ``scatter_add`` of the per-token terms
into ``[P, T + 1]`` buckets indexed by ``cumsum(mask) - 1`` (masked tokens go to a dump bucket T);
when every mask is a prefix (single turn) the buckets are the positions themselves and a plain
sum over the group is used.
"""

from __future__ import annotations

from typing import Any

import torch

from varbench._util.checks import UsageError, check_finite_at, check_shape
from varbench.estimators.registry import (
    SchemeOptions,
    _binary_mask,
    _build_options,
    _check_rewards_mask,
    _lookup,
    register_scheme,
    togo_of,
)
from varbench.models.logits import proxy_from_logprobs

__all__ = ["otb_baseline", "proxy_from_logprobs", "cumulative_weights"]


def cumulative_weights(mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """``[P, G, T]`` W_t from the options: ``cumulative_weights`` as given, else the cumsum of
    ``w * rho^2`` over valid tokens (w = ``token_weights`` or the proxy). 0 where mask is False.

    ``mask``: ``[P, G, T]`` of 0/1 (bool, int or float); ``opts``: a :class:`SchemeOptions`
    whose tensors are ``[P, G, T]`` and finite where mask is 1 (UsageError naming them).
    """
    check_shape("mask", mask, [None, None, None])
    mask = _binary_mask(mask)
    tensors = {f: getattr(opts, f) for f in ("cumulative_weights", "token_weights", "logprobs",
                                             "sum_pi_sq", "importance_weights")}
    for name, t in tensors.items():
        if t is not None:
            check_shape(name, t, list(mask.shape))
            check_finite_at(name, t, mask)
    return _cumulative(mask, _float_mask(mask, _weight_dtype(opts)), opts)


def _float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0/1 float copy of a bool mask (the uint8 view casts ~2x faster than bool on CPU)."""
    return mask.view(torch.uint8).to(dtype)


def _weight_dtype(opts: SchemeOptions) -> torch.dtype:
    for x in (opts.cumulative_weights, opts.token_weights, opts.logprobs):
        if x is not None:
            return x.dtype
    return torch.get_default_dtype()


def _masked_w(mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Per-token ``w * rho^2`` with exact zeros where mask is False (w = weights or proxy)."""
    if opts.token_weights is not None:
        w = opts.token_weights
    elif opts.logprobs is not None and opts.sum_pi_sq is not None:
        w = proxy_from_logprobs(opts.logprobs, opts.sum_pi_sq)
    else:
        raise UsageError(
            "otb needs token_weights=[P,G,T], or logprobs= and sum_pi_sq= (the proxy), "
            "or cumulative_weights=[P,G,T]"
        )
    if opts.importance_weights is not None:
        w = w * opts.importance_weights**2
    # where (not a product) so that inf/NaN under mask 0 cannot leak into later sums.
    return torch.where(mask, w, 0)


def _cumulative(mask: torch.Tensor, mf: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    if opts.cumulative_weights is not None:
        if opts.importance_weights is not None:
            raise UsageError(
                "importance_weights scale per-token w; pass token_weights (or logprobs and "
                "sum_pi_sq) instead of cumulative_weights when using them"
            )
        return torch.where(mask, opts.cumulative_weights, 0)
    # every value is finite after _masked_w, so a product with the 0/1 mask zeroes the sums
    # carried past a response's end (or through its env tokens).
    return _masked_w(mask, opts).cumsum_(-1).mul_(mf)


def _prefix_lengths(mask: torch.Tensor) -> torch.Tensor | None:
    """``[P, G]`` int64 lengths L_i when every response's mask is a prefix, else None.

    Two reductions: ``argmin`` returns the *first* minimum, i.e. the first 0 (or 0 when a row
    is all ones, told apart by its first token), so the first L_i tokens are valid; hence
    ``sum_i L_i <= count(mask)``, with equality iff no valid token follows a 0 (no env holes).
    """
    P, G, T = mask.shape
    u = mask.view(torch.uint8)
    first0 = u.argmin(-1)
    L = torch.where((first0 == 0) & mask[..., 0], T, first0)
    return L if int(L.sum()) == int(torch.count_nonzero(u)) else None


def _buckets(mask: torch.Tensor) -> torch.Tensor:
    """``[P, G*T]`` compacted position of each token (the dump bucket T for masked ones)."""
    P, G, T = mask.shape
    # A float cumsum counts exactly (integers below 2^24 in float32) and is ~10x faster on CPU
    # than the int64 cumsum of a bool tensor.
    pos = _float_mask(mask, torch.float32 if T < 2**24 else torch.float64).cumsum_(-1)
    return torch.where(mask, pos.sub_(1), T).long().reshape(P, G * T)


def _group_sum(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """Sum ``[P, G, T]`` over the group per (compacted) position and read back: ``[P, G|1, T]``."""
    P, G, T = x.shape
    if idx is None:
        # A batched matvec with ones reads x once, contiguously (faster than x.sum(1)).
        return torch.bmm(x.new_ones(P, 1, G), x)
    acc = x.new_zeros(P, T + 1).scatter_add_(1, idx, x.reshape(P, G * T))
    return acc.gather(1, idx).reshape(P, G, T)


def _aligned_outcome_baseline(
    R: torch.Tensor, mask: torch.Tensor, L: torch.Tensor, opts: SchemeOptions
) -> torch.Tensor:
    """B ``[P, 1, T]`` for outcome rewards and prefix masks (lengths L), without a
    ``[P, G, T]`` cumsum.

    ``sum_{i running at t} R_i W_t^i = cumsum_t(sum_i R_i w_t^i - sum_{i: L_i = t} R_i W^i_tot)``
    (a response that ended would keep contributing its total to the un-masked cumsum), and
    likewise for ``sum_i W_t^i`` and the running count; the steps are scattered at each L_i.
    Caveat: in float32 the ended totals are subtracted from a running sum, so B loses relative
    precision where the ended responses' W dwarfs the running ones'.
    """
    P, G, T = mask.shape
    wm = _masked_w(mask, opts)  # [P, G, T]
    ones = torch.ones_like(R)
    # Per-position increments [P, 3, T] of sum_i R_i W_t^i, sum_i W_t^i and the running count
    # (a zero row here: it only receives the scattered steps below), summed by ONE cumsum.
    inc = torch.bmm(torch.stack([R, ones, torch.zeros_like(R)], dim=1), wm)
    total = wm.sum(-1)  # [P, G]: W of each response at its last token
    # At t = L_i response i stops running: remove its totals and count from there on. A
    # response that runs to T never leaves (its step is zeroed and parked at T - 1).
    step = torch.stack([R * total, total, ones], dim=1).neg_() * (L < T).unsqueeze(1)
    inc.scatter_add_(2, L.clamp(max=T - 1).unsqueeze(1).expand(P, 3, G), step)
    inc[:, 2, 0] += G
    sums = inc.cumsum_(-1)
    B = sums[:, 0] / (sums[:, 1] + opts.baseline_eps)
    if opts.handle_zero_tail:
        B = torch.where(sums[:, 2] == 1, 0, B)  # one response running: B = 0 (A = G_t)
    return B.unsqueeze(1)


def _aligned_outcome_loo_baseline(
    R: torch.Tensor, mask: torch.Tensor, L: torch.Tensor, opts: SchemeOptions
) -> torch.Tensor:
    """B^{(-i)} ``[P, G, T]`` for outcome rewards and prefix masks (junk where mask is False).

    ``B_t^{(-i)} = (S_t - R_i W_t^i) / (D_t - W_t^i + baseline_eps)`` with the group sums
    ``S_t = sum_j R_j W_t^j``, ``D_t = sum_j W_t^j`` (W zeroed past each end), and 0 where no
    other response is running (t >= the group's second-largest length: no [P, G, T] count).
    Same per-token arithmetic as the generic path, with fewer full-size passes: one batched
    matvec gives S and D together, and the buffers are reused in place.
    """
    P, G, T = mask.shape
    W = _masked_w(mask, opts).cumsum_(-1)
    zero = W.new_zeros(())
    W = torch.where(mask, W, zero, out=W)  # ended responses leave the group sums
    sums = torch.bmm(torch.stack([R, torch.ones_like(R)], dim=1), W)  # [P, 2, T]: S_t, D_t
    num = torch.addcmul(sums[:, :1], R.unsqueeze(-1), W, value=-1)  # S_t - R_i W_t^i
    den = torch.sub(sums[:, 1:], W, out=W).add_(opts.baseline_eps)  # W's buffer is free now
    # At a valid position of i another response runs iff t < the group's 2nd-largest length.
    second = L.topk(2, dim=1).values[:, 1:] if G > 1 else torch.zeros_like(L)  # [P, 1]
    others = (torch.arange(T, device=L.device) < second).unsqueeze(1)  # [P, 1, T]
    return torch.where(others, num.div_(den), zero, out=num)


def _otb_parts(
    rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions, leave_one_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G_t, B_t)``, each broadcastable to ``[P, G, T]``; values under mask False are junk."""
    L = _prefix_lengths(mask)
    prefix = L is not None
    direct = opts.cumulative_weights is not None
    # verl 0.9.1's optimal_token_baseline aligns multi-turn responses by column, with its
    # zero tail from the second-longest *count* (its tir_ variant compacts, as varbench does)
    verl_columns = (opts.conventions == "verl" and not prefix and not leave_one_out
                    and "compact" not in opts.given)
    compact = opts.compact and not verl_columns
    idx = None if prefix or not compact else _buckets(mask)  # None: positions aligned
    if rewards.dim() == 2 and prefix and not direct:
        aligned = _aligned_outcome_loo_baseline if leave_one_out else _aligned_outcome_baseline
        Gt = rewards.unsqueeze(-1)
        B = aligned(rewards, mask, L, opts)
        return Gt, _exact_all_agree(rewards, Gt, B, mask, idx, opts, leave_one_out)
    # option tensors were cast to the rewards' dtype at the boundary
    mf = _float_mask(mask, rewards.dtype)
    W = _cumulative(mask, mf, opts)
    need_count = leave_one_out or opts.handle_zero_tail
    cnt = _group_sum(mf, idx) if need_count else None
    if rewards.dim() == 3:
        Gt = togo_of(rewards, mask)
    else:
        Gt = torch.where(mask, rewards.unsqueeze(-1), 0)
    GW = Gt * W
    num, den = _group_sum(GW, idx), _group_sum(W, idx)
    if leave_one_out:
        num, den, cnt = num - GW, den - W, cnt - mf
    if leave_one_out:
        B = torch.where(cnt > 0, num / (den + opts.baseline_eps), 0)
    else:
        B = num / (den + opts.baseline_eps)
        if verl_columns and mask.shape[1] == 1:  # verl: a group of one has no baseline
            B = torch.zeros_like(B)
        elif opts.handle_zero_tail and verl_columns:
            B = torch.where(_verl_zero_tail(mask), 0, B)
        elif opts.handle_zero_tail:
            B = torch.where(cnt == 1, 0, B)
    return Gt, _exact_all_agree(rewards, Gt, B, mask, idx, opts, leave_one_out)


def _verl_zero_tail(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[P, G, T]``: verl's zero-tail cells, columns ``t >= L_(2)`` of a group's unique
    longest response by token count ``L`` (``L_(2)`` the second-largest count)."""
    P, G, T = mask.shape
    L = mask.sum(-1)  # [P, G]
    top = L.topk(2, dim=1).values  # [P, 2]
    longest = L == top[:, :1]
    unique = (longest.sum(1) == 1) & (top[:, 0] > top[:, 1])  # [P]
    cols = torch.arange(T, device=mask.device) >= top[:, 1:2]  # [P, T]
    return (longest & unique[:, None]).unsqueeze(-1) & cols.unsqueeze(1)


def _exact_all_agree(rewards, Gt, B, mask, idx, opts, leave_one_out):
    """B with ``B = G_t`` exactly in all-agree groups wherever the baseline formula applies.

    ``sum_i G W / (sum_i W + eps)`` with every G equal to R is ``R W / (W + eps)`` plus float
    rounding (~1e-7 in float32), so A = G - B would be a tiny vector along grad log pi instead of
    0. A group is all-agree when every valid token's return is the same (outcome rewards: all
    R_i equal). The tail positions (B = 0 by ``handle_zero_tail``, or no other response for the
    leave-one-out form) keep their formula. ``conventions="verl"`` keeps the formula
    everywhere, as verl computes it (the drop-in reproduces verl, residue included).
    """
    if opts.conventions == "verl":
        return B  # verl's own value: its eps leaves ~1e-8 relative residue in all-agree groups
    if rewards.dim() == 2:
        agree = rewards.amax(1) == rewards.amin(1)  # [P]
    else:
        big = torch.finfo(Gt.dtype).max
        agree = (torch.where(mask, Gt, big).amin((1, 2))
                 == torch.where(mask, Gt, -big).amax((1, 2)))
    if not bool(agree.any()):
        return B
    cnt = _group_sum(_float_mask(mask, Gt.dtype), idx)  # responses running at each position
    tail = (cnt == 1) & (leave_one_out or opts.handle_zero_tail)
    exact = torch.where(tail, B, Gt)
    return torch.where(agree.view(-1, 1, 1), exact, B)


# what OTB reads beyond the rewards: its weights w_t (exact, given cumulatively, or the proxy
# from the sampler's log-probs and sum_pi_sq)
OTB_READS = ("token_weights", "cumulative_weights", "logprobs", "sum_pi_sq")


@register_scheme("otb", output_masked=True, reads=OTB_READS)
def otb(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Optimal Token Baseline: ``A_t^i = (G_t^i - B_t) m_t^i`` (formula in the module docstring).

    Options: ``token_weights`` (w_t), else ``logprobs`` + ``sum_pi_sq`` (proxy), or
    ``cumulative_weights`` (W_t directly); ``importance_weights`` (w scaled by rho^2);
    ``handle_zero_tail`` (True: B_t = 0 where a single response is still running);
    ``compact`` (True: multi-turn alignment); ``baseline_eps`` (1e-8).
    Caveat: the sample is inside its own baseline, an O(1/G) bias (use ``otb_loo``); W ignores
    cross terms between tokens.
    """
    Gt, B = _otb_parts(rewards, mask, opts, leave_one_out=False)
    return _masked_difference(mask, Gt, B)


@register_scheme("otb_loo", output_masked=True, reads=OTB_READS)
def otb_loo(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
    """Leave-one-out OTB: B_t^{(-i)} from the other responses running at t; unbiased.

    Same options as ``otb``. Where no other response is running B = 0 (A = G_t): this is the
    tail handling by construction, so ``handle_zero_tail`` has no effect. G = 1 gives A = R.
    Caveat: the leave-one-out sums are ``total - own term``; in float32, when one response's
    W exceeds the others' by ~1e6 or more the remainder loses precision (use float64).
    """
    Gt, B = _otb_parts(rewards, mask, opts, leave_one_out=True)
    return _masked_difference(mask, Gt, B)


def _masked_difference(mask: torch.Tensor, Gt: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``where(mask, Gt - B, 0)`` written into the difference's own (fresh) buffer."""
    d = (Gt - B).expand(mask.shape).contiguous()  # a no-op unless a broadcast left it short
    return torch.where(mask, d, d.new_zeros(()), out=d)


def otb_baseline(
    rewards: torch.Tensor, mask: torch.Tensor, *, leave_one_out: bool = False, **options: Any
) -> torch.Tensor:
    """The OTB baseline ``B[P, G, T]`` that ``otb`` (or ``otb_loo``) subtracts; 0 where mask is 0.

    Takes the same options as ``advantages("otb", ...)``. Use it to compare baselines directly
    (e.g. mean |B_proxy - B_exact| over valid tokens). For ``[P, G]`` rewards,
    ``advantages("otb", ...) == where(mask, R - B, 0)``.
    """
    name = "otb_loo" if leave_one_out else "otb"
    rewards, m = _check_rewards_mask(rewards, mask)
    opts = _build_options(name, _lookup(name), options, rewards.dtype, m.shape)
    _, B = _otb_parts(rewards, m, opts, leave_one_out=leave_one_out)
    return torch.where(m, B.expand(m.shape), 0)


