"""A tabular autoregressive policy whose whole response space can be enumerated.

The bias test of ``check_estimator`` needs the exact policy gradient ``g*``. Here the policy is a
table of logits ``theta[p, t, prev, v]`` (prompt p, position t, previous token ``prev`` with BOS
as its own context, next token v); responses are strings over ``vocab`` content tokens ended by
an EOS token (which is a policy action and counts in the mask) or cut at ``max_len`` tokens.
With ``vocab=2, max_len=5`` a prompt has 63 possible responses, so ``g*`` is a finite sum.

Why tabular: the score of one token is exact and sparse. ``d log softmax(theta_row)_y /
d theta_row = e_y - pi_row`` on the single row that produced the token and zero elsewhere, so a
group's gradient estimate is a scatter-add, with no autograd in the hot loop (tests check it
against autograd). The per-token squared score norm ``1 - 2 pi(y) + sum_v pi(v)^2`` is the
Logit-Gradient Proxy, and here it is exact (no layers below the logits).

Shapes: tokens / mask / logprobs / sum_pi_sq ``[..., T]`` with ``T = max_len``; parameters are
flattened to ``D = P * T * (vocab + 1) * (vocab + 1)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from varbench._util.checks import check_positive_int


@dataclass(frozen=True)
class ToyTask:
    """Configuration of the enumerable task (every field is part of the check's identity).

    num_prompts: prompts P; each has its own logit table and target string.
    vocab: content tokens 0..vocab-1; EOS has id ``vocab``.
    max_len: T, the most tokens a response may have (EOS included when present).
    logit_scale: std of the random initial logits (larger -> peakier policy).
    target_bonus: logit added to the target's next token, so success is neither rare nor sure.
    seed: seeds the logits and the targets.
    """

    num_prompts: int = 3
    vocab: int = 2
    max_len: int = 5
    logit_scale: float = 1.0
    target_bonus: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("num_prompts", self.num_prompts)
        check_positive_int("vocab", self.vocab)
        check_positive_int("max_len", self.max_len, minimum=2)


class ToyPolicy:
    """The policy and reward of a ToyTask, with exact enumeration and seeded group sampling."""

    def __init__(self, task: ToyTask, dtype: torch.dtype = torch.float64) -> None:
        self.task = task
        P, T, V = task.num_prompts, task.max_len, task.vocab
        self.eos = V
        self.n_ctx = V + 1  # previous content token, or BOS (id V)
        self.n_act = V + 1  # content tokens and EOS
        gen = torch.Generator().manual_seed(task.seed)
        logits = task.logit_scale * torch.randn(P, T, self.n_ctx, self.n_act, generator=gen)
        # Targets: content strings of length 1..T-1 (so EOS fits), one per prompt.
        self.targets: list[list[int]] = []
        for p in range(P):
            n = 1 + int(torch.randint(0, T - 1, (1,), generator=gen))
            tgt = torch.randint(0, V, (n,), generator=gen).tolist()
            self.targets.append(tgt)
            seq = tgt + [self.eos]
            prev = V
            for t, y in enumerate(seq):
                logits[p, t, prev, y] += task.target_bonus
                prev = y if y < V else prev
        self.logits = logits.to(dtype)  # [P, T, ctx, act]
        self.probs = torch.softmax(self.logits, dim=-1)

    @property
    def dim(self) -> int:
        """D: number of policy parameters (the length of a flat gradient)."""
        return self.logits.numel()

    def rows(self, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Flat row index (p, t, prev) that produced each token: [..., T] long."""
        T = self.task.max_len
        prev = torch.full_like(tokens, self.task.vocab)  # BOS context at t = 0
        prev[..., 1:] = tokens[..., :-1].clamp(min=0, max=self.task.vocab)  # pads: any row
        t = torch.arange(T).expand_as(tokens)
        return (prompt.unsqueeze(-1) * T + t) * self.n_ctx + prev

    def token_stats(
        self, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled-token log-probs and sum_v pi(v)^2 per position, both [..., T], 0 off the mask."""
        probs = self.probs.reshape(-1, self.n_act)[self.rows(prompt, tokens)]  # [..., T, act]
        tok = tokens.clamp(min=0).unsqueeze(-1)
        logp = probs.gather(-1, tok).squeeze(-1).log()
        spsq = (probs**2).sum(-1)
        m = mask.to(logp.dtype)
        return logp * m, spsq * m

    def rewards(self, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor):
        """Positional credit: matches with the target over max(len(content), len(target)).

        Deterministic, in [0, 1], exactly 1 only for the target followed by EOS. Shapes:
        prompt [...], tokens/mask [..., T] -> [...].
        """
        T, V = self.task.max_len, self.task.vocab
        tgt = torch.full((self.task.num_prompts, T), -1, dtype=torch.long)
        tlen = torch.zeros(self.task.num_prompts, dtype=torch.long)
        for p, s in enumerate(self.targets):
            tgt[p, : len(s)] = torch.tensor(s)
            tlen[p] = len(s)
        content = (tokens < V) & mask.bool()
        clen = content.sum(-1)
        hits = (content & (tokens == tgt[prompt])).sum(-1)
        return hits.to(self.logits.dtype) / torch.maximum(clen, tlen[prompt]).clamp(min=1)

    def sample(self, prompt: torch.Tensor, generator: torch.Generator):
        """Sample one response per entry of ``prompt`` [...]: tokens [..., T] (-1 pad), mask."""
        shape = prompt.shape
        p = prompt.reshape(-1)
        N, T, V = p.numel(), self.task.max_len, self.task.vocab
        tokens = torch.full((N, T), -1, dtype=torch.long)
        alive = torch.ones(N, dtype=torch.bool)
        prev = torch.full((N,), V, dtype=torch.long)
        for t in range(T):
            probs = self.probs[p, t, prev]  # [N, act]
            # Inverse-CDF draw: one uniform per row (much faster than multinomial on many rows).
            u = torch.rand(N, 1, generator=generator, dtype=probs.dtype)
            y = (probs.cumsum(-1) < u).sum(-1).clamp(max=self.n_act - 1)
            tokens[:, t] = torch.where(alive, y, torch.full_like(y, -1))
            alive = alive & (y != self.eos)
            prev = torch.where(y < V, y, prev)
        mask = tokens >= 0
        return tokens.reshape(*shape, T), mask.reshape(*shape, T)

    def enumerate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every possible response: tokens [K, T] (-1 pad) and mask [K, T]."""
        T, V = self.task.max_len, self.task.vocab
        seqs: list[list[int]] = []
        for n in range(T):
            seqs += [list(c) + [self.eos] for c in itertools.product(range(V), repeat=n)]
        seqs += [list(c) for c in itertools.product(range(V), repeat=T)]
        tokens = torch.full((len(seqs), T), -1, dtype=torch.long)
        for k, s in enumerate(seqs):
            tokens[k, : len(s)] = torch.tensor(s)
        return tokens, tokens >= 0

    def scatter_scores(
        self, prompt: torch.Tensor, tokens: torch.Tensor, coeff: torch.Tensor
    ) -> torch.Tensor:
        """sum over the trailing [n, T] axes of coeff * grad log pi(token): [M, D].

        ``prompt`` [M, n], ``tokens`` [M, n, T], ``coeff`` [M, n, T] (must be 0 where there is no
        token). Uses grad_{theta_row} log softmax(theta_row)_y = e_y - pi_row.
        """
        M = tokens.shape[0]
        rows = self.rows(prompt, tokens).reshape(M, -1)
        tok = tokens.clamp(min=0).reshape(M, -1)
        c = coeff.reshape(M, -1).to(self.logits.dtype)
        n_rows = self.dim // self.n_act
        onehot = torch.zeros(M, n_rows * self.n_act, dtype=c.dtype)
        onehot.scatter_add_(1, rows * self.n_act + tok, c)
        rowsum = torch.zeros(M, n_rows, dtype=c.dtype).scatter_add_(1, rows, c)
        pi = self.probs.reshape(n_rows, self.n_act)
        return onehot - (rowsum.unsqueeze(-1) * pi).reshape(M, -1)

    def exact_gradient(self) -> torch.Tensor:
        """g* = (1/P) sum_p sum_y pi(y|p) R(y) grad log pi(y|p), by enumeration: [D]."""
        tokens, mask = self.enumerate()
        K, P = tokens.shape[0], self.task.num_prompts
        prompt = torch.arange(P).unsqueeze(-1).expand(P, K)
        tok = tokens.unsqueeze(0).expand(P, K, -1)
        msk = mask.unsqueeze(0).expand(P, K, -1)
        logp, _ = self.token_stats(prompt, tok, msk)
        weight = logp.sum(-1).exp() * self.rewards(prompt, tok, msk)  # pi(y) R(y): [P, K]
        coeff = weight.unsqueeze(-1) * msk
        return self.scatter_scores(prompt.reshape(1, -1), tok.reshape(1, P * K, -1),
                                   coeff.reshape(1, P * K, -1))[0] / P
