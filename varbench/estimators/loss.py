"""The clipped policy-gradient loss (docs/science.md section 7) with token or GSPO sequence ratios.

    r_{i,t} = exp(logp_{i,t} - logp_old_{i,t})                          ratio="token"  (PPO)
    r_{i,t} = s_i = exp(sum_t m (logp - logp_old) / |o_i|)              ratio="sequence" (GSPO)
    r_{i,t} = sg[s_i] exp(logp_{i,t} - sg[logp_{i,t}])                  ratio="sequence-token"
    loss    = sum_{i,t} omega_{i,t} max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    dual clip (clip_ratio_c = c > 1): where A < 0 the term is min(that, -A c)   (verl's default 3)

The sequence ratio keeps its gradient through every token of response i (no stop-gradient), so
the gradient of token t' of i involves all tokens of i: GSPO's sequence-level coupling.
"sequence-token" is GSPO-token (verl's ``gspo`` loss): the same value, but each token's
gradient flows only through its own log-prob, so token-level advantages stay per token.
``token_coefficients`` in ``coefficients.py`` gives the exact per-token gradient weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench._util.checks import UsageError, check_choice, check_finite_at
from varbench.estimators.aggregation import aggregation_weights
from varbench.estimators.kl import kl_penalty

__all__ = ["RATIO_KINDS", "policy_loss"]

RATIO_KINDS: tuple[str, ...] = ("token", "sequence", "sequence-token")


@dataclass
class _Terms:
    m: torch.Tensor  # bool [..., T]
    omega: torch.Tensor  # [..., T]
    log_ratio: torch.Tensor  # [..., T] token or broadcast sequence log-ratio, 0 under mask
    ratio: torch.Tensor  # exp(log_ratio)
    clipped: torch.Tensor  # clip(ratio, 1 - eps_low, 1 + eps_high)
    adv: torch.Tensor  # detached advantages, 0 under mask
    lo: float
    hi: float
    dual: torch.Tensor | None  # bool [..., T]: where the dual clip -A c has taken over, or None


def _check_clip(clip: tuple[float, float]) -> tuple[float, float]:
    try:
        lo, hi = (float(c) for c in clip)
    except (TypeError, ValueError):
        raise UsageError(f"clip={clip!r} is not valid; expected (eps_low, eps_high)") from None
    if not (0 <= lo < 1 and hi >= 0):
        raise UsageError(f"clip={clip!r} is not valid; expected 0 <= eps_low < 1, eps_high >= 0")
    return lo, hi


def _terms(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip: tuple[float, float],
    ratio: str,
    max_len: int | None,
    clip_ratio_c: float | None = None,
    conventions: str = "varbench",
    per_group: bool = False,
) -> _Terms:
    """Shared by the loss and the coefficients so both read one formula (``per_group``: the
    first dimension indexes independent batches, see ``aggregation_weights``)."""
    check_choice("ratio", ratio, RATIO_KINDS)
    for name, x in (("logp_old", logp_old), ("adv", adv), ("mask", mask)):
        if not isinstance(x, torch.Tensor) or x.shape != logp.shape:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UsageError(f"{name} has shape {shape}, expected logp's {list(logp.shape)}")
    lo, hi = _check_clip(clip)
    if clip_ratio_c is not None and not (isinstance(clip_ratio_c, (int, float))
                                         and clip_ratio_c > 1):
        raise UsageError(f"clip_ratio_c={clip_ratio_c!r} is not valid; expected a float > 1 "
                         "(or None: no dual clip)")
    m = mask != 0
    # a NaN/inf advantage would make the loss NaN silently (one host read); non-finite
    # log-probs are the model's and propagate: the training loop's collapse detector reads them
    check_finite_at("adv", adv.detach(), m)
    omega = aggregation_weights(mask, mode, max_len=max_len, dtype=logp.dtype,
                                conventions=conventions, per_group=per_group)
    diff = torch.where(m, logp - logp_old.detach(), 0)
    if ratio in ("sequence", "sequence-token"):
        length = m.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)
        seq = diff.sum(-1, keepdim=True) / length
        if ratio == "sequence-token":  # value of the sequence ratio, gradient of the token's own
            own = torch.where(m, logp, 0)
            seq = seq.detach() + (own - own.detach())
        log_ratio = torch.where(m, seq.expand_as(diff), 0)
    else:
        log_ratio = diff
    r = torch.exp(log_ratio)
    a = torch.where(m, adv.detach(), 0)
    dual = None
    if clip_ratio_c is not None:
        surrogate = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
        dual = (a < 0) & (-a * clip_ratio_c < surrogate.detach()) & m
    return _Terms(m, omega, log_ratio, r, r.clamp(1 - lo, 1 + hi), a, lo, hi, dual)


def policy_loss(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss (scalar, to minimise) and detached metrics.

    Shapes: ``logp`` (differentiable), ``logp_old``, ``adv``, ``mask`` all ``[P, G, T]`` (any
    ``[..., T]`` works; sequences are the leading dims). ``mode``: an ``AGGREGATION_MODES``
    entry; ``clip=(eps_low, eps_high)``; ``ratio``: ``"token"`` (PPO), ``"sequence"`` (GSPO,
    length-normalised sequence ratio) or ``"sequence-token"`` (GSPO-token: the sequence ratio's
    value with a per-token gradient). ``clip_ratio_c``: dual clip (verl's ``clip_ratio_c``,
    default there 3.0; None here: off), the term of a token with A < 0 is capped at ``-A c``.
    ``max_len``: the constant of ``seq-mean-token-sum-norm`` (TRL's dr_grpo:
    ``max_completion_length``; default the mask width T). ``conventions``: ``"verl"`` leaves
    fully masked rows out of the sequence count (:func:`aggregation_weights`).
    ``logp_old`` and ``adv`` are detached here. A NaN or inf advantage at a valid token is a
    UsageError naming it; non-finite log-probs (the model's own) propagate into the loss, where
    the training loop's collapse detector reads them.

    Metrics (0-dim tensors, over valid tokens): ``clip_frac`` (fraction whose gradient the clip
    removes), ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``approx_kl`` (k3 estimate of
    KL(pi_old || pi) from the tokens sampled by pi_old).
    Caveat: asymmetric clipping and ``ratio="sequence"`` make the per-token coefficient differ
    between responses sharing a step (docs/science.md section 4).
    """
    t = _terms(logp, logp_old, adv, mask, mode, clip, ratio, max_len, clip_ratio_c, conventions)
    unclipped = -t.adv * t.ratio
    clipped = -t.adv * t.clipped
    per_token = torch.maximum(unclipped, clipped)
    if t.dual is not None:
        per_token = torch.where(t.dual, -t.adv * clip_ratio_c, per_token)
    loss = (t.omega * per_token).sum()
    with torch.no_grad():
        n = t.m.sum().clamp(min=1)
        r = t.ratio.detach()
        big = torch.finfo(r.dtype).max
        metrics = {
            "clip_frac": ((clipped > unclipped) & t.m).sum().to(r.dtype) / n,
            "clip_frac_lower": (t.dual.sum().to(r.dtype) / n if t.dual is not None
                                else r.new_zeros(())),
            "ratio_mean": torch.where(t.m, r, 0).sum() / n,
            "ratio_min": torch.where(t.m, r, big).min(),
            "ratio_max": torch.where(t.m, r, -big).max(),
            "approx_kl": kl_penalty(logp_old.detach(), logp.detach(), "k3", mask=mask).sum() / n,
        }
    return loss, metrics
