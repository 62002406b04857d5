"""Tail-exact norms from one backward against the exact per-token path (float64)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama, trained_llama

from varbench.grads import exact_float64, forward_stats, token_grad_norms
from varbench.grads.tail import default_tail_modules, tail_token_norms

RTOL = 1e-8


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_tail_matches_exact_restricted_to_tail(tied, padding):
    model = exact_float64(trained_llama(tied=tied))
    ids, rm, am = batch(padding)
    mods = default_tail_modules(model)
    assert ("lm_head" in mods) == (not tied)
    got = tail_token_norms(model, ids, rm, am)
    ref = token_grad_norms(model, ids, rm, am, params=list(mods.values()), progress=False)
    torch.testing.assert_close(got.token_sq, ref.token_sq, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, ref.prefix_sq, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.diag_prefix_sq, ref.diag_prefix_sq, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.sequence_sq, ref.sequence_sq, rtol=RTOL, atol=0)
    for k, (name, mod) in enumerate(mods.items()):
        one = token_grad_norms(model, ids, rm, am, params=[mod], progress=False)
        torch.testing.assert_close(got.group_prefix_sq[..., k], one.prefix_sq, rtol=RTOL, atol=0)
        assert got.group_names[k] == name


def test_head_identity_w_times_h_sq():
    """Untied head: ||grad_W log p(y_t)||^2 == w_t * ||h_t||^2 (docs/science.md section 2.3)."""
    model = exact_float64(trained_llama(tied=False))
    ids, rm, am = batch("left")
    got = tail_token_norms(model, ids, rm, am, modules={"lm_head": model.lm_head})
    st = forward_stats(model, ids, rm, am, hidden_norms=True)
    # atol: 1 - 2p + sum_pi_sq cancels when p -> 1 (trained model), losing ~1e-16 absolute
    torch.testing.assert_close(got.token_sq, st.proxy * st.h_sq, rtol=1e-10, atol=1e-13)
    assert torch.all(got.token_sq[rm == 1] > 0)


def test_tail_default_dtype_and_errors():
    model = tiny_llama()
    ids, rm, am = batch()
    out = tail_token_norms(model, ids, rm, am)
    assert out.token_sq.dtype == torch.float32 and torch.all(out.token_sq[rm == 0] == 0)
    with pytest.raises(TypeError, match="cannot find the tail"):
        default_tail_modules(torch.nn.Linear(2, 2))
