"""Random inputs for the estimator tests (seeded torch.Generator; float64 by default)."""

from __future__ import annotations

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
