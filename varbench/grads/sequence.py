"""Exact per-sequence gradients ``sum_t m_t g_t``, flat or count-sketched.

The sketch is varbench's one sketch, :class:`varbench.grads.vectors.CountSketch` (see there for
its unbiasedness and variance), so sequence, group and per-token sketches built from the same
``(params, K, seed)`` are directly comparable.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageTypeError
from varbench.grads._inputs import eval_mode, prepare
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.vectors import CountSketch
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs


def flat_grads(grads, params) -> torch.Tensor:
    """Concatenate per-parameter gradients (None -> zeros) into one flat vector."""
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    )


def check_sketch(sketch, plist) -> None:
    """Raise unless ``sketch`` is None or a CountSketch built for ``plist`` (sizes, device)."""
    if sketch is None:
        return
    if not isinstance(sketch, CountSketch):
        raise UsageTypeError(
            f"sketch must be a varbench.grads.CountSketch or None, got {type(sketch).__name__}"
        )
    sketch.check_params(plist)


def sequence_grads(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    sketch: CountSketch | None = None,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Per-sequence gradients ``grad sum_t m_t log p_t``: ``[B, P]``, or ``[B, K]`` sketched.

    ``sketch``: a :class:`CountSketch` for the selected ``params`` with its state on the device
    the model runs on (``CountSketch.for_model(model, K, seed, params=params, device=device)``).
    One forward + backward per sequence (the same work as one batched backward). Flat order is
    :func:`select_params` order. ``||row||^2`` equals the last ``prefix_sq`` of
    :func:`varbench.grads.token_grad_norms`.
    """
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids, response_mask, attention_mask, dtype, device
    )
    dev = input_ids.device
    plist = [p for _, p in select_params(model, params)]
    check_sketch(sketch, plist)
    rows = []
    with eval_mode(model):
        for b in range(input_ids.shape[0]):
            ids = input_ids[b : b + 1].to(dev)
            lp = token_logprobs(
                forward_logits(model, ids, attention_mask[b : b + 1].to(dev)).logits, ids
            )
            loss = (lp * response_mask[b : b + 1].to(dev, lp.dtype)).sum()
            g = flat_grads(torch.autograd.grad(loss, plist, allow_unused=True), plist)
            rows.append(sketch.apply(g) if sketch is not None else g)
    return torch.stack(rows)
