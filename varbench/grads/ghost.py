"""Ghost-norm engine for exact per-token and prefix norms (the default token_grad_norms path).

For a Linear layer (or an Embedding, a Linear on one-hot inputs) with inputs ``A [t, in]`` and
the cotangents ``D_c [t, out]`` that token c leaves at its outputs, token c's weight gradient is
``g_c = D_c^T A`` (a bias adds a column of ones to A). Two exact ways to its norms, chosen per
layer and chunk by cost (``t`` grows along the sequence, so a layer switches at most once):

- *ghost* (short prefixes, ``t`` below about ``in``): ``||g_c||^2 = <D_c, G D_c>`` with
  ``G = A A^T`` (Gram matrix over positions, "ghost norm", docs/science.md §6); the prefix gradient
  is ``(R + sum_{j<=c} D_j)^T A`` with R the cotangents of earlier chunks summed, so the
  running prefix lives in position space (one ``[L, out]`` matrix per layer, valid because
  causality makes A at positions <= t identical across truncations). One product ``G [D; R]``
  (about ``t^2 out`` per token) and the small Gram ``M_ij = <X_i, G X_j>`` over
  ``X = [D_1..D_C, R]`` give every token and prefix norm of the chunk (the prefix norm is the
  sum of M's entries over ``{1..c, R}``). G does not depend on the cotangents: it is built once
  per sequence, a few new rows per chunk.
- *weight* (long prefixes): ``g_c`` is formed for the chunk (``t in out`` per token, as cheap
  as the backward that produced D) and the running prefix is one ``[out, in]`` matrix per
  layer; at the switch the position-space prefix is converted once (``R = Dcum^T A``).

Parameters outside such modules (norm weights, tied weights, modules called more than once)
are materialised per token and streamed with a running vector, in ``exact.py``.
"""

from __future__ import annotations

import torch

# Switch to weight mode once the ghost cost exceeds WEIGHT_RATIO x the weight cost (see
# GhostModule.use_weight_mode); 1.0: both paths ran at about the same multiply-adds per second
# in a micro-benchmark on the small preset's shapes (CPU, float32, chunk 16).
WEIGHT_RATIO = 1.0


def cumsum_rows_(x: torch.Tensor) -> torch.Tensor:
    """In-place cumulative sum over dim 0 (on CPU several times faster than ``cumsum(0)``)."""
    for i in range(1, x.shape[0]):
        x[i] += x[i - 1]
    return x


