"""Exact per-token gradient coefficients of ``policy_loss`` (for cancellation analysis).

``grad_theta policy_loss = sum_{i,t} c_{i,t} grad_theta logp_{i,t}``, where, with the
indicator ``act_{i,t} = 1`` unless the clip has taken over (its term is strictly larger):

    token ratio:     c_{i,t}  = omega_{i,t} (-A_{i,t}) r_{i,t} act_{i,t}
    sequence (GSPO): c_{i,t'} = m_{i,t'} / |o_i| * sum_t omega_{i,t} (-A_{i,t}) s_i act_{i,t}

In the GSPO case a token's coefficient depends on every token of its response (coupling).
"""

from __future__ import annotations

import torch

from varbench.estimators.loss import _terms

__all__ = ["token_coefficients"]


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
) -> torch.Tensor:
    """``c[P, G, T]``: the scalar multiplying ``grad logp_{i,t}`` in ``grad policy_loss``.

    Same arguments as :func:`policy_loss`. This is the gradient of the loss (to minimise): the
    ascent direction's coefficient is ``-c``. Exactly 0 where mask is 0. At the measure-zero
    points where ``r`` equals a clip bound exactly, autograd's subgradient is used (clip inactive).
    """
    t = _terms(logp.detach(), logp_old, adv, mask, mode, clip, ratio, max_len)
    act = (-t.adv * t.clipped <= -t.adv * t.ratio).to(t.ratio.dtype)
    per = t.omega * (-t.adv) * t.ratio * act  # dloss/dlog r at each token
    if ratio == "token":
        return torch.where(t.m, per, 0)
    length = t.m.sum(-1, keepdim=True).clamp(min=1).to(per.dtype)
    return torch.where(t.m, per.sum(-1, keepdim=True) / length, 0)
