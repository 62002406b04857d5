"""Tests of varbench.analysis.oracle: exact enumeration of a fixed-length task's responses."""

from __future__ import annotations

import pytest
import torch

from varbench.analysis.oracle import enumerate_distribution
from varbench.models import build_policy, forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.sampler import sample
from varbench.tasks import get_task


@pytest.fixture(scope="module")
def micro64():
    return build_policy("micro", seed=3, dtype=torch.float64)


def _batch_logp(model, batch):
    flat = batch.flat()
    logits = forward_logits(model, flat.input_ids, flat.attention_mask).logits
    return batch.to_groups(token_logprobs(logits, flat.input_ids) * flat.response_mask)


def test_probabilities_sum_to_one_and_match_sampling(micro64):
    task = get_task("sort", n=2, max_value=2)
    prompt = task.prompts(1, seed=0)[0]
    dist = enumerate_distribution(micro64, task, prompt, reward="positional")
    assert dist.responses.shape == (30**2, 2)
    assert dist.total_prob == pytest.approx(1.0, abs=1e-12)
    # The sampler's empirical mean reward agrees with the exact J within 4 standard errors.
    batch = sample(micro64, task, [prompt], G=4000, seed=1, reward="positional")
    mc = float(batch.rewards.double().mean())
    se = (dist.reward_variance() / 4000) ** 0.5
    assert abs(mc - dist.mean_reward) < 4 * se
    # Exact probability of sampled responses equals the sampler's recorded log-probs.
    idx = (batch.tokens[0, :20].long() * 30 ** torch.tensor([1, 0])).sum(-1)
    torch.testing.assert_close(
        dist.logp[idx], batch.logprobs[0, :20].double().sum(-1), rtol=0, atol=1e-5
    )


def test_gradient_batch_gives_exact_policy_gradient(micro64):
    """sum_y pi R grad log pi (the oracle's coefficient set) == grad of J = sum_y pi(y) R(y)."""
    task = get_task("sort", n=2, max_value=1)
    prompt = task.prompts(1, seed=0)[0]
    dist = enumerate_distribution(micro64, task, prompt, reward="positional")
    model = micro64.model
    params = [p for p in model.parameters() if p.requires_grad]
    batch, coef = dist.gradient_batch()
    assert batch.tokens.shape[1] < dist.responses.shape[0]  # zero-reward responses dropped
    g_oracle = torch.autograd.grad((coef * _batch_logp(model, batch)).sum(), params)
    # Brute force: differentiate J itself over the full response space.
    full, _ = dist.gradient_batch(min_weight=-1.0)
    lp = _batch_logp(model, full).sum(-1)  # [1, N]
    J = (lp.exp() * full.rewards.double()).sum()
    g_true = torch.autograd.grad(J, params)
    assert float(J.detach()) == pytest.approx(dist.mean_reward, rel=1e-12)
    for a, b in zip(g_oracle, g_true, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_variable_length_task_refused(micro64):
    task = get_task("arith")
    with pytest.raises(ValueError, match="variable-length"):
        enumerate_distribution(micro64, task, task.prompts(1)[0])
