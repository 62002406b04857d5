"""The enumerable toy policy behind check_estimator's bias test, against autograd."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from varbench.testing.toy import ToyPolicy, ToyTask


def _autograd_scores(pol: ToyPolicy, prompt, tokens, coeff):
    """Slow reference: sum_k coeff_k * d log pi(token_k) / d theta by autograd, token by token."""
    theta = pol.logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    V = pol.task.vocab
    total = 0.0
    for n in range(tokens.shape[0]):
        prev = V
        for t in range(tokens.shape[1]):
            y = int(tokens[n, t])
            if y < 0:
                break
            total = total + coeff[n, t] * logp[int(prompt[n]), t, prev, y]
            prev = y if y < V else prev
    (grad,) = torch.autograd.grad(total, theta)
    return grad.reshape(-1)


def test_enumeration_is_a_distribution():
    pol = ToyPolicy(ToyTask())
    tokens, mask = pol.enumerate()
    assert tokens.shape == (2**5 + 2**5 - 1, 5)  # strings of length < 5 ending in EOS, + 32
    P = pol.task.num_prompts
    prompt = torch.arange(P).unsqueeze(-1).expand(P, len(tokens))
    logp, spsq = pol.token_stats(prompt, tokens.expand(P, -1, -1), mask.expand(P, -1, -1))
    torch.testing.assert_close(logp.sum(-1).exp().sum(-1), torch.ones(P, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert bool(((spsq > 0) == mask).all())


def test_scatter_scores_equal_autograd_float64():
    pol = ToyPolicy(ToyTask(num_prompts=2, seed=3))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 2, (12,), generator=gen)
    tokens, mask = pol.sample(prompt, gen)
    coeff = torch.randn(tokens.shape, generator=gen, dtype=torch.float64) * mask
    fast = pol.scatter_scores(prompt.unsqueeze(0), tokens.unsqueeze(0), coeff.unsqueeze(0))[0]
    torch.testing.assert_close(fast, _autograd_scores(pol, prompt, tokens, coeff),
                               rtol=1e-12, atol=1e-13)


def test_exact_gradient_equals_autograd_of_expected_reward():
    pol = ToyPolicy(ToyTask(num_prompts=2, max_len=4, seed=1))
    tokens, mask = pol.enumerate()
    P, K = 2, len(tokens)
    prompt = torch.arange(P).repeat_interleave(K)
    tok = tokens.repeat(P, 1)
    msk = mask.repeat(P, 1)
    logp, _ = pol.token_stats(prompt, tok, msk)
    weight = (logp.sum(-1).exp() * pol.rewards(prompt, tok, msk) / P).unsqueeze(-1) * msk
    ref = _autograd_scores(pol, prompt, tok, weight)
    torch.testing.assert_close(pol.exact_gradient(), ref, rtol=1e-12, atol=1e-14)


def test_rewards_golden():
    pol = ToyPolicy(ToyTask(num_prompts=1, seed=0))
    tgt = pol.targets[0]
    V, T = pol.task.vocab, pol.task.max_len
    exact = torch.full((1, T), -1)
    exact[0, : len(tgt) + 1] = torch.tensor(tgt + [V])
    wrong_first = exact.clone()
    wrong_first[0, 0] = 1 - tgt[0]
    no_eos = torch.zeros(1, T, dtype=torch.long)  # T content tokens of 0
    r = pol.rewards(torch.zeros(3, dtype=torch.long), torch.cat([exact, wrong_first, no_eos]),
                    torch.cat([exact, wrong_first, no_eos]) >= 0)
    assert r[0] == 1.0
    assert r[1] == pytest.approx((len(tgt) - 1) / len(tgt))
    assert r[2] == pytest.approx(sum(1 for y in tgt if y == 0) / T)


def test_sampler_matches_exact_probabilities():
    """Chi-square goodness of fit of 20000 seeded draws (false-failure rate 1e-4 per seed)."""
    pol = ToyPolicy(ToyTask(num_prompts=1, max_len=3, seed=2))
    tokens, mask = pol.enumerate()
    logp, _ = pol.token_stats(torch.zeros(len(tokens), dtype=torch.long), tokens, mask)
    probs = logp.sum(-1).exp()
    gen = torch.Generator().manual_seed(5)
    draws, _ = pol.sample(torch.zeros(20000, dtype=torch.long), gen)
    match = (draws.unsqueeze(1) == tokens.unsqueeze(0)).all(-1)  # [N, K]
    assert bool((match.sum(1) == 1).all())
    counts = match.sum(0).double()
    p = stats.chisquare(counts.numpy(), (probs * 20000).numpy()).pvalue
    assert p > 1e-4
