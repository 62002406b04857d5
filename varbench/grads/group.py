"""Group-gradient estimates ``g_hat_p = sum_{i,t} c_{p,i,t} g_{p,i,t}`` (SCIENCE.md 2, 5).

Two routes:
- :func:`group_gradients`: exact, one backward of the weighted log-prob sum per group (the G
  responses of a group run as one batch), as flat vectors ``[P, n]`` or sketched ``[P, k]``.
- :func:`token_sketches` + :func:`combine`: sketch every per-token gradient once
  (forward-mode, k JVPs, see :mod:`varbench.grads.sketch`), then any number of coefficient sets
  cost one contraction each. ``combine(token_sketches(...), c) == group_gradients(..., sketch=S)``
  exactly (both are ``S g_hat``), so many estimator schemes can be compared cheaply.
"""

from __future__ import annotations

import torch

from varbench._util.checks import check_shape
from varbench.grads._inputs import eval_mode, prepare_model
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.sequence import Sketch, flat_grads
from varbench.grads.sketch import jvp_token_probes
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.batch import RolloutBatch


def _flat_coeffs(batch: RolloutBatch, coeffs: torch.Tensor) -> torch.Tensor:
    """``[P, G, T]`` coefficients -> ``[B, L]`` aligned with ``batch.flat()`` (0 off the mask)."""
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"batch must be a RolloutBatch, got {type(batch).__name__}")
    check_shape("coeffs", coeffs, [batch.P, batch.G, batch.T])
    if not torch.all(torch.isfinite(coeffs)):
        raise ValueError("coeffs contains NaN or inf")
    Lp = batch.prompt_ids.shape[1]
    c = coeffs.reshape(batch.P * batch.G, batch.T) * batch.mask.reshape(batch.P * batch.G, -1)
    return torch.nn.functional.pad(c, (Lp, 0))


def group_gradients(
    model: torch.nn.Module,
    batch: RolloutBatch,
    coeffs: torch.Tensor,
    *,
    sketch: Sketch | None = None,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Exact ``g_hat_p`` for every group: ``[P, n_params]`` or ``[P, k]`` with ``sketch``.

    ``coeffs [P, G, T]``: per-token coefficients (advantage x aggregation weight x ...); only
    tokens with ``batch.mask == 1`` count. One forward + backward per group.
    """
    c = _flat_coeffs(batch, coeffs)
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
    plist = [p for _, p in select_params(model, params)]
    flat = batch.flat()
    G = batch.G
    rows = []
    with eval_mode(model):
        for p in range(batch.P):
            sl = slice(p * G, (p + 1) * G)
            ids = flat.input_ids[sl].to(dev)
            logits = forward_logits(model, ids, flat.attention_mask[sl].to(dev)).logits
            lp = token_logprobs(logits, ids)
            loss = (lp * c[sl].to(dev, lp.dtype)).sum()
            g = flat_grads(torch.autograd.grad(loss, plist, allow_unused=True), plist)
            rows.append(sketch.apply(g) if sketch is not None else g)
    return torch.stack(rows)


def token_sketches(
    model: torch.nn.Module,
    batch: RolloutBatch,
    sketch: Sketch,
    *,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """``[P, G, T, k]`` sketches ``S g_{p,i,t}`` of every per-token gradient (0 off the mask).

    Cost: k forward-mode JVPs over the batch (independent of T), versus T backwards for exact
    per-token gradients. Reuse the result with :func:`combine` for many coefficient sets.
    """
    flat = batch.flat()
    u = jvp_token_probes(
        model,
        flat.input_ids,
        flat.response_mask,
        flat.attention_mask,
        sketch,
        params=params,
        dtype=dtype,
        device=device,
    )  # [k, B, L] = V^T g
    u = u.permute(1, 2, 0) / sketch.k**0.5  # [B, L, k]
    return batch.to_groups(u)


def combine(sketches: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """``[P, G, T, k]`` token sketches and ``[P, G, T]`` (or ``[S, P, G, T]`` for S coefficient
    sets) coefficients -> ``[P, k]`` (or ``[S, P, k]``): ``sum_{i,t} c_{p,i,t} S g_{p,i,t}``."""
    check_shape("sketches", sketches, [None, None, None, None])
    P, G, T, _ = sketches.shape
    if coeffs.dim() == 3:
        check_shape("coeffs", coeffs, [P, G, T])
        return torch.einsum("pgtk,pgt->pk", sketches, coeffs.to(sketches.dtype))
    check_shape("coeffs", coeffs, [None, P, G, T])
    return torch.einsum("pgtk,spgt->spk", sketches, coeffs.to(sketches.dtype))
