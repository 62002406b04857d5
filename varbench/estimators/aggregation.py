"""Loss aggregation modes (docs/science.md §3): the per-token weight omega_{i,t} of each mode.

| mode                      | omega_{i,t}            |
|---------------------------|------------------------|
| token-mean                | 1 / sum_{all i,t} m    |
| seq-mean-token-mean       | 1 / (B |o_i|)          |
| seq-mean-token-sum        | 1 / B                  |
| seq-mean-token-sum-norm   | 1 / (B L), L constant  |

B counts every sequence of the batch (P * G for ``[P, G, T]``), including empty ones, so an
empty response contributes zero gradient without changing the others' weights (TRL's
convention). ``conventions="verl"`` follows verl 0.9.1's ``agg_loss`` instead: B counts only
the sequences with at least one valid token, and seq-mean-token-mean divides by |o_i| + 1e-8.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, check_choice
from varbench.estimators.registry import CONVENTIONS

__all__ = ["AGGREGATION_MODES", "aggregation_weights"]

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregation_weights(
    mask: torch.Tensor, mode: str, *, max_len: int | None = None, dtype: torch.dtype | None = None,
    conventions: str = "varbench",
) -> torch.Tensor:
    """omega ``[..., T]`` (same shape as ``mask``, e.g. ``[P, G, T]``); exactly 0 where mask is 0.

    ``loss = sum(omega * per_token_loss)`` reproduces the mode's reduction. ``max_len`` is the
    constant L of ``seq-mean-token-sum-norm`` (default: T, the mask's last dimension). ``dtype``
    defaults to the mask's dtype when floating, else float32. Caveat: only token-mean and
    seq-mean-token-sum(-norm) give a response weight independent of its own length; the
    ``1/|o_i|`` of seq-mean-token-mean breaks exchangeability (docs/science.md section 4).
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_choice("conventions", conventions, CONVENTIONS)
    if not isinstance(mask, torch.Tensor) or mask.dim() < 1:
        raise UsageError("mask must be a tensor [..., T] with at least one dimension")
    if dtype is None:
        dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    m = (mask != 0).to(dtype)
    T = mask.shape[-1]
    n_seq = max(mask.numel() // max(T, 1), 1)
    verl = conventions == "verl"
    if verl:  # verl: fully masked rows leave the sequence count
        n_seq = max(int((m.sum(-1) > 0).sum()), 1)
    if mode == "token-mean":
        total = m.sum()
        if not bool(total > 0):
            raise UsageError("mask has no valid token; token-mean would divide by zero")
        return m / total
    if mode == "seq-mean-token-mean":
        length = m.sum(-1, keepdim=True)
        return m / (n_seq * (length + 1e-8 if verl else length.clamp(min=1)))
    if mode == "seq-mean-token-sum":
        return m / n_seq
    L = T if max_len is None else max_len
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise UsageError(f"max_len={max_len!r} is not valid; expected an integer >= 1")
    return m / (n_seq * L)
