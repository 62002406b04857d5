"""Forward statistics of a causal LM in one forward pass: log-probs, entropy, sum_pi_sq, the
Logit-Gradient Proxy w_t and its cumulative W_t (docs/science.md section 2.3).

Alignment convention (shared by everything in ``varbench.grads``): a ``[B, L]`` statistic at
column t describes token ``input_ids[:, t]`` predicted from ``input_ids[:, :t]``, i.e. it is
computed from ``logits[:, t - 1]``. Column 0 predicts nothing and is always 0, as is every
column where ``response_mask`` is 0 (prompt, padding, environment tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench._util.checks import UsageError
from varbench.grads._inputs import check_inputs, eval_mode
from varbench.models.forward import forward_logits
from varbench.models.logits import pi_stats, proxy_from_logprobs, stat_dtype


@dataclass
class ForwardStats:
    """Per-token forward statistics, each ``[B, L]`` and 0 where ``response_mask`` is 0.

    ``proxy`` is w_t, ``cum_proxy`` is ``W_t = sum_{j <= t} w_j m_j`` (response positions only;
    it ignores cross terms, see docs/science.md §2.2), ``h_sq`` is ``||h_{t-1}||^2`` of the hidden
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
            raise UsageError("hidden_norms=True needs model.get_output_embeddings(); got None")
        handle = head.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        # forward-only statistics: no autograd graph (it would cost memory and time for nothing)
        with eval_mode(model), torch.no_grad():
            logits = forward_logits(model, input_ids, attention_mask).logits  # [B, L, V]
    finally:
        if handle is not None:
            handle.remove()
    # z[:, t-1] predicts token t: statistics of the [B, L-1] predicted positions
    logp, entropy, spsq = pi_stats(logits[:, :-1], input_ids[:, 1:])
    proxy = proxy_from_logprobs(logp, spsq)
    dt = stat_dtype(logits.dtype)
    m = response_mask.to(dt)

    def align(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (1, 0)) * m

    proxy = align(proxy)
    h_sq = None
    if hidden_norms:
        h = captured[-1]
        h_sq = align(h[:, :-1].to(dt).pow(2).sum(-1))
    return ForwardStats(
        logp=align(logp),
        entropy=align(entropy),
        sum_pi_sq=align(spsq),
        proxy=proxy,
        cum_proxy=proxy.cumsum(-1) * m,
        h_sq=h_sq,
    )
