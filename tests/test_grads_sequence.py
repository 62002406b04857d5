"""varbench.grads.sequence: per-sequence gradients (flat and count-sketched) against brute
force and the exact prefix norms."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama
from reference_grads import brute_sequence_grads, dense_count_sketch

from varbench.grads import CountSketch, exact_float64, token_grad_norms
from varbench.grads.sequence import sequence_grads

RTOL = 1e-8


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
