"""Slow references for varbench.models: the statistics of pi written out one position at a
time in float64 with ``log_softmax`` (no shared code with ``varbench.models.logits``)."""

from __future__ import annotations

import torch


def brute_pi_stats(logits, tokens):
    """``(logp, entropy, sum_pi_sq)`` of ``softmax(logits)``, float64, of the logits' shape
    without the vocabulary axis: one position at a time, ``log p = log_softmax(z)`` in float64,
    ``entropy = -sum_{v: p_v > 0} p_v log p_v``, ``sum_pi_sq = sum_v p_v^2``."""
    V = logits.shape[-1]
    z = logits.detach().double().reshape(-1, V)
    y = tokens.reshape(-1)
    logp, ent, sq = [], [], []
    for row, tok in zip(z, y, strict=True):
        lp = torch.log_softmax(row, dim=0)
        p = lp.exp()
        logp.append(lp[int(tok)].item())
        ent.append(-sum(p[v].item() * lp[v].item() for v in range(V) if p[v] > 0))
        sq.append(sum(p[v].item() ** 2 for v in range(V)))
    shape = logits.shape[:-1]
    return tuple(torch.tensor(x, dtype=torch.float64).reshape(shape) for x in (logp, ent, sq))


def plain_token_stats(model, input_ids, attention_mask, start=1):
    """``(logp, entropy)`` ``[B, L - start]`` of tokens ``input_ids[:, start:]`` from the model's
    full float64 logits with ``log_softmax`` (differentiable; the plain path the chunked
    ``sequence_logprobs`` replaces)."""
    from varbench.models.forward import forward_logits

    z = forward_logits(model, input_ids, attention_mask).logits[:, start - 1:-1].double()
    lsm = torch.log_softmax(z, -1)
    logp = lsm.gather(-1, input_ids[:, start:, None]).squeeze(-1)
    return logp, -(lsm.exp() * lsm).sum(-1)


def brute_topk(logits, k):
    """``(top-k log-probs, ids, max prob)`` of ``softmax(logits)`` by sorting, float64."""
    lsm = torch.log_softmax(logits.detach().double(), -1)
    srt, idx = torch.sort(lsm, -1, descending=True)
    return srt[..., :k], idx[..., :k], srt[..., 0].exp()
