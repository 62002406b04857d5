"""Group-gradient estimates ``g_hat_p = sum_{i,t} c_{p,i,t} g_{p,i,t}`` (docs/science.md §2, 5).

Two routes, one sketch (:class:`varbench.grads.vectors.CountSketch`):
- :func:`group_gradients`: the slow reference, one backward of the weighted log-prob sum per
  group (the G responses of a group run as one batch), as flat vectors ``[P, D]`` or sketched
  ``[P, K]`` (``S g_hat``).
- :func:`token_sketches` + :func:`combine`: every per-token gradient ``S g_{p,i,t}`` (or flat)
  once, by :func:`varbench.grads.vectors.token_vectors` (the path the variance analysis uses),
  then any number of coefficient sets cost one contraction each.
  ``combine(token_sketches(..., S), c) == group_gradients(..., sketch=S)`` up to rounding (both
  are ``S g_hat``; S is linear), so many estimator schemes can be compared cheaply.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageTypeError, check_shape
from varbench.grads._inputs import eval_mode, prepare_model
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.sequence import check_sketch, flat_grads
from varbench.grads.vectors import CountSketch, combine, token_vectors
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.batch import RolloutBatch

__all__ = ["combine", "group_gradients", "token_sketches"]


def _flat_coeffs(batch: RolloutBatch, coeffs: torch.Tensor) -> torch.Tensor:
    """``[P, G, T]`` coefficients -> ``[B, L]`` aligned with ``batch.flat()`` (0 off the mask)."""
    _check_batch(batch)
    check_shape("coeffs", coeffs, [batch.P, batch.G, batch.T])
    if not torch.all(torch.isfinite(coeffs)):
        raise ValueError("coeffs contains NaN or inf")
    Lp = batch.prompt_ids.shape[1]
    c = coeffs.reshape(batch.P * batch.G, batch.T) * batch.mask.reshape(batch.P * batch.G, -1)
    return torch.nn.functional.pad(c, (Lp, 0))


def _check_batch(batch) -> None:
    if not isinstance(batch, RolloutBatch):
        raise UsageTypeError(f"batch must be a RolloutBatch, got {type(batch).__name__}")


def group_gradients(
    model: torch.nn.Module,
    batch: RolloutBatch,
    coeffs: torch.Tensor,
    *,
    sketch: CountSketch | None = None,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Exact ``g_hat_p`` for every group: ``[P, n_params]``, or ``[P, K]`` = ``S g_hat_p``.

    ``coeffs [P, G, T]``: per-token coefficients (advantage x aggregation weight x ...); only
    tokens with ``batch.mask == 1`` count. ``sketch``: a :class:`CountSketch` for the selected
    ``params`` on the device the model runs on (``CountSketch.for_model(model, K, seed,
    params=params, device=device)``). One forward + backward per group.
    """
    c = _flat_coeffs(batch, coeffs)
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
    plist = [p for _, p in select_params(model, params)]
    check_sketch(sketch, plist)
    flat = batch.flat()
    # moved to the model's device once, not per group
    input_ids, attention_mask, c = (x.to(dev) for x in (flat.input_ids, flat.attention_mask, c))
    G = batch.G
    rows = []
    with eval_mode(model):
        for p in range(batch.P):
            sl = slice(p * G, (p + 1) * G)
            ids = input_ids[sl]
            logits = forward_logits(model, ids, attention_mask[sl]).logits
            lp = token_logprobs(logits, ids)
            loss = (lp * c[sl].to(lp.dtype)).sum()
            g = flat_grads(torch.autograd.grad(loss, plist, allow_unused=True), plist)
            rows.append(sketch.apply(g) if sketch is not None else g)
    return torch.stack(rows)


def token_sketches(
    model: torch.nn.Module,
    batch: RolloutBatch,
    sketch: CountSketch | None,
    *,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """``[P, G, T, K]`` sketches ``S g_{p,i,t}`` of every per-token gradient (0 off the mask);
    ``sketch=None``: the flat per-token gradients ``[P, G, T, D]``.

    ``token_vectors(model, batch, sketch=sketch).vec`` on the device the model runs on (the
    ``sketch`` must be built for the selected ``params`` there). Cost: the exact harness's
    per-token backward (about one backward per response token over its prefix). Reuse the result
    with :func:`combine` for many coefficient sets.
    """
    _check_batch(batch)
    if sketch is not None and not isinstance(sketch, CountSketch):
        raise UsageTypeError(
            f"sketch must be a varbench.grads.CountSketch or None, got {type(sketch).__name__}"
        )
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
    return token_vectors(model, batch, sketch_dim=None, sketch=sketch, params=params,
                         out_device=dev).vec
