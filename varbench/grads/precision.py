"""A float64-throughout copy of a transformers causal LM, for exact validation.

Stock transformers modules do not keep float64: ``LlamaRMSNorm`` casts its input to float32
before normalising, and eager attention runs its softmax in float32. Gradients through those
casts are float32-rounded, which caps agreement between two exact methods near 1e-7 relative.
:func:`exact_float64` returns a copy in float64 whose RMS norms and attention keep the input
dtype (registered with transformers' ``AttentionInterface`` under :data:`ATTN_NAME`), so exact
gradient paths agree to ~1e-12. (Rotary cos/sin are still computed in float32 by transformers;
they are constants, not functions of the parameters, so they do not limit agreement.)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from varbench._util.checks import UsageTypeError

ATTN_NAME = "varbench_keep_dtype"


def keep_dtype_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with every step in ``query.dtype``; mask is sdpa's boolean (True = keep).

    Shapes: query ``[B, H, Lq, D]``, key/value ``[B, Hkv, Lk, D]`` -> ``([B, Lq, H, D], weights)``.
    A fully masked row (a left-pad query) gets the dtype's minimum instead of -inf, so it stays
    finite (uniform weights) and cannot put NaN into any gradient.
    """
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:  # causal, queries aligned to the last keys
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    else:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask.to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _always_mask(*args, **kwargs):
    # sdpa_mask returns None for an unpadded batch (sdpa then relies on is_causal); this
    # attention function needs the explicit causal mask every time
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_NAME, keep_dtype_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, _always_mask)


class KeepDtypeRMSNorm(torch.nn.Module):
    """RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` computed in the input's dtype (no float32 cast).

    Shares the replaced module's weight Parameter (same tensor, same name in the parent).
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )


def _is_rmsnorm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def exact_float64(model: torch.nn.Module) -> torch.nn.Module:
    """Deep copy of ``model`` in float64 with dtype-keeping RMS norms and attention.

    Works for transformers causal LMs whose norms are ``*RMSNorm`` modules with ``weight`` and
    ``variance_epsilon`` (or ``eps``) and whose attention dispatches through
    ``config._attn_implementation`` (Llama, Qwen2, Mistral, ...). The original is untouched.
    """
    new = copy.deepcopy(model).to(torch.float64)
    for parent in list(new.modules()):
        for child_name, child in list(parent.named_children()):
            if _is_rmsnorm(child):
                eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
                setattr(parent, child_name, KeepDtypeRMSNorm(child.weight, eps))
    config = getattr(new, "config", None)
    if config is None:
        raise UsageTypeError(
            f"exact_float64 needs a transformers model with .config, got {type(model).__name__}"
        )
    if hasattr(new, "set_attn_implementation"):
        new.set_attn_implementation(ATTN_NAME)
    else:
        config._attn_implementation = ATTN_NAME
    return new


@contextlib.contextmanager
def functional_attention(model: torch.nn.Module) -> Iterator[None]:
    """Temporarily route a transformers model's attention through :func:`keep_dtype_attention`
    (plain matmul/softmax: supports forward-mode AD and vmap, unlike the fused sdpa kernel on
    CPU). Same math as the model's attention up to rounding; restored on exit. No-op for
    models without ``config._attn_implementation``."""
    config = getattr(model, "config", None)
    old = getattr(config, "_attn_implementation", None)
    if old is None or old == ATTN_NAME:
        yield
        return
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(old)
