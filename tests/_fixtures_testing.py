"""Estimators for the check_estimator tests: correct ones, and ones with a known defect."""

from __future__ import annotations

import numpy as np
import torch


def centered_by_hand(rewards, mask, **kw):
    """R_i - mean_j R_j on valid tokens (written here so the check sees a user function)."""
    m = mask.to(rewards.dtype)
    return (rewards - rewards.mean(1, keepdim=True)).unsqueeze(-1) * m


def length_bonus(rewards, mask, **kw):
    """Defect: a bonus for longer responses added to the advantage (changes the direction)."""
    m = mask.to(rewards.dtype)
    return (rewards - rewards.mean(1, keepdim=True) + 0.1 * m.sum(-1)).unsqueeze(-1) * m


def own_token_baseline(rewards, mask, *, logprobs, **kw):
    """Defect: the baseline uses the response's own tokens (its mean log-probability)."""
    m = mask.to(rewards.dtype)
    conf = (logprobs * m).sum(-1) / m.sum(-1).clamp(min=1)
    b = rewards.mean(1, keepdim=True) + 0.2 * conf
    return (rewards - b).unsqueeze(-1) * m


def verl_rloo(token_level_rewards, response_mask, index, epsilon=1e-6, **kw):
    """A verl-shaped leave-one-out estimator with a Python loop over groups (as users write)."""
    scores = token_level_rewards.sum(-1)
    out = torch.zeros_like(scores)
    for g in np.unique(index):
        sel = torch.as_tensor(index == g)
        s = scores[sel]
        n = s.numel()
        out[sel] = (s - (s.sum() - s) / (n - 1)) if n > 1 else s
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def leaks_into_padding(rewards, mask, **kw):
    """Defect: forgets the mask (padding positions get the advantage too)."""
    c = rewards - rewards.mean(1, keepdim=True)
    return c.unsqueeze(-1).expand(mask.shape).clone()


def position_dependent(rewards, mask, **kw):
    """Defect: the first response of a group is weighted twice (not permutation-equivariant)."""
    w = torch.ones_like(rewards)
    w[:, 0] = 2
    return (w * (rewards - rewards.mean(1, keepdim=True))).unsqueeze(-1) * mask.to(rewards.dtype)


def reads_masked_logprobs(rewards, mask, *, logprobs, **kw):
    """Defect: its baseline sums log-probs without the mask (masked values leak in)."""
    m = mask.to(rewards.dtype)
    b = rewards.mean(1, keepdim=True) + 0.01 * logprobs.sum(-1).mean(1, keepdim=True)
    return (rewards - b).unsqueeze(-1) * m


def raises(rewards, mask, **kw):
    raise RuntimeError("boom")


def one_argument(rewards):
    return rewards


not_a_function = 3
