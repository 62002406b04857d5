"""Sketched norms (forward-mode Gaussian probes); count-sketched sequence and group gradients."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, rollout_batch, tiny_llama, trained_llama
from reference_grads import (
    brute_group_gradients,
    brute_sequence_grads,
    brute_token_grads,
    dense_count_sketch,
)
from scipy.stats import chi2

from varbench.grads import CountSketch, exact_float64, token_grad_norms
from varbench.grads.group import combine, group_gradients, token_sketches
from varbench.grads.sequence import sequence_grads
from varbench.grads.sketch import GaussianProbes, sketched_token_norms

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


def test_gaussian_probes_are_seeded_and_not_a_sketch():
    """The Gaussian survives only as forward-mode probe directions (sketched_token_norms needs
    iid probes); it is not accepted where a sketch of gradient vectors is."""
    p = GaussianProbes(8, 3)
    assert not hasattr(p, "apply")
    a, b = p.direction(2, 50, torch.float64, "cpu"), p.direction(2, 50, torch.float64, "cpu")
    assert torch.equal(a, b) and not torch.equal(a, p.direction(3, 50, torch.float64, "cpu"))
    with pytest.raises(ValueError, match="k=0"):
        GaussianProbes(0)
    model = tiny_llama()
    ids, rm, am = batch()
    with pytest.raises(TypeError, match="CountSketch"):
        sequence_grads(model, ids, rm, am, sketch=p)
    with pytest.raises(TypeError, match="CountSketch"):
        group_gradients(model, rollout_batch(), torch.zeros(2, 3, 6), sketch=p)
    with pytest.raises(TypeError, match="CountSketch"):
        token_sketches(model, rollout_batch(), p)


def test_sequence_grads_match_brute_force_and_prefix():
    model = exact_float64(tiny_llama())
    ids, rm, am = batch("left")
    got = sequence_grads(model, ids, rm, am)
    ref = brute_sequence_grads(model, ids, rm, am)
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=1e-14)
    norms = token_grad_norms(model, ids, rm, am, progress=False)
    torch.testing.assert_close(got.pow(2).sum(-1), norms.sequence_sq, rtol=RTOL, atol=0)
    s = CountSketch.for_model(model, 5, seed=7)
    got_s = sequence_grads(model, ids, rm, am, sketch=s)
    torch.testing.assert_close(got_s, ref @ dense_count_sketch(s).T, rtol=RTOL, atol=1e-13)
    torch.testing.assert_close(got_s, s.apply(ref), rtol=RTOL, atol=1e-13)
    # a sketch of other parameters is refused, not silently misapplied
    with pytest.raises(ValueError, match="built for"):
        sequence_grads(model, ids, rm, am, sketch=CountSketch.for_model(model, 5, params="mlp"))


def test_group_gradients_match_brute_force():
    model = exact_float64(trained_llama())
    rb = rollout_batch()
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
    # and a second brute force: one backward per sequence
    torch.testing.assert_close(got, brute_group_gradients(model, rb, coeffs), rtol=RTOL,
                               atol=1e-13)
    s = CountSketch.for_model(model, 6, seed=2)
    S = dense_count_sketch(s)
    sk = group_gradients(model, rb, coeffs, sketch=s)
    torch.testing.assert_close(sk, ref @ S.T, rtol=RTOL, atol=1e-12)
    # per-token sketches (token_vectors), reused for several coefficient sets, give the same
    tsk = token_sketches(model, rb, s)
    assert tsk.shape == (rb.P, rb.G, rb.T, 6)
    torch.testing.assert_close(combine(tsk, coeffs), sk, rtol=RTOL, atol=1e-12)
    many = torch.stack([coeffs, 2 * coeffs, coeffs.flip(-1)])
    out = combine(tsk, many)
    torch.testing.assert_close(out[1], 2 * sk, rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(
        out[2], group_gradients(model, rb, many[2], sketch=s), rtol=RTOL, atol=1e-12
    )
    # unsketched per-token vectors: combine gives the flat group gradient
    torch.testing.assert_close(combine(token_sketches(model, rb, None), coeffs), got,
                               rtol=RTOL, atol=1e-13)


def test_sketch_follows_the_model_copy():
    """``dtype=`` runs on a float64 copy: a sketch built for the caller's model applies there
    (same sizes and device; the signs are cast once per dtype)."""
    model = trained_llama()
    rb = rollout_batch()
    coeffs = torch.randn(rb.P, rb.G, rb.T, generator=torch.Generator().manual_seed(2))
    s = CountSketch.for_model(model, 4, seed=9)
    got = group_gradients(model, rb, coeffs, sketch=s, dtype=torch.float64)
    assert got.dtype == torch.float64 and next(model.parameters()).dtype == torch.float32
    full = group_gradients(model, rb, coeffs, dtype=torch.float64)
    torch.testing.assert_close(got, full @ dense_count_sketch(s).T, rtol=RTOL, atol=1e-12)


def test_group_gradients_bad_input():
    model = tiny_llama()
    rb = rollout_batch()
    with pytest.raises(ValueError, match="coeffs has shape"):
        group_gradients(model, rb, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="NaN"):
        group_gradients(model, rb, torch.full((2, 3, 6), float("nan")))
    with pytest.raises(TypeError, match="RolloutBatch"):
        group_gradients(model, {"tokens": 1}, torch.zeros(2, 3, 6))
