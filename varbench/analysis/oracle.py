"""Exact-enumeration oracle: the whole response distribution of a fixed-length task.

For a fixed-length task (``sort`` with few numbers) every response ``y`` in ``V**T`` is listed
(``task.enumerate_responses``), scored, and weighted by its exact probability
``pi(y) = prod_t pi(y_t | prompt, y_<t)`` from one teacher-forced forward per chunk. Then

    J   = sum_y pi(y) R(y)                       (exact expected reward)
    g*  = sum_y pi(y) R(y) grad log pi(y)        (exact policy gradient, docs/science.md section 2)

``g*`` is returned as a *coefficient set* on a RolloutBatch of the responses with
``pi(y) R(y) != 0`` (coefficient ``pi(y) R(y)`` on each of their tokens), so the caller computes
it with the very gradient path (flat or sketched) used for the sampled estimates: reference and
estimates then live in the same space by construction.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from varbench.grads.vectors import token_vectors
from varbench.models.forward import forward_logits
from varbench.models.logits import sum_pi_sq, token_logprobs
from varbench.models.presets import Policy
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.sampler import encode_prompts
from varbench.stats.intervals import QuadForm
from varbench.tasks.base import Prompt, Task


@dataclass
class ExactDistribution:
    """Every response of one prompt with its exact log-probability and reward.

    ``responses`` [N, T] (N = V**T), ``logp`` [N] (float64 sum of token log-probs),
    ``rewards`` [N]; ``prompt_ids`` [1, Lp] as the sampler encodes the prompt.
    """

    prompt: Prompt
    prompt_ids: torch.Tensor
    responses: torch.Tensor
    logp: torch.Tensor
    rewards: torch.Tensor
    reward_name: str
    token_logp: torch.Tensor | None = None  # [N, T] log pi(y_t | prompt, y_<t)
    token_sum_pi_sq: torch.Tensor | None = None  # [N, T] sum_v pi(v | prompt, y_<t)^2

    @property
    def probs(self) -> torch.Tensor:
        """[N] exact pi(y)."""
        return self.logp.exp()

    @property
    def total_prob(self) -> float:
        """sum_y pi(y): 1 up to rounding (a check that the enumeration is complete)."""
        return float(self.probs.sum())

    @property
    def mean_reward(self) -> float:
        """J = sum_y pi(y) R(y)."""
        return float((self.probs * self.rewards).sum())

    def reward_variance(self) -> float:
        """Var_pi[R] = E[R^2] - J^2."""
        p = self.probs
        return float((p * self.rewards**2).sum() - (p * self.rewards).sum() ** 2)

    def gradient_batch(self, *, min_weight: float = 0.0) -> tuple[RolloutBatch, torch.Tensor]:
        """``(batch [1, K, T], coef [1, K, T])`` with ``sum coef * grad logp == g*``.

        Only responses with ``|pi(y) R(y)| > min_weight`` are kept (the rest contribute
        exactly 0 to g* when ``min_weight == 0``). Each kept token carries ``pi(y) R(y)``.
        """
        w = self.probs * self.rewards
        keep = w.abs() > min_weight
        resp = self.responses[keep]
        K, T = resp.shape
        dev = resp.device
        mask = torch.ones(1, K, T, device=dev)
        zeros = torch.zeros(1, K, T, device=dev)
        batch = RolloutBatch(
            prompt_ids=self.prompt_ids,
            prompt_mask=torch.ones_like(self.prompt_ids),
            tokens=resp.unsqueeze(0),
            mask=mask,
            env_mask=zeros,
            logprobs=zeros,
            sum_pi_sq=zeros,
            entropy=zeros,
            rewards=self.rewards[keep].unsqueeze(0).float(),
            lengths=torch.full((1, K), T, device=dev),
            meta={"oracle": True},
        )
        coef = w[keep].to(torch.float64)[None, :, None].expand(1, K, T).clone()
        return batch, coef


@torch.no_grad()
def enumerate_distribution(
    policy: Policy,
    task: Task,
    prompt: Prompt,
    *,
    reward: str | None = None,
    chunk: int = 4096,
) -> ExactDistribution:
    """List every response to ``prompt`` with its exact probability and reward.

    Needs a fixed-length task whose space ``V**T`` is small (the task refuses above 2 million).
    Cost: V**T / chunk forward passes of length Lp + T. Scores decode with special tokens
    skipped, as the sampler does. Every tensor of the result lives on the policy's device.
    """
    reward = task.check_reward(reward)
    model, tok = policy.model, policy.tokenizer
    V = int(model.get_output_embeddings().weight.shape[0])
    with torch.device("cpu"):  # host side by design: the responses are decoded and scored
        responses = task.enumerate_responses(prompt, V)  # [N, T]
        prompt_ids, _ = encode_prompts(tok, [prompt])  # [1, Lp] (one prompt: no padding)
    texts = tok.batch_decode(responses.tolist(), skip_special_tokens=True)
    dev = policy.device
    responses, prompt_ids = responses.to(dev), prompt_ids.to(dev)
    Lp = prompt_ids.shape[1]
    out, spsq = [], []
    was_training = model.training
    model.eval()
    try:
        for s in range(0, responses.shape[0], chunk):
            r = responses[s : s + chunk]
            ids = torch.cat([prompt_ids.expand(r.shape[0], Lp), r], 1).to(dev)
            logits = forward_logits(model, ids, torch.ones_like(ids)).logits
            out.append(token_logprobs(logits, ids)[:, Lp:].double())
            # the distribution that picks response token t sits at column Lp + t - 1
            spsq.append(sum_pi_sq(logits[:, Lp - 1 : -1]).double())
    finally:
        model.train(was_training)
    rewards = torch.tensor([task.score(prompt, t, reward) for t in texts], dtype=torch.float64,
                           device=dev)
    return ExactDistribution(
        prompt=prompt,
        prompt_ids=prompt_ids,
        responses=responses,
        logp=torch.cat(out).sum(-1),
        rewards=rewards,
        reward_name=reward,
        token_logp=torch.cat(out),
        token_sum_pi_sq=torch.cat(spsq),
    )


@dataclass
class ResponseTable:
    """Every response of an :class:`ExactDistribution` with its per-token gradient vectors.

    ``probs``, ``rewards`` [N] float64; ``mask``, ``logprobs``, ``sum_pi_sq``, ``token_sq``
    [N, T]; ``vec`` [N, T, K] (sketched, or flat with K = D). A group of G i.i.d. draws is G
    rows drawn with probabilities ``probs``: sampling from the table is sampling from the
    policy, without a forward or backward per group.
    """

    probs: torch.Tensor
    rewards: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    sum_pi_sq: torch.Tensor
    token_sq: torch.Tensor
    vec: torch.Tensor
    sketch: str
    n_params: int

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def sketch_k(self) -> int | None:
        """The count sketch's bucket count K, None for flat vectors (K = D, no sketch error)."""
        return None if self.sketch == "flat" else int(self.vec.shape[-1])

    def reference(self) -> torch.Tensor:
        """g* = sum_y pi(y) R(y) grad log pi(y) [K] in the table's vector space (float64)."""
        w = (self.probs * self.rewards)[:, None, None] * self.mask[..., None].double()
        return (w * self.vec.double()).sum((0, 1))

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``n`` i.i.d. responses as ``[1, n, ...]`` tensors (``vec``, ``token_sq``, ``mask``,
        ``logprobs``, ``sum_pi_sq``, ``rewards``), drawn with ``generator`` (CPU: the draws
        do not depend on the table's device; the indices then move there, the rows stay)."""
        idx = torch.multinomial(self.probs.to(generator.device), n, replacement=True,
                                generator=generator).to(self.probs.device)
        return {k: getattr(self, k)[idx].unsqueeze(0)
                for k in ("vec", "token_sq", "mask", "logprobs", "sum_pi_sq", "rewards")}


def response_table(policy: Policy, dist: ExactDistribution, *, sketch_dim: int | None = None,
                   sketch_seed: int = 0, progress: bool = False) -> ResponseTable:
    """Per-token gradient vectors of every response of ``dist`` (one exact-harness pass).

    Cost: one per-token backward per token of the N * T table; use it where N * T is small
    (``sort`` with n = 1 or 2 on a small preset), where it makes every group statistic exact
    (:func:`exact_moments`) and Monte Carlo replicates free.
    """
    N, T = dist.responses.shape
    dev = dist.responses.device
    zeros = torch.zeros(1, N, T, device=dev)
    batch = RolloutBatch(
        prompt_ids=dist.prompt_ids, prompt_mask=torch.ones_like(dist.prompt_ids),
        tokens=dist.responses.unsqueeze(0), mask=torch.ones(1, N, T, device=dev),
        env_mask=zeros, logprobs=zeros, sum_pi_sq=zeros, entropy=zeros,
        rewards=dist.rewards[None].float(), lengths=torch.full((1, N), T, device=dev),
        meta={"oracle": True},
    )
    tv = token_vectors(policy.model, batch, sketch_dim=sketch_dim, sketch_seed=sketch_seed,
                       progress=progress)
    assert dist.token_logp is not None and dist.token_sum_pi_sq is not None
    return ResponseTable(
        probs=dist.probs / dist.probs.sum(), rewards=dist.rewards.double(),
        mask=torch.ones(N, T, device=dev), logprobs=dist.token_logp.float(),
        sum_pi_sq=dist.token_sum_pi_sq.float(), token_sq=tv.token_sq[0].double(),
        vec=tv.vec[0], sketch=tv.sketch, n_params=tv.n_params,
    )


def _compositions(G: int, c: int, device: torch.device | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``[c]`` vector of non-negative integers summing to G: ``[C(G+c-1, c-1), c]``, and
    the class of each of the G members of each (``[C(G+c-1, c-1), G]``, sorted by class);
    enumerated on the host, made once on ``device``."""
    rows = [list(x) for x in itertools.combinations(range(G + c - 1), c - 1)]
    out, members = [], []
    for bars in rows:
        edges = [-1, *bars, G + c - 1]
        counts = [edges[k + 1] - edges[k] - 1 for k in range(c)]
        out.append(counts)
        members.append([k for k in range(c) for _ in range(counts[k])])
    return (torch.tensor(out, dtype=torch.long, device=device),
            torch.tensor(members, dtype=torch.long, device=device))


def exact_moments(
    table: ResponseTable,
    coef_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    G: int,
    reference: torch.Tensor,
    *,
    max_configs: int = 200_000,
) -> dict[str, float] | None:
    """Exact statistics of ``g_hat = sum_{i,t} c_{i,t} v(y_i)_t`` over groups of G i.i.d. draws.

    ``coef_fn(rewards [C, G], mask [C, G, T]) -> c [C, G, T]`` gives the ascent coefficients
    of a group from its rewards alone (a scheme that reads only rewards, at ratio 1). The
    estimate is then linear in the responses given the rewards, so with reward classes k
    (distinct values), class probabilities q_k, class means mu_k = E[s | k] and second moments
    m2_k = E[||s||^2 | k] of s = sum_t v_t, and b_i the coefficient of member i::

        E[g_hat | n]      = sum_k beta_k mu_k,                  beta_k = sum_{i in k} b_i
        E[||g_hat||^2 | n] = ||E[g_hat | n]||^2 + sum_k gamma_k (m2_k - ||mu_k||^2),
                                                                 gamma_k = sum_{i in k} b_i^2

    summed over the reward configurations n (multinomial counts). Returns None when the
    coefficients vary over a response's tokens (not of this form) or when there are more than
    ``max_configs`` configurations. Keys: variance, mse, projection, bias2, signal_norm2,
    frac_all_agree, frac_zero, mean_coef_norm (all float), and ``mean``: E[g_hat] [K] (host
    float64; the sketch error of an exact-sketched projection is about it). ``forms``:
    ``{variance, mse}`` :class:`~varbench.stats.intervals.QuadForm` of Cov(g_hat) and
    E[(g_hat - g*)(g_hat - g*)^T] on ``rows``: ``[N + 1, K]`` host float64, each response's
    ``s = sum_t v_t`` and the reference (``[s_1 .. s_N, g*]``): with ``mu = L s``
    (``L_kj = [k_j = k] p_j / q_k``),
    ``Cov = sum_j p_j Gamma_{k_j} / q_{k_j} s_j s_j^T + mu^T (B - diag Gamma - b b^T) mu``,
    ``b = E beta``, ``B = E beta beta^T``, ``Gamma = E gamma`` (an exact-sketched cell's sketch
    SD is read from them, :func:`~varbench.stats.intervals.exact_sketch_sd`).
    """
    R, p = table.rewards, table.probs
    dev = R.device
    levels = torch.unique(R)
    c = int(levels.numel())
    if math.comb(G + c - 1, c - 1) > max_configs:
        return None
    cls = torch.searchsorted(levels, R)
    q = torch.zeros(c, dtype=torch.float64, device=dev).index_add_(0, cls, p)
    s = (table.vec.double() * table.mask[..., None].double()).sum(1)  # [N, K]
    mu = torch.zeros(c, s.shape[1], dtype=torch.float64, device=dev).index_add_(
        0, cls, p[:, None] * s)
    mu = mu / q.clamp(min=1e-300)[:, None]
    m2 = torch.zeros(c, dtype=torch.float64, device=dev).index_add_(0, cls, p * (s * s).sum(1))
    m2 = m2 / q.clamp(min=1e-300)
    comp, onehot = _compositions(G, c, dev)  # [C, c]; [C, G] member classes sorted by class
    # rows of rewards: each configuration's members sorted by class
    rewards = levels[onehot]  # [C, G]
    T = table.mask.shape[1]
    mask = torch.ones(comp.shape[0], G, T, device=dev)
    coef = coef_fn(rewards, mask).double()  # [C, G, T]
    if not torch.equal(coef, coef[..., :1].expand_as(coef)):
        return None
    b = coef[..., 0]  # [C, G]
    zeros = torch.zeros(comp.shape[0], c, dtype=torch.float64, device=dev)
    beta = zeros.clone().scatter_add_(1, onehot, b)
    gamma = zeros.scatter_add_(1, onehot, b * b)
    logq = torch.where(q > 0, q.log(), torch.full_like(q, -math.inf))
    logP = (math.lgamma(G + 1) - torch.lgamma(comp.double() + 1).sum(1)
            + torch.where(comp > 0, comp.double() * logq, 0).sum(1))
    P = logP.exp()  # [C]
    gram = mu @ mu.T  # [c, c]
    mean = (P @ beta) @ mu  # E[g_hat] [K]
    second = (P * (torch.einsum("nk,kl,nl->n", beta, gram, beta)
                   + gamma @ (m2 - gram.diagonal()))).sum()
    ref = reference.to(dev).double().reshape(-1)
    gg_t = ref @ ref
    # the quadratic forms on the rows [s_1 .. s_N, g*] (host float64: the SD is host code)
    Pb = P @ beta
    Bm = (beta * P[:, None]).T @ beta
    Gam = P @ gamma
    N = s.shape[0]
    L = torch.zeros(N + 1, c, dtype=torch.float64, device=dev)
    L[torch.arange(N, device=dev), cls] = p.double() / q[cls].clamp(min=1e-300)
    w = torch.cat([p.double() * Gam[cls] / q[cls].clamp(min=1e-300),
                   torch.zeros(1, dtype=torch.float64, device=dev)])
    Cv = Bm - torch.diag(Gam) - torch.outer(Pb, Pb)
    d = L @ Pb  # E g_hat - g* = sum_j d_j s_j - g*
    d[N] = -1.0
    Cm = torch.zeros(c + 1, c + 1, dtype=torch.float64, device=dev)
    Cm[:c, :c], Cm[c, c] = Cv, 1.0
    forms = {"variance": QuadForm(w.cpu(), L.cpu(), Cv.cpu()),
             "mse": QuadForm(w.cpu(), torch.cat([L, d[:, None]], 1).cpu(), Cm.cpu())}
    # one host read of every statistic (same float64 arithmetic as one read each)
    gg, var, mse, proj, bias2, sig, agree, zero = torch.stack([
        gg_t, second - mean @ mean, second - 2 * (mean @ ref) + gg_t, mean @ ref,
        ((mean - ref) ** 2).sum(), mean @ mean, (q**G).sum(), P[(b == 0).all(1)].sum(),
    ]).tolist()
    return {
        "variance": var,
        "mse": mse,
        "projection": proj / gg if gg > 0 else float("nan"),
        "bias2": bias2,
        "signal_norm2": sig,
        "frac_all_agree": agree,
        "frac_zero": zero,
        "mean": mean.cpu(),
        "forms": forms,
        "rows": torch.cat([s, ref.reshape(1, -1)]).cpu(),
    }

