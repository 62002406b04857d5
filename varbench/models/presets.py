"""Embedded policies: named presets building transformers' Llama causal LM from a config.

Nothing is downloaded: the weights are a seeded random initialisation and the tokenizer is the
local char-level one (``varbench.models.tokenizer``). Presets (parameter counts with untied
embeddings, vocabulary of 30):

- ``micro``: 2 layers, hidden 16 (~9k) -- unit tests and exact enumeration.
- ``tiny``:  2 layers, hidden 64 (~100k) -- the default policy, warm start in seconds.
- ``small``: 4 layers, hidden 192 (~1.8M) -- the benchmark size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from varbench._util.checks import UsageError, UsageTypeError, check_choice
from varbench.models.tokenizer import build_tokenizer

_PRESETS: dict[str, dict] = {
    "micro": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128),
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=256),
}
_ATTN = ("eager", "sdpa")


@dataclass
class Policy:
    """A causal LM with its tokenizer. ``name`` is the preset name or the checkpoint path."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    name: str
    meta: dict = field(default_factory=dict)  # e.g. warm-start accuracy, cache path

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + response) the model's positions cover."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else 1 << 30

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def presets() -> list[str]:
    """Names of the embedded policy presets."""
    return list(_PRESETS)


def preset_config(preset: str, *, tie_embeddings: bool = False, attn_implementation: str = "sdpa",
                  vocab_size: int | None = None) -> LlamaConfig:
    """LlamaConfig of ``preset`` with the embedded tokenizer's special token ids."""
    check_choice("preset", preset, presets())
    check_choice("attn_implementation", attn_implementation, _ATTN)
    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=bool(tie_embeddings),
        rms_norm_eps=1e-6,
        **_PRESETS[preset],
    )
    cfg._attn_implementation = attn_implementation
    return cfg


def not_a_policy(arg: str, value: object) -> UsageError:
    """The one refusal of a value that names neither a preset nor a local checkpoint
    directory (raised by the loader, the policy builder, the warm start and the CLI)."""
    return UsageError(f"{arg}={str(value)!r} is not valid; choose a preset {presets()} or a "
                      "local checkpoint directory containing config.json")


def build_preset(
    preset: str,
    *,
    seed: int = 0,
    tie_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
) -> Policy:
    """Build preset ``preset`` with weights initialised from ``seed`` (global RNG untouched)."""
    cfg = preset_config(preset, tie_embeddings=tie_embeddings,
                        attn_implementation=attn_implementation)
    if not isinstance(dtype, torch.dtype):
        raise UsageTypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    # HF initialisers draw from the global RNG: fork it so a build never perturbs the caller.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    return Policy(model=model, tokenizer=build_tokenizer(), name=preset,
                  meta={"preset": preset, "seed": seed, "tie_embeddings": bool(tie_embeddings)})
