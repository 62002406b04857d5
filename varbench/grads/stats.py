"""Forward statistics of a causal LM in one forward pass: log-probs, entropy, sum_pi_sq, the
Logit-Gradient Proxy w_t and its cumulative W_t (SCIENCE.md section 2.3).

Alignment convention (shared by everything in ``varbench.grads``): a ``[B, L]`` statistic at
column t describes token ``input_ids[:, t]`` predicted from ``input_ids[:, :t]``, i.e. it is
computed from ``logits[:, t - 1]``. Column 0 predicts nothing and is always 0, as is every
column where ``response_mask`` is 0 (prompt, padding, environment tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench.grads._inputs import check_inputs, eval_mode
from varbench.models.forward import forward_logits


def sum_pi_sq(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v ** 2`` over the last axis, stable for any logit scale.

    Shapes: ``[..., V] -> [...]``. Computed as ``exp(logsumexp(2 z) - 2 logsumexp(z))`` in at
    least float32, so logits of magnitude 1e4 give a value in ``(0, 1]`` and never inf/NaN.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    # shift by the max first: at |z| ~ 1e4, float32 spacing near 2e4 would cost 1e-3 relative
    z = z - z.amax(dim=-1, keepdim=True).detach()
    return torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1))


def logit_proxy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logit-Gradient Proxy ``w = ||e_y - softmax(z)||^2 = 1 - 2 p(y) + sum_pi_sq``, in [0, 2).

    Shapes: ``logits [..., V]``, ``tokens [...]`` (integer ids) ``-> [...]``. This is the exact
    squared norm of ``d log p(y) / d z``; it ignores everything below the logits (the head's
    own gradient is ``w * ||h||^2`` for an untied head).
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens has shape {list(tokens.shape)}, expected {list(logits.shape[:-1])} "
            "(logits without the vocabulary axis)"
        )
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    lse = torch.logsumexp(z, dim=-1)
    p_y = torch.exp(z.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - lse)
    return 1 - 2 * p_y + sum_pi_sq(z)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, V], [B, L] -> [B, L]`` log-prob of ``input_ids[:, t]`` from ``logits[:, t-1]``.

    Column 0 is 0 (nothing predicts the first token). Differentiable: the exact gradient paths
    in ``varbench.grads`` all differentiate this one function.
    """
    z = logits[:, :-1]
    # z_y - logsumexp(z) rather than log_softmax: its backward (softmax * cotangent) has vmap
    # batching rules, log_softmax's backward falls back to a slow per-cotangent loop
    lp = z.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))


@dataclass
class ForwardStats:
    """Per-token forward statistics, each ``[B, L]`` and 0 where ``response_mask`` is 0.

    ``proxy`` is w_t, ``cum_proxy`` is ``W_t = sum_{j <= t} w_j m_j`` (response positions only;
    it ignores cross terms, see SCIENCE.md 2.2), ``h_sq`` is ``||h_{t-1}||^2`` of the hidden
    state the head reads to predict token t (None unless requested).
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    sum_pi_sq: torch.Tensor
    proxy: torch.Tensor
    cum_proxy: torch.Tensor
    h_sq: torch.Tensor | None = None


@torch.no_grad()
def forward_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    hidden_norms: bool = False,
) -> ForwardStats:
    """One forward pass -> :class:`ForwardStats` (log-probs, entropy, sum_pi_sq, proxy, W_t).

    Shapes: ``input_ids``, ``response_mask``, ``attention_mask`` ``[B, L]``; every field
    ``[B, L]`` in the alignment of this module's docstring. ``hidden_norms=True`` also records
    ``||h||^2`` of the head's input via a forward hook on ``model.get_output_embeddings()``.
    """
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask
    )
    captured: list[torch.Tensor] = []
    handle = None
    if hidden_norms:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError("hidden_norms=True needs model.get_output_embeddings(); got None")
        handle = head.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        # forward-only statistics: no autograd graph (it would cost memory and time for nothing)
        with eval_mode(model), torch.no_grad():
            logits = forward_logits(model, input_ids, attention_mask).logits  # [B, L, V]
    finally:
        if handle is not None:
            handle.remove()
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    z = z[:, :-1]  # [B, L-1, V]: z[:, t-1] predicts token t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.exp(z - lse.unsqueeze(-1))
    entropy = lse - (probs * z).sum(-1)
    # probs are already normalised (no overflow possible): sum of squares equals sum_pi_sq()
    # to rounding and saves the two extra logsumexp passes over [B, L, V]
    spsq = probs.square().sum(-1)
    proxy = 1 - 2 * logp.exp() + spsq
    m = response_mask.to(z.dtype)

    def align(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (1, 0)) * m

    proxy = align(proxy)
    h_sq = None
    if hidden_norms:
        h = captured[-1]
        h_sq = align(h[:, :-1].to(z.dtype).pow(2).sum(-1))
    return ForwardStats(
        logp=align(logp),
        entropy=align(entropy),
        sum_pi_sq=align(spsq),
        proxy=proxy,
        cum_proxy=proxy.cumsum(-1) * m,
        h_sq=h_sq,
    )
