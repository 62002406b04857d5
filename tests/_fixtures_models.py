"""Tiny causal LMs of several architectures for the output-head tests (built in milliseconds):
tied and untied heads, a head with a bias (GPT-J), logit soft-capping (Gemma2), a constant
logit scale (Cohere, Granite)."""

from __future__ import annotations

import torch
import transformers as tf

V = 37


def tiny_lm(kind: str = "llama", *, tied: bool = False, seed: int = 0,
            dtype: torch.dtype = torch.float64, hidden: int = 16) -> torch.nn.Module:
    """A 2-layer ``kind`` causal LM (llama, qwen2, gemma2, cohere, granite, gptj), random
    weights scaled so the logits span several units (peaked and flat positions both occur)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=0,
                  eos_token_id=1, pad_token_id=0)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(**common, head_dim=4, final_logit_softcapping=3.0,
                              attn_logit_softcapping=50.0, query_pre_attn_scalar=4,
                              sliding_window=8, attn_implementation="eager")
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "cohere":
        model = tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.37))
    elif kind == "granite":
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=2.5))
    elif kind == "gptj":
        cfg = tf.GPTJConfig(vocab_size=V, n_embd=hidden, n_layer=2, n_head=4, rotary_dim=4,
                            n_positions=64, tie_word_embeddings=tied, bos_token_id=0,
                            eos_token_id=1)
        model = tf.GPTJForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # larger logits than the default init: peaked positions occur
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
        if getattr(head, "bias", None) is not None:
            head.bias.normal_(0.0, 1.0)
    return model.to(dtype).eval()


KINDS = ["llama", "qwen2", "gemma2", "cohere", "granite", "gptj"]


def ids_and_mask(B: int = 3, L: int = 10, seed: int = 1, *,
                 left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token ids and an attention mask with left padding (row 1, unless ``left`` is
    False: Gemma2's eager attention gives NaN rows for it) and right padding (row 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    if left:
        am[1, :2] = 0
    am[2, -3:] = 0
    return ids, am
