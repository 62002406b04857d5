"""Exact per-sequence gradients ``sum_t m_t g_t`` and a seeded Johnson-Lindenstrauss sketch.

:class:`Sketch` is the one random projection used across varbench.grads (sequence gradients,
group gradients, forward-mode token sketches), so sketches from different routes are directly
comparable: ``S x = V^T x / sqrt(k)`` with ``V`` a ``P x k`` matrix of iid N(0, 1) entries.
Column j of V is generated from ``seed`` and j alone (on the CPU, then moved), never stored
whole: memory O(P), cost k draws of P normals per application.

Variance (Gaussian JL, any fixed x, y): ``E[<Sx, Sy>] = <x, y>`` and
``Var[<Sx, Sy>] = (||x||^2 ||y||^2 + <x, y>^2) / k``; in particular
``Var[||Sx||^2] = 2 ||x||^4 / k`` (relative std ``sqrt(2 / k)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench._util.checks import check_positive_int
from varbench.grads._inputs import check_inputs, eval_mode, prepare_model
from varbench.grads.params import ParamFilter, select_params
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs


@dataclass(frozen=True)
class Sketch:
    """Seeded Gaussian JL sketch of dimension ``k`` (see the module docstring for variance)."""

    k: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("k", self.k)
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")

    def direction(self, j: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Column j of V: ``[n]`` iid N(0, 1), a function of (seed, j, n) only."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + j)
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n] -> [..., k]``: ``S x`` for each row of x."""
        n = x.shape[-1]
        cols = [x @ self.direction(j, n, x.dtype, x.device) for j in range(self.k)]
        return torch.stack(cols, dim=-1) / self.k**0.5


def flat_grads(grads, params) -> torch.Tensor:
    """Concatenate per-parameter gradients (None -> zeros) into one flat vector."""
    return torch.cat(
        [
            torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if g is None else g.reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    )


def sequence_grads(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    sketch: Sketch | None = None,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Per-sequence gradients ``grad sum_t m_t log p_t``: ``[B, P]``, or ``[B, k]`` sketched.

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
