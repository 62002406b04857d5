"""Random verl-layout batches for the peer tests (tests/test_peers_*.py).

One batch mixes every edge case at once: groups of unequal sizes (1 to 5) shuffled across
rows, tied rewards, an all-equal group, empty responses (mask all 0) and padding of varied
length. Rows are ``[B, T]``; the outcome reward sits on the last valid
token (verl's layout; on the last column for an empty row), so ``token_level_rewards.sum(-1)``
is the reward of every row.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

TOL = {torch.float32: 4.8e-7, torch.float64: 1e-15}
"""Max relative difference allowed against a peer (relative to max(1, |reference|))."""
TOL_SUMS = {torch.float32: 4.8e-7, torch.float64: 1e-14}
"""OTB: ratios of sums over up to G * T terms that the two libraries add in different orders
(cumsum and group sums), so float64 rounding reaches a few tens of ulps."""


def require(module: str):
    """Import a peer module; where ``VARBENCH_REQUIRE_PEERS=1`` (``make test``, CI) a missing peer
    fails the run instead of skipping it (a skipped peer test is not a passed one)."""
    if os.environ.get("VARBENCH_REQUIRE_PEERS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="the peers extra is not installed")


def verl_batch(seed: int, dtype: torch.dtype, *, empty: bool = True) -> dict:
    """``{"tok", "mask", "index", "R", "logp", "sum_pi_sq", "is_w"}`` for ``B`` ~ 20 rows."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 4, 3]
    ids = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=gen).numpy()]
    B, T = len(ids), 7
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    if empty:
        lengths[torch.randperm(B, generator=gen)[:2]] = 0
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).to(dtype)
    R = torch.randint(0, 3, (B,), generator=gen).to(dtype) / 2  # ties
    R = R + torch.randn(B, generator=gen, dtype=dtype) * (torch.rand(B, generator=gen) < 0.5)
    R[ids == 3] = 0.75  # an all-equal group
    last = (lengths - 1).clamp(min=0).where(lengths > 0, torch.full_like(lengths, T - 1))
    tok = torch.zeros(B, T, dtype=dtype).scatter_(1, last.unsqueeze(-1), R.unsqueeze(-1))
    logp = -torch.rand(B, T, generator=gen, dtype=dtype) * 3 * mask
    sum_pi_sq = (0.05 + 0.95 * torch.rand(B, T, generator=gen, dtype=dtype)) * mask
    is_w = (0.5 + torch.rand(B, T, generator=gen, dtype=dtype)) * mask
    return {"tok": tok, "mask": mask, "index": ids, "R": R, "logp": logp,
            "sum_pi_sq": sum_pi_sq, "is_w": is_w}


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max(1, max |want|)`` (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    scale = max(1.0, float(want.abs().max()))
    return float((got.to(want.dtype) - want).abs().max()) / scale
