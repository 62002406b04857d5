"""Ghost-norm engine for exact per-token and prefix norms (the default token_grad_norms path).

For a Linear layer (or an Embedding, a Linear on one-hot inputs) with inputs ``A [t, in]`` and
the cotangents ``D_c [t, out]`` that token c leaves at its outputs, token c's weight gradient is
``D_c^T A``, so ``||g_c||^2 = <D_c D_c^T, A A^T>`` (Gram matrices over positions, "ghost norm",
SCIENCE.md 6) and the prefix gradient is ``Dcum_c^T A`` with ``Dcum_c = sum_{j<=c} D_j``: the
running prefix lives in position space (one ``[L, out]`` matrix per layer, valid because
causality makes A at positions <= t identical across truncations). The weight gradient is
never formed when ``t < in``; otherwise ``D^T A`` is formed for the chunk (cheaper there).
Parameters outside such modules (norm weights, tied weights, modules called more than once)
are materialised per token and streamed with a running vector, as in ``exact.py``.
"""

from __future__ import annotations

import torch


class GhostModule:
    """Bookkeeping for one Linear/Embedding handled by ghost norms within one sequence."""

    def __init__(self, module: torch.nn.Module, group: int, L: int) -> None:
        self.module = module
        self.group = group
        self.L = L
        self.is_embedding = isinstance(module, torch.nn.Embedding)
        self.has_bias = getattr(module, "bias", None) is not None
        self.inp: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.running: torch.Tensor | None = None  # [L, out] sum of cotangents of past tokens

    def hook(self, mod, args, out) -> None:
        self.inp = args[0].detach()
        self.out = out

    def reset(self) -> None:
        self.running = None

    def norms(self, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``D [C, t, out]`` cotangents of this chunk -> (token_sq [C], prefix_sq [C])."""
        C, t, n_out = D.shape
        if self.running is None:
            self.running = torch.zeros(self.L, n_out, dtype=D.dtype, device=D.device)
        dcum = D.cumsum(0)
        dcum += self.running[:t]
        self.running[:t] = dcum[-1]
        if self.is_embedding:
            ids = self.inp[0]
            gram_a = (ids[:, None] == ids[None, :]).to(D.dtype)  # one-hot inputs
            ghost = True
        else:
            a = self.inp[0]  # [t, in]
            ghost = t < a.shape[-1]
            gram_a = a @ a.T if ghost else None
        if ghost:
            if self.has_bias:
                gram_a = gram_a + 1
            tok = (torch.bmm(D, D.transpose(1, 2)) * gram_a).sum((1, 2))
            pre = (torch.bmm(dcum, dcum.transpose(1, 2)) * gram_a).sum((1, 2))
            return tok, pre
        # t >= in: forming the C x out x in gradients is cheaper than t x t Grams
        g = torch.matmul(D.transpose(1, 2), a)  # [C, out, in]
        gc = torch.matmul(dcum.transpose(1, 2), a)
        tok = g.pow(2).sum((1, 2))
        pre = gc.pow(2).sum((1, 2))
        if self.has_bias:
            tok = tok + D.sum(1).pow(2).sum(-1)
            pre = pre + dcum.sum(1).pow(2).sum(-1)
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
