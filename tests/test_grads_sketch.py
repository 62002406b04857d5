"""Sketched norms (forward-mode probes), JL sketches, sequence and group gradients."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import V, batch, tiny_llama, trained_llama
from reference_grads import brute_sequence_grads, brute_token_grads
from scipy.stats import chi2

from varbench.grads import exact_float64, token_grad_norms
from varbench.grads.group import combine, group_gradients, token_sketches
from varbench.grads.sequence import Sketch, sequence_grads
from varbench.grads.sketch import sketched_token_norms
from varbench.rollout.batch import RolloutBatch

RTOL = 1e-8
ALPHA = 1e-6  # total false-failure rate of each statistical test (Bonferroni over entries)


def _chi2_band(k: int, n_tests: int) -> tuple[float, float]:
    """Two-sided band for chi2_k / k holding all n_tests entries with prob >= 1 - ALPHA."""
    a = ALPHA / n_tests
    return chi2.ppf(a / 2, k) / k, chi2.ppf(1 - a / 2, k) / k


def test_sketched_norms_are_unbiased():
    """Gaussian probes: k * estimate / exact ~ chi2_k exactly, for every token and prefix."""
    model = exact_float64(trained_llama())
    ids, rm, am = batch("left")
    ex = token_grad_norms(model, ids, rm, am, progress=False)
    k = 400
    est = sketched_token_norms(model, ids, rm, am, k=k, seed=123)
    on = rm == 1
    lo, hi = _chi2_band(k, 2 * int(on.sum()))
    for e, x in ((est.token_sq, ex.token_sq), (est.prefix_sq, ex.prefix_sq)):
        r = e[on] / x[on]
        assert torch.all((r > lo) & (r < hi)), (r.min(), r.max(), lo, hi)
    torch.testing.assert_close(est.diag_prefix_sq, est.token_sq.cumsum(-1) * rm)
    # reported std tracks the theoretical sqrt(2/k) relative std
    rel = (est.token_sq_std[on] / ex.token_sq[on]).mean()
    assert 0.7 * (2 / k) ** 0.5 < rel < 1.3 * (2 / k) ** 0.5
    again = sketched_token_norms(model, ids, rm, am, k=k, seed=123)
    assert torch.equal(again.probes, est.probes)  # one seed -> same numbers
    assert torch.all(est.token_sq[~on] == 0) and torch.all(est.prefix_sq[~on] == 0)


def test_sketch_preserves_norms_in_expectation():
    x = torch.randn(300, dtype=torch.float64)
    k, seeds = 8, 200
    tot = sum(Sketch(k, s).apply(x).pow(2).sum() for s in range(seeds))
    # sum over seeds of k ||Sx||^2 / ||x||^2 ~ chi2_{k * seeds}
    stat = float(tot * k / x.pow(2).sum())
    assert chi2.ppf(ALPHA / 2, k * seeds) < stat < chi2.ppf(1 - ALPHA / 2, k * seeds)
    torch.testing.assert_close(Sketch(k, 3).apply(x), Sketch(k, 3).apply(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="k=0"):
        Sketch(0)


def test_sequence_grads_match_brute_force_and_prefix():
    model = exact_float64(tiny_llama())
    ids, rm, am = batch("left")
    got = sequence_grads(model, ids, rm, am)
    ref = brute_sequence_grads(model, ids, rm, am)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-14)
    norms = token_grad_norms(model, ids, rm, am, progress=False)
    torch.testing.assert_close(got.pow(2).sum(-1), norms.sequence_sq, rtol=RTOL, atol=0)
    s = Sketch(5, seed=7)
    torch.testing.assert_close(
        sequence_grads(model, ids, rm, am, sketch=s), s.apply(ref), rtol=RTOL, atol=1e-13
    )


def _rollout(P=2, G=3, T=6, Lp=4, seed=0) -> RolloutBatch:
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


def test_group_gradients_match_brute_force():
    model = exact_float64(trained_llama())
    rb = _rollout()
    coeffs = torch.randn(
        rb.P, rb.G, rb.T, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    got = group_gradients(model, rb, coeffs)
    flat = rb.flat()
    g, _, _ = brute_token_grads(model, flat.input_ids, flat.response_mask, flat.attention_mask)
    c = torch.zeros(rb.P * rb.G, flat.input_ids.shape[1], dtype=torch.float64)
    c[:, flat.prompt_len :] = (coeffs * rb.mask).reshape(rb.P * rb.G, rb.T)
    ref = torch.einsum("blp,bl->bp", g, c).reshape(rb.P, rb.G, -1).sum(1)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-13)
    s = Sketch(6, seed=2)
    sk = group_gradients(model, rb, coeffs, sketch=s)
    torch.testing.assert_close(sk, s.apply(ref), rtol=RTOL, atol=1e-12)
    # cached per-token sketches, reused for several coefficient sets, give the same sketch
    tsk = token_sketches(model, rb, s)
    assert tsk.shape == (rb.P, rb.G, rb.T, 6)
    torch.testing.assert_close(combine(tsk, coeffs), sk, rtol=RTOL, atol=1e-12)
    many = torch.stack([coeffs, 2 * coeffs, coeffs.flip(-1)])
    out = combine(tsk, many)
    torch.testing.assert_close(out[1], 2 * sk, rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(
        out[2], group_gradients(model, rb, many[2], sketch=s), rtol=RTOL, atol=1e-12
    )


def test_group_gradients_bad_input():
    model = tiny_llama()
    rb = _rollout()
    with pytest.raises(ValueError, match="coeffs has shape"):
        group_gradients(model, rb, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="NaN"):
        group_gradients(model, rb, torch.full((2, 3, 6), float("nan")))
    with pytest.raises(TypeError, match="RolloutBatch"):
        group_gradients(model, {"tokens": 1}, torch.zeros(2, 3, 6))
