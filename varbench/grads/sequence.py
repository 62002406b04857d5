"""Exact per-sequence gradients ``sum_t m_t g_t``, flat or count-sketched.

The sketch is varbench's one sketch, :class:`varbench.grads.vectors.CountSketch` (see there for
its unbiasedness and variance), so sequence, group and per-token sketches built from the same
``(params, K, seed)`` are directly comparable.

:class:`GaussianProbes` is NOT a sketch of gradient vectors (it has no ``apply``): it only
supplies the iid N(0, I) probe directions of the forward-mode norm estimator
:func:`varbench.grads.sketch.sketched_token_norms`, which truly needs iid Gaussian probes (see
its docstring). It lives here because ``varbench.grads.sketch`` imports it from here, under its
former name ``Sketch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench._util.checks import UsageTypeError, check_positive_int
from varbench.grads._inputs import check_inputs, eval_mode, prepare_model
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.vectors import CountSketch
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs


@dataclass(frozen=True)
class GaussianProbes:
    """k seeded iid ``N(0, I)`` probe directions over the parameters, for forward-mode JVPs only.

    Why Gaussian (and not the CountSketch): :func:`varbench.grads.sketch.sketched_token_norms`
    averages ``u_j^2 = (g . v_j)^2`` over k INDEPENDENT, identically distributed probes, so that
    (a) ``k * estimate / ||g||^2 ~ chi2_k`` exactly, ``Var = 2 ||g||^4 / k`` per entry, and (b)
    the sample std of the k per-probe values over sqrt(k) is a valid error bar. The k buckets of
    a CountSketch are neither independent nor identically scaled probes, so neither holds for
    them. Direction j is generated from ``seed * 1_000_003 + j`` alone (float64 normals on the
    CPU, then cast and moved), never stored whole.
    """

    k: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("k", self.k)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageTypeError(f"seed must be an int, got {type(self.seed).__name__}")

    def direction(self, j: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Probe j: ``[n]`` iid N(0, 1), a function of (seed, j, n) only."""
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + j)
        v = torch.randn(n, generator=g, dtype=torch.float64, device="cpu")
        return v.to(dtype=dtype, device=device)


# Former name, kept only because varbench/grads/sketch.py imports it; not a sketch any more.
Sketch = GaussianProbes


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
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask
    )
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
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
