"""Tiny Llama models and batches for the gradient-harness tests (built in milliseconds)."""

from __future__ import annotations

import copy
import functools

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs

V = 23


def tiny_llama(*, tied: bool = False, seed: int = 0, hidden: int = 16, attn: str = "sdpa"):
    """2-layer Llama, hidden 16, GQA (4 heads / 2 kv heads), float32, random weights."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg)
    if not tied:  # post_init ties nothing here; make sure head and embedding differ
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def batch(padding: str = "right", *, B: int = 3, L: int = 12, seed: int = 1, env_gap: bool = True):
    """(input_ids, response_mask, attention_mask) ``[B, L]`` with a prompt of 4 columns.

    ``padding='left'`` left-pads the prompts (row b has b pad columns); responses are
    right-padded (row b ends b columns early) and, with ``env_gap``, have an environment token
    (attended, not in the loss) inside the response.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    rm = torch.zeros(B, L)
    Lp = 4
    rm[:, Lp:] = 1
    for b in range(B):
        if padding == "left" and b > 0:
            am[b, : min(b, Lp - 1)] = 0
        end = L - b
        am[b, end:] = 0
        rm[b, end:] = 0
        if env_gap and end - Lp > 3:
            rm[b, Lp + 2] = 0
    ids = ids * am  # pad id 0
    return ids, rm, am


def trained_llama(*, tied: bool = False, steps: int = 60, seed: int = 0):
    """tiny_llama briefly trained on a fixed pattern so its predictions are peaked (a fresh
    copy of a cached model, so tests may modify it)."""
    return copy.deepcopy(_trained(tied, steps, seed))


@functools.lru_cache(maxsize=8)
def _trained(tied: bool, steps: int, seed: int):
    model = tiny_llama(tied=tied, seed=seed)
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(12) % 5 + 1
    data = torch.stack([torch.roll(base, int(s)) for s in torch.randint(0, 5, (16,), generator=g)])
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(steps):
        lp = token_logprobs(forward_logits(model, data).logits, data)
        loss = -lp[:, 1:].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def rollout_batch(P: int = 2, G: int = 3, T: int = 6, Lp: int = 4, seed: int = 0):
    """A small RolloutBatch ``[P, G, T]``: a left-padded prompt, a shorter response and an
    environment token (attended, not in the loss) inside a response."""
    from varbench.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, V, (P, Lp), generator=g)
    pmask = torch.ones(P, Lp, dtype=torch.long)
    pmask[1, :2] = 0
    prompt = prompt * pmask
    tokens = torch.randint(1, V, (P, G, T), generator=g)
    mask = torch.ones(P, G, T)
    env = torch.zeros(P, G, T)
    mask[0, 1, 4:] = 0  # shorter response
    tokens[0, 1, 4:] = 0
    mask[1, 2, 2] = 0  # an environment token
    env[1, 2, 2] = 1
    z = torch.zeros(P, G, T)
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=pmask,
        tokens=tokens,
        mask=mask,
        env_mask=env,
        logprobs=z,
        sum_pi_sq=z,
        entropy=z,
        rewards=torch.zeros(P, G),
        lengths=mask.sum(-1).long(),
    )
