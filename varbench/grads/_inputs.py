"""Boundary checks and model preparation shared by the gradient-harness modules."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_shape


def check_inputs(
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate ``[B, L]`` inputs; returns (input_ids long, response_mask, attention_mask long).

    ``response_mask[:, 0]`` must be 0 (nothing predicts the first token) and the response mask
    must lie inside the attention mask.
    """
    check_shape("input_ids", input_ids, [None, None])
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise UsageTypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    B, L = input_ids.shape
    check_shape("response_mask", response_mask, [B, L])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_shape("attention_mask", attention_mask, [B, L])
    response_mask = response_mask.to(input_ids.device)
    attention_mask = attention_mask.to(input_ids.device).long()
    if L < 2:
        raise UsageError(f"input_ids has length L={L}; need L >= 2 to have a predicted token")
    # the three checks read in one host sync
    not_binary, first, padded = torch.stack([
        ~torch.all((response_mask == 0) | (response_mask == 1)),
        torch.any(response_mask[:, 0] != 0),
        torch.any((response_mask != 0) & (attention_mask == 0)),
    ]).tolist()
    if not_binary:
        raise UsageError("response_mask must contain only 0 and 1")
    if first:
        raise UsageError("response_mask[:, 0] must be 0: nothing predicts the first token")
    if padded:
        raise UsageError("response_mask is 1 where attention_mask is 0 (a padded position)")
    return input_ids.long(), response_mask, attention_mask


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run in eval mode (no dropout: per-token gradients must be deterministic), then restore.

    A model whose root is already in eval mode is left untouched: ``eval()``/``train()`` walk
    every submodule, which costs a noticeable fraction of a small model's forward. (A root in
    eval mode with a submodule left in training mode is not supported.)
    """
    if not model.training:
        yield
        return
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def prepare_model(
    model: torch.nn.Module, dtype: torch.dtype | None, device: str | torch.device | None
) -> torch.nn.Module:
    """Return ``model`` itself, or a copy in ``dtype`` on ``device`` when either differs.

    A copy (never an in-place cast) so the caller's policy is untouched; parameter names, and so
    parameter filters and groups, are the same in the copy.
    """
    p = next(model.parameters())
    want_dtype = dtype or p.dtype
    want_device = torch.device(device) if device is not None else p.device
    if dtype is not None and not dtype.is_floating_point:
        raise UsageTypeError(f"dtype must be a floating dtype, got {dtype}")
    if p.dtype == want_dtype and p.device == want_device:
        return model
    return copy.deepcopy(model).to(device=want_device, dtype=want_dtype)


def prepare(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype | None,
    device: str | torch.device | None,
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`check_inputs`, then :func:`prepare_model`, then the inputs moved to the model's
    device: ``(model, input_ids, response_mask, attention_mask)``, the entry of every exact path.
    """
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask
    )
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
    return model, input_ids.to(dev), response_mask.to(dev), attention_mask.to(dev)
