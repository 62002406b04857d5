"""The one way varbench runs a causal LM forward: positions follow the attention mask.

Left-padded prompts and right-padded responses both occur; position ids are computed from the
attention mask so that sampling (with a KV cache) and teacher forcing see the same positions.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] positions counting real tokens only (0 at and before the first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """Run ``model`` on ``input_ids`` [B, L]; returns the model output (``.logits`` [B, L, V]).

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``. Extra kwargs go to the model
    (e.g. ``output_hidden_states=True``).
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
