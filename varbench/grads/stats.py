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

from varbench.grads._inputs import check_inputs, eval_mode
from varbench.models.logits import sequence_stats


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
    chunk: int | None = None,
) -> ForwardStats:
    """One forward pass -> :class:`ForwardStats` (log-probs, entropy, sum_pi_sq, proxy, W_t).

    Shapes: ``input_ids``, ``response_mask``, ``attention_mask`` ``[B, L]``; every field
    ``[B, L]`` in the alignment of this module's docstring. ``hidden_norms=True`` also records
    ``||h||^2`` of the head's input. The logits exist ``chunk`` positions at a time (default:
    512 positions)
    (``varbench.models.logits.sequence_stats``), never as a whole ``[B, L, V]`` tensor.
    """
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask
    )
    # forward-only statistics: no autograd graph; the logits exist a chunk at a time
    with eval_mode(model), torch.no_grad():
        # only the response positions: the head's logits are never made for the others
        st = sequence_stats(model, input_ids, attention_mask, mask=response_mask[:, 1:],
                            hidden_sq=hidden_norms, chunk=chunk)
    m = response_mask.to(st.logp.dtype)

    def align(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (1, 0)) * m

    proxy = align(st.proxy)
    h_sq = align(st.hidden_sq) if hidden_norms else None
    return ForwardStats(
        logp=align(st.logp),
        entropy=align(st.entropy),
        sum_pi_sq=align(st.sum_pi_sq),
        proxy=proxy,
        cum_proxy=proxy.cumsum(-1) * m,
        h_sq=h_sq,
    )
