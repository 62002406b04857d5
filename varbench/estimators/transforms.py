"""Exchangeability-restoring transforms on per-sample weights within a group (docs/science.md §4).

A weight ``v_i`` (e.g. a response's aggregation weight times its ratio) that differs between
responses sharing a step keeps that step from cancelling. Both transforms return new weights,
detached from the graph, computed over the group axis (dim 1) at each trailing index:

- Min-Replace:    ``v~_i = min_j v_j`` (a group-constant weight; cancels when sum_i A_i = 0);
- Adv-Orthogonal: ``v~ = v - (A.v / A.A) A`` (then ``sum_i A_i v~_i = 0`` for any A), one
  projection per group over its responses (``per="position"``: one per column, a variant).
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, check_choice, check_finite_at

__all__ = ["ADV_ORTHOGONAL_FORMS", "min_replace", "adv_orthogonal"]


def _valid(weights: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor) or weights.dim() < 2:
        raise UsageError("weights must be a tensor [P, G, ...] (group axis 1)")
    if mask is None:
        return torch.ones_like(weights, dtype=torch.bool)
    if mask.shape != weights.shape:
        raise UsageError(f"mask has shape {list(mask.shape)}, expected {list(weights.shape)}")
    return mask != 0


@torch.no_grad()
def min_replace(weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Min-Replace: every member gets the group's minimum weight (over members where mask is 1).

    Shapes: ``weights [P, G]`` (per response) or ``[P, G, T]`` (per position, the min taken over
    the responses valid at that position); ``mask`` optional, same shape. Returns the same shape,
    detached, 0 where mask is 0 (and at positions with no valid member).
    """
    m = _valid(weights, mask)
    check_finite_at("weights", weights.detach(), m)
    big = torch.finfo(weights.dtype).max
    vmin = torch.where(m, weights.detach(), big).amin(dim=1, keepdim=True)
    return torch.where(m, vmin.expand_as(weights), 0)


ADV_ORTHOGONAL_FORMS = ("response", "position")


@torch.no_grad()
def adv_orthogonal(
    weights: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None = None, *,
    per: str = "response",
) -> torch.Tensor:
    """Adv-Orthogonal: ``v~ = v - (A.v / A.A) A`` per group, so ``sum_i A_i v~_i = 0``.

    Shapes: ``weights`` and ``adv`` ``[P, G]`` (one weight per response) or ``[P, G, T]``;
    ``mask`` optional. ``per``:

    - ``"response"`` (the definition): one projection per group over its responses. For
      ``[P, G, T]`` inputs a response's weight v_i and advantage A_i are the means over its
      valid tokens, ``lambda = sum_i A_i v_i / sum_i A_i^2`` over the whole group, and every
      valid token gets ``v_{i,t} - lambda A_{i,t}``. With a weight and an advantage constant
      over each response (sequence-level weights, outcome rewards) this is exactly the
      per-response transform, and every step shared by the whole group cancels.
    - ``"position"``: a separate projection at each column t over the responses valid there
      (the earlier implementation, kept as a named variant): it cancels at every column
      (``sum_i A_{i,t} v~_{i,t} = 0``) but gives responses still running at a late position
      a weight that depends on which others have ended (two running responses with equal
      advantages get 0).

    Where ``A.A = 0`` the weights are returned unchanged (nothing to remove). Caveat: v~ can be
    negative or zero; it is a restoring weight, not a probability ratio. Detached; 0 where mask
    is 0.
    """
    check_choice("per", per, ADV_ORTHOGONAL_FORMS)
    m = _valid(weights, mask)
    if adv.shape != weights.shape:
        raise UsageError(f"adv has shape {list(adv.shape)}, expected {list(weights.shape)}")
    check_finite_at("weights", weights.detach(), m)
    check_finite_at("adv", adv.detach(), m)
    v = torch.where(m, weights.detach(), 0)
    a = torch.where(m, adv.detach(), 0)
    if per == "response" and v.dim() > 2:
        dims = tuple(range(2, v.dim()))
        n = m.sum(dims).to(v.dtype)
        vi = v.sum(dims) / n.clamp(min=1)  # [P, G]: per-response means over valid tokens
        ai = a.sum(dims) / n.clamp(min=1)
        aa = (ai * ai).sum(1, keepdim=True)
        av = (ai * vi).sum(1, keepdim=True)
        lam = torch.where(aa > 0, av / torch.where(aa > 0, aa, 1), 0)
        lam = lam.reshape(lam.shape + (1,) * len(dims))
        return torch.where(m, v - lam * a, 0)
    aa = (a * a).sum(1, keepdim=True)
    av = (a * v).sum(1, keepdim=True)
    coef = torch.where(aa > 0, av / torch.where(aa > 0, aa, 1), 0)
    return torch.where(m, v - coef * a, 0)
