"""Slow references for varbench.rollout: a teacher-forced forward of whole sampled batches,
a sampler without KV cache (a full forward over the whole prefix at every step), and
per-sequence log-probs of responses with the padding removed."""

from __future__ import annotations

import torch

from varbench.models import Policy, forward_logits
from varbench.models.logits import sum_pi_sq
from varbench.rollout import RolloutBatch


def teacher_forced(policy: Policy, batch: RolloutBatch):
    """logp, sum_pi_sq, entropy of every response token from one full forward: [P, G, T]."""
    f = batch.flat()
    with torch.no_grad():
        z = forward_logits(policy.model, f.input_ids, f.attention_mask).logits
    z = z.to(batch.logprobs.dtype)[:, :-1]  # position t predicts t + 1
    logp_all = torch.log_softmax(z, -1)
    lp = logp_all.gather(-1, f.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    sp = sum_pi_sq(z)
    pad = lambda x: torch.cat([torch.zeros_like(x[:, :1]), x], 1) * f.response_mask  # noqa: E731
    return [batch.to_groups(pad(x)) for x in (lp, sp, ent)]


def reference_sample(policy, task, prompts, G, seed):
    """Slow reference: no KV cache, a full forward over the whole prefix at every step."""
    tok = policy.tokenizer
    gen = torch.Generator().manual_seed(seed)
    rows = [tok(p.text)["input_ids"] for p in prompts for _ in range(G)]
    Lp = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (Lp - len(r)) + r for r in rows])
    attn = torch.tensor([[0] * (Lp - len(r)) + [1] * len(r) for r in rows])
    out = []
    for _ in range(task.max_new_tokens):
        with torch.no_grad():
            z = forward_logits(policy.model, ids, attn).logits[:, -1].to(torch.float64)
        nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)
        out.append(nxt.squeeze(-1))
        ids = torch.cat([ids, nxt], 1)
        attn = torch.cat([attn, torch.ones_like(nxt)], 1)
    return torch.stack(out, -1).reshape(len(prompts), G, -1)


def per_sequence_response_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """``[P, G, T]`` log pi(y_t | prefix) one response at a time: the unattended columns (prompt
    padding, response padding) are dropped, the model runs on the real tokens alone (positions
    0..n-1) and each response token's log-prob is read off ``log_softmax`` of the logits before
    it; 0 where ``mask`` is 0 (environment tokens are context, not policy tokens)."""
    P, G, T = batch.tokens.shape
    Lp = batch.prompt_ids.shape[1]
    out = torch.zeros(P, G, T, dtype=torch.float64)
    for p in range(P):
        for i in range(G):
            ids = torch.cat([batch.prompt_ids[p], batch.tokens[p, i]])
            real = torch.cat([batch.prompt_mask[p], batch.mask[p, i] + batch.env_mask[p, i]]) > 0
            cols = torch.nonzero(real).squeeze(-1).tolist()
            z = model(input_ids=ids[cols].unsqueeze(0)).logits[0].double()
            for j, col in enumerate(cols):
                t = col - Lp
                if t >= 0 and batch.mask[p, i, t] != 0:
                    out[p, i, t] = torch.log_softmax(z[j - 1], -1)[ids[col]]
    return out