class GhostModule:
    """Bookkeeping for one Linear/Embedding handled by ghost norms within one sequence."""

    def __init__(self, module: torch.nn.Module, group: int, L: int) -> None:
        self.module = module
        self.group = group
        self.L = L
        self.is_embedding = isinstance(module, torch.nn.Embedding)
        self.has_bias = getattr(module, "bias", None) is not None
        w = module.weight
        self.n_in = w.shape[0] if self.is_embedding else w.shape[1]
        # torch gives the padding_idx row of an Embedding no gradient: its positions count as 0
        self.pad = getattr(module, "padding_idx", None) if self.is_embedding else None
        self.inp: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.reset()

    def hook(self, mod, args, out) -> None:
        self.inp = args[0].detach()
        self.out = out

    def reset(self) -> None:
        """Start a new sequence: forget cached inputs, Gram matrix and running prefix."""
        self.a: torch.Tensor | None = None  # [L, in(+1)] inputs (ids [L] for an Embedding)
        self.n_a = 0  # positions of self.a filled
        self.gram: torch.Tensor | None = None  # [L, L] A A^T (+1 with a bias)
        self.n_gram = 0
        self.n_prefix = 0  # positions covered by a position-space running prefix
        self.running: torch.Tensor | None = None  # ghost: [L, out]; weight: [out, in(+1)]
        self.weight_mode = False

    def _cache_inputs(self, t: int) -> None:
        """Append this forward's inputs at positions [n_a, t) to the per-sequence cache."""
        x = self.inp[0]
        if self.a is None:
            if self.is_embedding:
                self.a = torch.zeros(self.L, dtype=x.dtype, device=x.device)
            else:
                n = x.shape[-1] + int(self.has_bias)
                self.a = torch.ones(self.L, n, dtype=x.dtype, device=x.device)
        if t > self.n_a:
            if self.is_embedding:
                self.a[self.n_a : t] = x[self.n_a : t]
            else:
                self.a[self.n_a : t, : x.shape[-1]] = x[self.n_a : t]
            self.n_a = t

    def _inputs(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """``A [t, in(+1)]`` (one-hot rows for an Embedding)."""
        if self.is_embedding:
            ids = self.a[:t]
            a = torch.nn.functional.one_hot(ids, self.n_in).to(dtype)
            return a if self.pad is None else a * (ids != self.pad).to(dtype)[:, None]
        return self.a[:t]

    def _gram(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """``A A^T [t, t]``, extended by the rows/columns of the positions new since last call."""
        if self.gram is None:
            self.gram = torch.zeros(self.L, self.L, dtype=dtype, device=self.a.device)
        s = self.n_gram
        if t > s:
            if self.is_embedding:
                new = self.a[s:t, None] == self.a[None, :t]
                if self.pad is not None:
                    new &= self.a[None, :t] != self.pad
                    new &= self.a[s:t, None] != self.pad
                new = new.to(dtype)
            else:
                new = self.a[s:t] @ self.a[:t].T
            self.gram[s:t, :t] = new
            self.gram[:s, s:t] = new[:, :s].T
            self.n_gram = t
        return self.gram[:t, :t]

    def use_weight_mode(self, C: int, t: int) -> bool:
        """Cost model (multiply-adds, measured to hold within ~20% on CPU): the ghost products
        ``G [D; R]`` and their Gram cost ``(C+1) t (t+C+1) out``; forming ``g`` costs
        ``C t in out`` plus about four passes over ``[C, out, in]``."""
        n_in = self.n_in + int(self.has_bias)
        return (C + 1) * t * (t + C + 1) > WEIGHT_RATIO * C * (t + 4) * n_in

    def norms(self, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``D [C, t, out]`` cotangents of this chunk -> (token_sq [C], prefix_sq [C])."""
        C, t, n_out = D.shape
        self._cache_inputs(t)
        if not self.weight_mode and self.use_weight_mode(C, t):
            if self.running is not None:  # convert the position-space prefix once
                n = self.n_prefix
                self.running = self.running[:n].T @ self._inputs(n, D.dtype)
            self.weight_mode = True
        if self.weight_mode:
            return self._weight_norms(D)
        if self.running is None:
            self.running = torch.zeros(self.L, n_out, dtype=D.dtype, device=D.device)
        # M = <X_i, G X_j> over X = [D_1..D_C, R]: one product with G serves token and prefix
        # norms alike (the prefix norm expands ||R + sum_{j<=c} D_j||_G^2 in M's entries)
        gram_a = self._gram(t, D.dtype)
        R = self.running[:t]
        GD = torch.matmul(gram_a, D).reshape(C, -1)
        GR = (gram_a @ R).reshape(-1)
        flat = D.reshape(C, -1)
        m_dd = flat @ GD.T
        m_dr = flat @ GR
        tok = m_dd.diagonal()
        pre = m_dd.cumsum(0).cumsum(1).diagonal() + 2 * m_dr.cumsum(0) + R.reshape(-1) @ GR
        self.running[:t] += D.sum(0)
        self.n_prefix = t
        return tok, pre

    def _weight_norms(self, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        C, t, _ = D.shape
        g = torch.matmul(D.transpose(1, 2), self._inputs(t, D.dtype))  # [C, out, in(+1)]
        flat = g.reshape(C, -1)
        tok = torch.linalg.vecdot(flat, flat)
        if self.running is not None:
            flat[0] += self.running.reshape(-1)
        cumsum_rows_(flat)
        pre = torch.linalg.vecdot(flat, flat)
        self.running = flat[-1].reshape(g.shape[1:]).clone()
        return tok, pre


def plan_ghost(
    model: torch.nn.Module, chosen: list[tuple[str, torch.nn.Parameter]]
) -> tuple[list[tuple[torch.nn.Module, str]], list[tuple[str, torch.nn.Parameter]]]:
    """Split chosen params into ghost modules ``[(module, weight_name)]`` and the rest.

    A Linear/Embedding qualifies when its weight is chosen, its bias (if any) is chosen, and its
    weight tensor is not shared with another module (a tied head is not).
    """
    chosen_ids = {id(p): n for n, p in chosen}
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    ghost, taken = [], set()
    for m in model.modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        w = m.weight
        b = getattr(m, "bias", None)
        if id(w) not in chosen_ids or owners.get(id(w), 0) != 1:
            continue
        if b is not None and id(b) not in chosen_ids:
            continue
        if isinstance(m, torch.nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq):
            continue
        ghost.append((m, chosen_ids[id(w)]))
        taken.add(id(w))
        if b is not None:
            taken.add(id(b))
    rest = [(n, p) for n, p in chosen if id(p) not in taken]
    return ghost, rest
