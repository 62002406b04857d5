"""Teacher-forced log-probs of a RolloutBatch's responses under a model (differentiable)."""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from varbench._util.checks import check_positive_int
from varbench.models import memplan
from varbench.models.forward import position_ids_from_mask
from varbench.models.head import read_head
from varbench.models.logits import head_logprobs, sequence_logprobs
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.kvcache import autograd_cache


def logprob_rows(model: torch.nn.Module, batch: RolloutBatch, n_groups: int) -> int | None:
    """Rows per forward+backward of the training step's log-probs over ``n_groups`` groups of
    ``batch``: the memory plan's (path ``train_logprobs``: every layer's kept activations over
    the prompt and the response, the head's chunked logits) inside the budget of the model's
    device; None (one pass) without a measured budget (the CPU) or when all rows fit."""
    budget = memplan.device_budget(next(model.parameters()).device)
    if budget is None:
        return None
    _, G, T = batch.tokens.shape
    B = n_groups * G
    shape = memplan.ModelShape.from_model(model)
    p = memplan.check_plan(memplan.plan(shape, "train_logprobs", B, batch.prompt_ids.shape[1]
                                        + T, budget), "one response's training forward")
    return None if p.chunk >= B else p.chunk


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch,
                      groups: torch.Tensor | None = None, *,
                      shared_prompt: bool = False, rows: int | None = None) -> torch.Tensor:
    """``[p, G, T]`` log pi(y_t | prefix) of the responses of ``groups`` (default: all P).

    One teacher-forced forward of the flat ``[p * G, L]`` rows (positions from the attention
    mask, as when sampling); differentiable when grad mode is on; exactly 0 where ``mask`` is 0.
    In float32 at least; the head's logits are made only for policy tokens, a chunk at a
    time (``varbench.models.logits.sequence_logprobs``).

    ``shared_prompt=True`` runs each group's prompt once (``[p, Lp]``), repeats its keys and
    values G times and runs the responses on top (``[p * G, T - 1]``): ``p Lp + p G (T - 1)``
    positions instead of ``p G (Lp + T)``, the same numbers up to rounding (the same
    attention over the same keys; gradients flow through the shared cache). Used where the
    model allows it (a readable output head, every layer plain full attention, G > 1);
    elsewhere the one flat forward.

    ``rows`` (e.g. :func:`logprob_rows`): at most this many rows (whole groups, at least one)
    per forward; with grad mode on each chunk is checkpointed (its activations are recomputed
    in backward, one chunk at a time), so the memory of a backward is one chunk's, at the
    price of one more forward. The values and gradients are those of one pass up to rounding.
    """
    P, G, T = batch.tokens.shape
    dev = batch.tokens.device
    if groups is None:
        groups = torch.arange(P, device=dev)
    if rows is not None and check_positive_int("rows", rows) < len(groups) * G:
        per = max(1, rows // G)
        parts = []
        for g in groups.split(per):
            if torch.is_grad_enabled():
                # activations of one chunk at a time: recomputed in its backward, not kept
                parts.append(checkpoint(response_logprobs, model, batch, g, use_reentrant=False,
                                        shared_prompt=shared_prompt))
            else:
                parts.append(response_logprobs(model, batch, g, shared_prompt=shared_prompt))
        return torch.cat(parts)
    if shared_prompt and G > 1 and T > 0:
        got = _shared_prompt_logprobs(model, batch, groups)
        if got is not None:
            return got
    flat = batch.flat()
    rows = (groups[:, None] * G + torch.arange(G, device=groups.device)).reshape(-1)
    ids = flat.input_ids[rows]
    # the head's logits only for policy tokens (not padding or environment tokens)
    logp = sequence_logprobs(model, ids, flat.attention_mask[rows], start=flat.prompt_len,
                             mask=batch.mask[groups].reshape(-1, T))  # [p * G, T]
    return logp.reshape(len(groups), G, T) * batch.mask[groups].to(logp.dtype)


def _shared_prompt_logprobs(model: torch.nn.Module, batch: RolloutBatch,
                            groups: torch.Tensor) -> torch.Tensor | None:
    """The ``shared_prompt`` path of :func:`response_logprobs`; None where it does not apply."""
    head, _ = read_head(model)
    cache = autograd_cache(model)
    body = getattr(model, "base_model", None)
    if head is None or cache is None or body is None or body is model:
        return None
    params = inspect.signature(body.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
    if key not in params:
        return None
    _, G, T = batch.tokens.shape
    p = len(groups)
    pids, pmask = batch.prompt_ids[groups], batch.prompt_mask[groups].long()  # [p, Lp]
    out = body(input_ids=pids, attention_mask=pmask, position_ids=position_ids_from_mask(pmask),
               use_cache=True, **{key: cache})
    h_prompt = out.last_hidden_state[:, -1]  # [p, H]: the state that predicts y_0
    cache = getattr(out, "cache", None) or out.past_key_values
    mask = batch.mask[groups].reshape(p * G, T)
    real = (mask + batch.env_mask[groups].reshape(p * G, T)).clamp(max=1).long()
    hidden = [h_prompt.repeat_interleave(G, 0)[:, None]]
    if T > 1:
        cache.batch_repeat_interleave(G)  # differentiable: repeat_interleave of each layer's K, V
        attn = torch.cat([pmask.repeat_interleave(G, 0), real[:, : T - 1]], 1)  # [p G, Lp + T - 1]
        pos = position_ids_from_mask(attn)[:, pids.shape[1]:]
        out = body(input_ids=batch.tokens[groups].reshape(p * G, T)[:, : T - 1],
                   attention_mask=attn, position_ids=pos, use_cache=True, **{key: cache})
        hidden.append(out.last_hidden_state)  # [p G, T - 1, H]: the states that predict y_1..
    h = torch.cat(hidden, 1)  # [p G, T, H]
    sel = mask != 0
    lp = head_logprobs(h[sel], head, batch.tokens[groups].reshape(p * G, T)[sel])
    logp = torch.zeros((p * G, T), dtype=lp.dtype, device=lp.device).index_put((sel,), lp)
    return logp.reshape(p, G, T)
