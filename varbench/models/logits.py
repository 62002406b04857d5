"""The statistics of pi computed from logits: the one home of these formulas.

Token log-probs, entropy, ``sum_v pi(v)^2`` and the Logit-Gradient Proxy
``w = 1 - 2 pi(y) + sum_v pi(v)^2`` (docs/science.md section 2.3). The sampler, the forward
statistics, the exact gradient paths, the trainer and the analyses all call these functions, so
every recorded statistic of pi means the same thing everywhere.

Precision: reduced-precision logits (bfloat16, float16) are upcast to float32 first; float32
and float64 logits are used as they are.

Alignment for ``[B, L]`` batches (:func:`token_logprobs`): column t describes token
``input_ids[:, t]`` predicted from ``logits[:, t - 1]``; column 0 predicts nothing and is 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from varbench._util.checks import UsageError


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics of logits of ``dtype`` are computed in (float32 at least)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in :func:`stat_dtype` (a no-op for float32 and float64)."""
    want = stat_dtype(logits.dtype)
    return logits if logits.dtype == want else logits.to(want)


class PiStats(NamedTuple):
    """Statistics of pi at each position, each of the logits' shape without the vocabulary."""

    logp: torch.Tensor  # log pi(y) of the given token
    entropy: torch.Tensor  # -sum_v pi(v) log pi(v)
    sum_pi_sq: torch.Tensor  # sum_v pi(v)^2


def pi_stats(logits: torch.Tensor, tokens: torch.Tensor) -> PiStats:
    """``[..., V], [...] -> PiStats`` of ``softmax(logits)`` with one log-softmax pass.

    Stable for any logit scale (log-softmax subtracts the row's log-sum-exp before any
    ``exp``). A ``-inf`` logit (a masked vocabulary entry) contributes exactly 0 to the entropy
    and to ``sum_pi_sq``, never NaN.
    """
    if tokens.shape != logits.shape[:-1]:
        raise UsageError(
            f"tokens has shape {list(tokens.shape)}, expected {list(logits.shape[:-1])} "
            "(logits without the vocabulary axis)"
        )
    z = upcast(logits)
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    # clamp: 0 * -inf would be NaN for a masked entry; its probability is exactly 0
    entropy = -(p * logp_all.clamp(min=torch.finfo(z.dtype).min)).sum(-1)
    # p is normalised and <= 1: the sum of squares cannot overflow, and equals
    # exp(logsumexp(2z) - 2 logsumexp(z)) to rounding without two more passes over V
    return PiStats(logp, entropy, p.square().sum(-1))


def sum_pi_sq(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v ** 2`` over the last axis, stable for any logit scale.

    Shapes: ``[..., V] -> [...]``, in float32 at least; logits of magnitude 1e4 give a value
    in ``(0, 1]``, never inf or NaN.
    """
    return torch.log_softmax(upcast(logits), dim=-1).exp().square().sum(-1)


def proxy_from_logprobs(logprobs: torch.Tensor, sum_pi_sq: torch.Tensor) -> torch.Tensor:
    """Logit-Gradient Proxy from stored statistics: ``w = 1 - 2 exp(logprobs) + sum_pi_sq``.

    Shapes: any, equal. Range ``[0, 2)``: the exact squared norm of ``d log pi(y) / d z``.
    It ignores everything below the logits (for an untied head, the head's own gradient of the
    token has squared norm ``w * ||h||^2``).
    """
    w = torch.exp(logprobs)
    if torch.is_grad_enabled() and (logprobs.requires_grad or sum_pi_sq.requires_grad):
        return 1 - 2 * w + sum_pi_sq  # differentiable (e.g. logit_proxy under autograd)
    return torch.add(sum_pi_sq, w, alpha=-2, out=w).add_(1)  # in place: one allocation


def logit_proxy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logit-Gradient Proxy ``w = ||e_y - softmax(z)||^2 = 1 - 2 p(y) + sum_pi_sq``, in [0, 2).

    Shapes: ``logits [..., V]``, ``tokens [...]`` (integer ids) ``-> [...]``.
    """
    s = pi_stats(logits, tokens)
    return proxy_from_logprobs(s.logp, s.sum_pi_sq)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, V], [B, L] -> [B, L]`` log-prob of ``input_ids[:, t]`` from ``logits[:, t-1]``.

    Column 0 is 0 (nothing predicts the first token). Differentiable: the exact gradient paths,
    the trainer and the analyses all differentiate this one function. Computed in the logits'
    dtype (the gradient paths choose their precision by the model's).
    """
    z = logits[:, :-1]
    # z_y - logsumexp(z) rather than log_softmax: its backward (softmax * cotangent) has vmap
    # batching rules, log_softmax's backward falls back to a slow per-cotangent loop
    lp = z.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))
