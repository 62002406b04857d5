"""varbench.grads.group: group gradients sum_{i,t} c v (flat, sketched, per-token sketches
reused for many coefficient sets) against two brute forces; input checks."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import rollout_batch, tiny_llama, trained_llama
from reference_grads import brute_group_gradients, brute_token_grads, dense_count_sketch

from varbench.grads import CountSketch, exact_float64
from varbench.grads.group import combine, group_gradients, token_sketches

RTOL = 1e-8


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
