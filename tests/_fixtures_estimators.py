"""Random inputs for the estimator tests (seeded torch.Generator; float64 by default)."""

from __future__ import annotations

import numpy as np
import torch


def random_mask(P, G, T, gen, *, multi_turn=False, allow_empty=False):
    """bool [P, G, T]: prefix masks of random length, optionally with env-token holes."""
    lo = 0 if allow_empty else 1
    lengths = torch.randint(lo, T + 1, (P, G), generator=gen)
    mask = torch.arange(T).expand(P, G, T) < lengths.unsqueeze(-1)
    if multi_turn:
        holes = torch.rand(P, G, T, generator=gen) < 0.3
        keep_first = torch.zeros_like(holes)
        keep_first[..., 0] = True
        mask = mask & (~holes | keep_first)
    mask[0, 0, 0] = True  # never an all-empty batch
    return mask


def random_case(P, G, T, seed, *, token_rewards=False, binary=False, multi_turn=False,
                allow_empty=False, dtype=torch.float64):
    """(rewards, mask, options) with every otb option tensor filled."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(P, G, T, gen, multi_turn=multi_turn, allow_empty=allow_empty)
    if binary:
        rewards = (torch.rand(P, G, generator=gen) < 0.5).to(dtype)
    elif token_rewards:
        rewards = torch.randn(P, G, T, generator=gen, dtype=dtype)
    else:
        rewards = torch.randn(P, G, generator=gen, dtype=dtype)
    logits = torch.randn(P, G, T, 5, generator=gen, dtype=dtype) * 2
    probs = logits.softmax(-1)
    logprobs = probs[..., 0].log()
    sum_pi_sq = (probs**2).sum(-1)
    opts = dict(
        token_weights=torch.rand(P, G, T, generator=gen, dtype=dtype) * 2,
        logprobs=logprobs,
        sum_pi_sq=sum_pi_sq,
        importance_weights=0.5 + torch.rand(P, G, T, generator=gen, dtype=dtype),
    )
    return rewards, mask, opts


def loss_inputs(seed, P=2, G=3, T=5, multi_turn=True, spread=0.4):
    """(logp, logp_old, adv, mask) for the policy-loss tests: float64, logp near logp_old."""
    _, mask, _ = random_case(P, G, T, seed, multi_turn=multi_turn, allow_empty=True)
    gen = torch.Generator().manual_seed(100 + seed)
    logp_old = -torch.rand(P, G, T, generator=gen, dtype=torch.float64) * 3
    logp = logp_old + spread * torch.randn(P, G, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(P, G, T, generator=gen, dtype=torch.float64)
    return logp, logp_old, adv, mask


# ---- one formula written in each estimator shape (tests/test_estimators_adapters.py) --------
#
# A[p, i, t] = scale * (R_i - mean_{j != i} R_j) / (1 + eps) + 0.1 * logprobs * sum_pi_sq * rho,
# zero off the mask (R_i: the masked sum of token rewards, or the outcome reward; a missing
# token statistic counts as 0, a missing rho as 1). It reads a SchemeOptions scalar (eps), an
# extra option (scale) and three token statistics, so every way an option travels is exercised.


def _loo(R):
    """[P, G] -> [P, G]: R_i minus the mean of the other rewards of its group (0 for G = 1)."""
    G = R.shape[1]
    if G == 1:
        return torch.zeros_like(R)
    return R - (R.sum(1, keepdim=True) - R) / (G - 1)


def _formula(R, mask, logprobs, sum_pi_sq, rho, eps, scale):
    """R [P, G] (or [B, 1] rows in group order), the rest [P, G, T] -> A [P, G, T]."""
    adv = (scale * _loo(R) / (1 + eps)).unsqueeze(-1).expand(mask.shape)
    if logprobs is not None and sum_pi_sq is not None:
        tok = 0.1 * logprobs * sum_pi_sq
        adv = adv + (tok if rho is None else tok * rho)
    return torch.where(mask != 0, adv, 0)


def shapes_scheme(rewards, mask, opts):
    """The scheme shape: the canonical implementation."""
    R = rewards if rewards.dim() == 2 else torch.where(mask, rewards, 0).sum(-1)
    return _formula(R, mask, opts.logprobs, opts.sum_pi_sq, opts.importance_weights, opts.eps,
                    opts.extra.get("scale", 1.0))


def shapes_keywords(rewards, mask, *, eps=1e-6, logprobs=None, sum_pi_sq=None,
                    importance_weights=None, scale=1.0):
    """The keyword shape with named options (defaults equal to SchemeOptions')."""
    R = rewards if rewards.dim() == 2 else torch.where(mask, rewards, 0).sum(-1)
    return _formula(R, mask, logprobs, sum_pi_sq, importance_weights, eps, scale)


def shapes_kwargs(rewards, mask, **options):
    """The keyword shape with a catch-all ``**options``."""
    R = rewards if rewards.dim() == 2 else torch.where(mask, rewards, 0).sum(-1)
    return _formula(R, mask, options.get("logprobs"), options.get("sum_pi_sq"),
                    options.get("importance_weights"), options.get("eps", 1e-6),
                    options.get("scale", 1.0))


def shapes_verl(token_level_rewards, response_mask, index, old_log_probs=None,
                sum_pi_squared=None, rollout_is_weights=None, eps=1e-6, scale=1.0):
    """verl's shape, group by group over ``index`` (works for any group sizes and order).

    Scores are plain row sums, as in verl: equal to R_i when token rewards are 0 off the mask
    (varbench puts an outcome reward on the last valid token, or the last position if none)."""
    scores = token_level_rewards.sum(-1)
    adv = torch.zeros_like(token_level_rewards)
    for g in np.unique(index):
        rows = torch.as_tensor(np.nonzero(np.asarray(index) == g)[0])

        def take(x, rows=rows):
            return None if x is None else x[rows].unsqueeze(0)  # [1, G_g, T]

        adv[rows] = _formula(scores[rows].unsqueeze(0), take(response_mask), take(old_log_probs),
                             take(sum_pi_squared), take(rollout_is_weights), eps, scale)[0]
    return adv, adv


def shapes_verl_keyword_only(*, token_level_rewards, response_mask, index, **kw):
    """verl's shape with keyword-only arguments (verl calls its estimators by keyword)."""
    return shapes_verl(token_level_rewards, response_mask, index, **kw)


SHAPE_VARIANTS = {
    "scheme": shapes_scheme,
    "keywords": shapes_keywords,
    "kwargs": shapes_kwargs,
    "verl": shapes_verl,
    "verl_keyword_only": shapes_verl_keyword_only,
}


def shared_prefix_groups():
    """Two groups of 4; in each, all responses share the first two tokens; lengths differ."""
    tokens = torch.tensor([
        [[4, 5, 0, 0, 0], [4, 5, 6, 0, 0], [4, 5, 6, 7, 0], [4, 5, 8, 9, 9]],
        [[7, 7, 7, 0, 0], [7, 7, 1, 0, 0], [7, 7, 1, 2, 3], [7, 7, 2, 2, 0]],
    ])
    lengths = torch.tensor([[2, 3, 4, 5], [3, 3, 5, 4]])
    mask = (torch.arange(5) < lengths[..., None]).double()
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 4, 5, generator=g, dtype=torch.float64) * mask
    return tokens, mask, rewards, logp
