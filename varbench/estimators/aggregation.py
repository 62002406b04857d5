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
    conventions: str = "varbench", per_group: bool = False,
) -> torch.Tensor:
    """omega ``[..., T]`` (same shape as ``mask``, e.g. ``[P, G, T]``); exactly 0 where mask is 0.

    ``loss = sum(omega * per_token_loss)`` reproduces the mode's reduction. ``max_len`` is the
    constant L of ``seq-mean-token-sum-norm`` (default: T, the mask's last dimension). ``dtype``
    defaults to the mask's dtype when floating, else float32. Caveat: only token-mean and
    seq-mean-token-sum(-norm) give a response weight independent of its own length; the
    ``1/|o_i|`` of seq-mean-token-mean breaks exchangeability (docs/science.md section 4).

    ``per_group=True``: the first dimension indexes independent batches (e.g. the M groups
    ``[M, G, T]`` of one prompt, each its own batch of B = G), exactly as one call per
    ``mask[m : m + 1]``, in one pass and with one check.
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_choice("conventions", conventions, CONVENTIONS)
    if not isinstance(mask, torch.Tensor) or mask.dim() < 1:
        raise UsageError("mask must be a tensor [..., T] with at least one dimension")
    if dtype is None:
        dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    m = (mask != 0).to(dtype)
    T = mask.shape[-1]
    if per_group and mask.dim() < 2:
        raise UsageError("per_group=True needs a mask [M, ..., T] with a group dimension")
    lead = mask.shape[0] if per_group else 1
    # the group's own sums broadcast back over it ([M, 1, ..., 1]; a 0-dim sum without groups)
    group = (lambda x: x.reshape(lead, -1).sum(1).reshape(lead, *[1] * (mask.dim() - 1))
             ) if per_group else (lambda x: x.sum())
    n_seq = max(mask.numel() // max(T, 1) // max(lead, 1), 1)
    verl = conventions == "verl"
    if verl:  # verl: fully masked rows leave the sequence count
        n_seq = (group((m.sum(-1, keepdim=True) > 0).to(torch.int64)).clamp(min=1)
                 if per_group else max(int((m.sum(-1) > 0).sum()), 1))
    if mode == "token-mean":
        total = group(m)
        if not bool((total > 0).all()):
            raise UsageError("mask has no valid token"
                             + (" in some group" if per_group else "")
                             + "; token-mean would divide by zero")
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
