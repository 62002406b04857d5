"""KL penalty estimators (docs/science.md §7), per token, from log-probs of the sampled tokens.

With ``x = logp - logp_ref`` for a token sampled from pi:

- k1 = x: unbiased for KL(pi || pi_ref), high variance, can be negative;
- k2 = x^2 / 2: biased (second-order match to KL near pi = pi_ref), always >= 0;
- k3 = exp(-x) + x - 1: unbiased for KL(pi || pi_ref) and always >= 0 (Schulman's estimator).

``clamp=True`` reproduces verl's ``low_var_kl``/``k3``: -x clamped to [-20, 20] before the
exponential and the estimate to [-10, 10] (biased where it bites; off by default).
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, check_choice

__all__ = ["KL_KINDS", "kl_penalty"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    kind: str = "k3",
    *,
    mask: torch.Tensor | None = None,
    clamp: bool = False,
) -> torch.Tensor:
    """Per-token KL estimate (same shape as ``logp``), 0 where ``mask`` (optional) is 0.

    ``logp``: log pi(y_t) of the sampled token under the policy that sampled it; ``logp_ref``:
    under the reference. Differentiable in both. Caveat: the estimators are unbiased (k1, k3)
    only for tokens sampled from pi; k3 is computed as ``expm1(-x) + x`` (no clamping) for
    accuracy near x = 0; ``clamp=True`` (k3 only): verl's clamps, see the module docstring.
    """
    check_choice("kind", kind, KL_KINDS)
    if logp.shape != logp_ref.shape:
        raise UsageError(
            f"logp has shape {list(logp.shape)} but logp_ref has {list(logp_ref.shape)}"
        )
    x = logp - logp_ref
    if mask is not None:
        if mask.shape != logp.shape:
            raise UsageError(f"mask has shape {list(mask.shape)}, expected {list(logp.shape)}")
        # Zero x first so inf log-probs under mask 0 give no NaN in value or gradient.
        x = torch.where(mask != 0, x, 0)
    if kind == "k1":
        out = x
    elif kind == "k2":
        out = 0.5 * x * x
    elif clamp:
        neg = torch.clamp(-x, min=-20, max=20)
        out = torch.clamp(torch.expm1(neg) - neg, min=-10, max=10)
    else:
        out = torch.expm1(-x) + x
    if mask is not None:
        out = torch.where(mask != 0, out, 0)
    return out
