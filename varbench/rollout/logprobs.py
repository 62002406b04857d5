"""Teacher-forced log-probs of a RolloutBatch's responses under a model (differentiable)."""

from __future__ import annotations

import torch

from varbench.models.logits import sequence_logprobs
from varbench.rollout.batch import RolloutBatch


def response_logprobs(model: torch.nn.Module, batch: RolloutBatch,
                      groups: torch.Tensor | None = None) -> torch.Tensor:
    """``[p, G, T]`` log pi(y_t | prefix) of the responses of ``groups`` (default: all P).

    One teacher-forced forward of the flat ``[p * G, L]`` rows (positions from the attention
    mask, as when sampling); differentiable when grad mode is on; exactly 0 where ``mask`` is 0.
    In float32 at least; the head's logits are made only for policy tokens, a chunk at a
    time (``varbench.models.logits.sequence_logprobs``).
    """
    flat = batch.flat()
    P, G, T = batch.tokens.shape
    if groups is None:
        groups = torch.arange(P, device=flat.input_ids.device)
    rows = (groups[:, None] * G + torch.arange(G, device=groups.device)).reshape(-1)
    ids = flat.input_ids[rows]
    # the head's logits only for policy tokens (not padding or environment tokens)
    logp = sequence_logprobs(model, ids, flat.attention_mask[rows], start=flat.prompt_len,
                             mask=batch.mask[groups].reshape(-1, T))  # [p * G, T]
    return logp.reshape(len(groups), G, T) * batch.mask[groups].to(logp.dtype)
