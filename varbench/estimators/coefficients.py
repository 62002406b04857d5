"""Exact per-token gradient coefficients of ``policy_loss`` (for cancellation analysis).

``grad_theta policy_loss = sum_{i,t} c_{i,t} grad_theta logp_{i,t}``, where, with the
indicator ``act_{i,t} = 1`` unless the clip has taken over (its term is strictly larger):

    token ratio:     c_{i,t}  = omega_{i,t} (-A_{i,t}) r_{i,t} act_{i,t}
    sequence (GSPO): c_{i,t'} = m_{i,t'} / |o_i| * sum_t omega_{i,t} (-A_{i,t}) s_i act_{i,t}
    GSPO-token:      c_{i,t}  = omega_{i,t} (-A_{i,t}) s_i act_{i,t}
(act is also 0 where the dual clip ``clip_ratio_c`` has taken over.)

In the GSPO case a token's coefficient depends on every token of its response (coupling).
"""

from __future__ import annotations

import torch

from varbench._util.checks import check_choice
from varbench.estimators.loss import _terms
from varbench.estimators.transforms import adv_orthogonal, min_replace

__all__ = ["TRANSFORMS", "sample_weights", "token_coefficients"]

# adv_orthogonal: one projection per group over its responses (the definition);
# adv_orthogonal_position: one per token column over the responses valid there (a variant,
# measured side by side in the cancellation analysis)
TRANSFORMS = ("none", "min_replace", "adv_orthogonal", "adv_orthogonal_position")


@torch.no_grad()
def token_coefficients(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    ratio: str = "token",
    max_len: int | None = None,
    clip_ratio_c: float | None = None,
    conventions: str = "varbench",
    per_group: bool = False,
) -> torch.Tensor:
    """``c[P, G, T]``: the scalar multiplying ``grad logp_{i,t}`` in ``grad policy_loss``.

    Same arguments as :func:`policy_loss`; ``per_group=True``: each ``[G, T]`` slice of the first
    dimension is its own batch (bitwise one call per ``[c : c + 1]``, in one pass and one
    check). This is the gradient of the loss (to minimise): the ascent direction's coefficient
    is ``-c``. Exactly 0 where mask is 0. At the measure-zero points where ``r`` equals a clip
    bound exactly, autograd's subgradient is used (clip inactive).
    """
    t = _terms(logp.detach(), logp_old, adv, mask, mode, clip, ratio, max_len, clip_ratio_c,
               conventions, per_group)
    act = -t.adv * t.clipped <= -t.adv * t.ratio
    if t.dual is not None:
        act = act & ~t.dual
    per = t.omega * (-t.adv) * t.ratio * act.to(t.ratio.dtype)  # dloss/dlog r at each token
    if ratio in ("token", "sequence-token"):
        return torch.where(t.m, per, 0)
    length = t.m.sum(-1, keepdim=True).clamp(min=1).to(per.dtype)
    return torch.where(t.m, per.sum(-1, keepdim=True) / length, 0)


def sample_weights(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    ratio: str = "token",
    clip: tuple[float, float] = (0.2, 0.2),
    transform: str = "none",
    max_len: int | None = None,
) -> torch.Tensor:
    """Per-token weight ``c [P, G, T]`` WITHOUT the advantage: ``c * A`` is the ascent coefficient.

    The loss coefficient is linear in |A| once the sign of A is fixed (the clip indicator only
    reads the sign), so ``c = -token_coefficients(..., adv=sign(A)) * sign(A)`` (sign(0) := +1):
    aggregation weight x ratio x clip indicator (x GSPO's sequence factor), >= 0. Needs A
    constant over a response for ``ratio="sequence"`` (outcome-reward schemes). ``transform``
    then replaces c within the group (detached): Min-Replace per position, Adv-Orthogonal per
    response over the group (``adv_orthogonal_position``: per position).
    """
    check_choice("transform", transform, TRANSFORMS)
    m = mask != 0
    sgn = torch.where(adv < 0, -1.0, 1.0).to(logp.dtype) * m
    c = -token_coefficients(logp, logp_old, sgn, m, mode, clip=clip, ratio=ratio,
                            max_len=max_len) * sgn
    if transform == "min_replace":
        c = min_replace(c, m)
    elif transform == "adv_orthogonal":
        c = adv_orthogonal(c, adv.to(c.dtype), m)
    elif transform == "adv_orthogonal_position":
        c = adv_orthogonal(c, adv.to(c.dtype), m, per="position")
    return c
