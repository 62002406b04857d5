"""Per-token gradient vectors of a RolloutBatch, flat or count-sketched, computed ONCE.

Every coefficient set (advantage scheme x aggregation mode x G) is then a contraction
``g_hat = sum_{i,t} c_{i,t} v_{i,t}`` of the same vectors: the paired design of the variance
analysis, where adding a scheme costs an einsum instead of a backward pass.

Per-token gradients come from the exact harness (``varbench.grads.exact.iter_token_grads``),
one chunk of ``[C, numel]`` rows at a time; each chunk is reduced immediately to
- its exact squared norm ``||g_t||^2`` (the exact OTB weight), and
- ``v_t = S g_t`` with S a fixed seeded CountSketch ``R^D -> R^K`` (each coordinate hashed to
  one of K buckets with a random sign). ``E_S <S x, S y> = <x, y>``, so traces, norms and inner
  products of estimates are preserved in expectation over S (relative error of one inner
  product ~ sqrt(2/K)); ``sketch_dim=None`` keeps flat gradients (exact, D floats per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varbench.grads._inputs import check_inputs
from varbench.grads.exact import DEFAULT_CHUNK, iter_token_grads
from varbench.grads.params import ParamFilter, select_params


@dataclass
class TokenVectors:
    """``vec [P, G, T, K]`` per-token gradient vectors (sketched or flat) and exact
    ``token_sq [P, G, T]`` = ||g_t||^2; both 0 where the batch mask is 0. ``dim`` is K,
    ``n_params`` is D, ``sketch`` says "countsketch(K, seed)" or "flat"."""

    vec: torch.Tensor
    token_sq: torch.Tensor
    dim: int
    n_params: int
    sketch: str


class CountSketch:
    """A fixed random CountSketch of a list of parameter tensors into K dimensions."""

    def __init__(self, numels: list[int], dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(int(seed))
        self.dim = dim
        self.buckets = [torch.randint(0, dim, (n,), generator=g) for n in numels]
        self.signs = [torch.randint(0, 2, (n,), generator=g).float() * 2 - 1 for n in numels]

    def __call__(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """``[C, numel_i]`` per parameter -> ``[C, K]``."""
        C = grads[0].shape[0]
        out = torch.zeros(C, self.dim, dtype=grads[0].dtype, device=grads[0].device)
        for g, b, s in zip(grads, self.buckets, self.signs, strict=True):
            out.index_add_(1, b.to(g.device), g * s.to(g.device, g.dtype))
        return out


def token_vectors(
    model: torch.nn.Module,
    batch,
    *,
    sketch_dim: int | None = 1024,
    sketch_seed: int = 0,
    params: ParamFilter = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
) -> TokenVectors:
    """Per-token gradient vectors of every response token of ``batch`` (a RolloutBatch).

    Cost: the exact harness's per-token backward (about one backward per token over its
    prefix). Memory: ``P*G*T*K`` floats. ``sketch_dim=None`` or ``>= D``: flat gradients.
    """
    flat = batch.flat()
    ids, rmask, amask = check_inputs(flat.input_ids, flat.response_mask, flat.attention_mask)
    plist = [p for _, p in select_params(model, params)]
    numels = [p.numel() for p in plist]
    D = sum(numels)
    use_flat = sketch_dim is None or sketch_dim >= D
    K = D if use_flat else int(sketch_dim)
    sk = None if use_flat else CountSketch(numels, K, sketch_seed)
    B, L = ids.shape
    dtype = plist[0].dtype
    vec = torch.zeros(B, L, K, dtype=dtype)
    tsq = torch.zeros(B, L, dtype=dtype)
    for b, cols, grads in iter_token_grads(model, ids, rmask, amask, plist, chunk_size,
                                           progress=progress):
        tsq[b, cols] = sum(g.pow(2).sum(1) for g in grads).cpu()
        vec[b, cols] = (torch.cat(grads, 1) if sk is None else sk(grads)).cpu()
    return TokenVectors(
        vec=batch.to_groups(vec),
        token_sq=batch.to_groups(tsq),
        dim=K,
        n_params=D,
        sketch="flat" if use_flat else f"countsketch(K={K}, seed={sketch_seed})",
    )
