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

from dataclasses import dataclass

import torch

from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs
from varbench.models.presets import Policy
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.sampler import encode_prompts
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
        mask = torch.ones(1, K, T)
        zeros = torch.zeros(1, K, T)
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
            lengths=torch.full((1, K), T),
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
    skipped, as the sampler does.
    """
    reward = task.check_reward(reward)
    model, tok = policy.model, policy.tokenizer
    V = int(model.get_output_embeddings().weight.shape[0])
    responses = task.enumerate_responses(prompt, V)  # [N, T]
    prompt_ids, _ = encode_prompts(tok, [prompt])  # [1, Lp] (one prompt: no padding)
    dev = policy.device
    Lp = prompt_ids.shape[1]
    out = []
    was_training = model.training
    model.eval()
    try:
        for s in range(0, responses.shape[0], chunk):
            r = responses[s : s + chunk]
            ids = torch.cat([prompt_ids.expand(r.shape[0], Lp), r], 1).to(dev)
            logits = forward_logits(model, ids, torch.ones_like(ids)).logits
            out.append(token_logprobs(logits, ids)[:, Lp:].double().sum(-1).cpu())
    finally:
        model.train(was_training)
    texts = tok.batch_decode(responses.tolist(), skip_special_tokens=True)
    rewards = torch.tensor([task.score(prompt, t, reward) for t in texts], dtype=torch.float64)
    return ExactDistribution(
        prompt=prompt,
        prompt_ids=prompt_ids,
        responses=responses,
        logp=torch.cat(out),
        rewards=rewards,
        reward_name=reward,
    )
