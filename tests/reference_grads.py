"""Brute-force references for varbench.grads: one ``torch.autograd.grad`` per token.

Deliberately naive and independent of the fast paths: every token gets a full-length forward
(no causal truncation, no batching), its log-prob is written out inline, and all per-token
gradients are kept as one ``[B, L, P]`` tensor (tiny models only).
"""

from __future__ import annotations

import torch

from varbench.models.forward import forward_logits


def brute_token_grads(model, input_ids, response_mask, attention_mask=None, params=None):
    """``[B, L, P]`` per-token gradients (0 rows off the response mask) and the param names."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if params is not None:
        named = [(n, p) for n, p in named if n in set(params)]
    plist = [p for _, p in named]
    P = sum(p.numel() for p in plist)
    B, L = input_ids.shape
    dtype = plist[0].dtype
    out = torch.zeros(B, L, P, dtype=dtype)
    model.eval()
    for b in range(B):
        for t in range(1, L):
            if response_mask[b, t] == 0:
                continue
            logits = forward_logits(model, input_ids[b : b + 1], attention_mask[b : b + 1]).logits
            lp = torch.log_softmax(logits[0, t - 1], dim=-1)[input_ids[b, t]]
            grads = torch.autograd.grad(lp, plist, allow_unused=True)
            out[b, t] = torch.cat(
                [
                    (torch.zeros(p.numel(), dtype=dtype) if g is None else g.reshape(-1))
                    for g, p in zip(grads, plist, strict=True)
                ]
            )
    return out, [n for n, _ in named], [p.numel() for p in plist]


def norms_from_grads(g, response_mask):
    """token_sq, prefix_sq, diag_prefix_sq ``[B, L]`` from ``[B, L, P]`` per-token gradients."""
    m = response_mask.to(g.dtype)
    token = g.pow(2).sum(-1) * m
    prefix = (g * m.unsqueeze(-1)).cumsum(1).pow(2).sum(-1) * m
    diag = token.cumsum(1) * m
    return token, prefix, diag


def brute_sequence_grads(model, input_ids, response_mask, attention_mask=None):
    """``[B, P]`` per-sequence gradients of ``sum_t m_t log p_t`` by one backward per sequence."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    plist = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(input_ids.shape[0]):
        logits = forward_logits(model, input_ids[b : b + 1], attention_mask[b : b + 1]).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, input_ids[b, 1:, None])[:, 0]
        loss = (lp * response_mask[b, 1:].to(lp.dtype)).sum()
        grads = torch.autograd.grad(loss, plist, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    torch.zeros(p.numel(), dtype=lp.dtype) if g is None else g.reshape(-1)
                    for g, p in zip(grads, plist, strict=True)
                ]
            )
        )
    return torch.stack(rows)


def dense_count_sketch(sketch, dtype=torch.float64):
    """The ``[K, D]`` matrix of a CountSketch, one entry at a time: ``S[h(i), i] = s(i)``."""
    S = torch.zeros(sketch.dim, sketch.n_params, dtype=dtype)
    i = 0
    for b, s in zip(*sketch.hashes(), strict=True):
        for j in range(b.numel()):
            S[int(b[j]), i] = float(s[j])
            i += 1
    return S


def brute_group_gradients(model, batch, coeffs):
    """``[P, D]`` group gradients ``sum_{i,t} c_{p,i,t} grad log p_{p,i,t}``: one backward of the
    weighted log-prob sum per SEQUENCE (log-probs written out inline), summed over each group."""
    flat = batch.flat()
    c = torch.zeros(batch.P * batch.G, flat.input_ids.shape[1], dtype=torch.float64)
    c[:, flat.prompt_len :] = (coeffs * batch.mask).reshape(batch.P * batch.G, batch.T)
    plist = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    rows = []
    for b in range(flat.input_ids.shape[0]):
        ids, am = flat.input_ids[b : b + 1], flat.attention_mask[b : b + 1]
        logits = forward_logits(model, ids, am).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        loss = (lp * c[b, 1:].to(lp.dtype)).sum()
        grads = torch.autograd.grad(loss, plist, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    torch.zeros(p.numel(), dtype=lp.dtype) if g is None else g.reshape(-1)
                    for g, p in zip(grads, plist, strict=True)
                ]
            )
        )
    return torch.stack(rows).reshape(batch.P, batch.G, -1).sum(1)
