"""Checkpoints and data files as a user brings them, built locally in milliseconds: a
Llama-3-Instruct-style checkpoint whose turns end in ``<|eot_id|>`` while the tokenizer's eos is
``<|end_of_text|>`` (generation_config lists both), and a checkpoint with no eos at all."""

from __future__ import annotations

from pathlib import Path

import torch

CHARS = "0123456789 +=?.abcdefghijklmnopqrstuvwxyz\n"
EOT, EOS, BOS, PAD = "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>", "<|pad|>"


def char_tokenizer(*, eos: str | None = EOS):
    """A char-level fast tokenizer with Llama-3-like special tokens (``<|eot_id|>`` is one
    token); ``eos=None``: a tokenizer with no eos token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, EOT, "<unk>"]
    vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    kw = {"eos_token": eos} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token="<unk>",
                                   padding_side="left", **kw)


def eot_checkpoint(path: Path, *, p_eot: float = 0.25, gen_eos: list[str] | None = (EOT, EOS),
                   tok_eos: str | None = EOS, seed: int = 0) -> Path:
    """A 2-layer Llama checkpoint directory whose every next-token distribution puts
    ``p_eot`` on ``<|eot_id|>`` and spreads the rest evenly over the other tokens.

    The residual stream is the token embedding alone (attention and MLP outputs zeroed) and
    every embedding is ``c * e_0``, so the final norm's output is the same vector for every
    position; the head reads dimension 0 into the ``<|eot_id|>`` logit only. ``gen_eos``: the
    tokens of ``generation_config.eos_token_id`` (None: no generation config entry).
    """
    import math

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer(eos=tok_eos)
    V = len(tok)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, bos_token_id=None,
                      eos_token_id=None if tok_eos is None else tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    H = cfg.hidden_size
    eot = tok.convert_tokens_to_ids(EOT)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, 0] = 1.0
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        # normed hidden = sqrt(H) e_0; logit(eot) = L, others 0: p_eot = e^L / (e^L + V - 1)
        L = math.log(p_eot * (V - 1) / (1 - p_eot))
        head[eot, 0] = L / math.sqrt(H)
    model.generation_config = GenerationConfig(
        eos_token_id=None if gen_eos is None else [tok.convert_tokens_to_ids(t)
                                                   for t in gen_eos],
        pad_token_id=tok.pad_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def word_jsonl(path: Path, n: int = 12) -> Path:
    """A JSONL of ``n`` tiny word problems (answers plain integers)."""
    import json

    rows = [{"question": f"what is {a} + {b}?", "answer": str(a + b)}
            for a in range(n) for b in range(1)][:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
