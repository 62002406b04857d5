"""The architecture matrix: tiny random-weight configs of every architecture family varbench
supports, built in milliseconds (2 layers, hidden 16, vocabulary 23). A new architecture is ONE
line in :data:`ARCHS`: ``name: (model class, config class, config overrides)``."""

from __future__ import annotations

import warnings

import torch
import transformers as tf

V = 32  # covers the embedded char tokenizer (30 ids), so `sample` runs on every model
_LLAMA = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_HD = dict(_LLAMA, head_dim=4)

ARCHS: dict[str, tuple[type, type, dict]] = {
    "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config,
             dict(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=64)),
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, _LLAMA),
    "llama_tied": (tf.LlamaForCausalLM, tf.LlamaConfig, dict(_LLAMA, tie_word_embeddings=True)),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, _LLAMA),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, _HD),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, dict(_LLAMA, sliding_window=None)),
    "mistral_sliding": (tf.MistralForCausalLM, tf.MistralConfig, dict(_LLAMA, sliding_window=3)),
    "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig, _HD),
    "gemma_untied": (tf.GemmaForCausalLM, tf.GemmaConfig, dict(_HD, tie_word_embeddings=False)),
    "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config, dict(_HD, sliding_window=3)),
    "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, dict(_HD, sliding_window=3)),
    "gemma3_untied": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig,
                      dict(_HD, sliding_window=3, tie_word_embeddings=False)),
    "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config, dict(_LLAMA, pad_token_id=0)),
    "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig,
                 dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)),
    "opt": (tf.OPTForCausalLM, tf.OPTConfig,
            dict(vocab_size=V, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=16,
                 pad_token_id=1)),
    "olmo2": (tf.Olmo2ForCausalLM, tf.Olmo2Config, _LLAMA),
    "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig,
                dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2)),
}


def build(name: str, *, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    """Tiny random model of architecture ``name`` (float32, eval mode). Norm weights and
    biases are randomised too (their init is 0/1, which would hide a wrong ``(1 + w)``)."""
    model_cls, config_cls, overrides = ARCHS[name]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config_cls(**dict(dict(bos_token_id=1, eos_token_id=2), **overrides))
        cfg._attn_implementation = attn
        model = model_cls(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights and biases
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()
