"""Forward statistics and proxy identities (docs/science.md section 2.3)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama, trained_llama

from varbench.grads import forward_stats, logit_proxy, sum_pi_sq, token_logprobs
from varbench.models.forward import forward_logits


def test_sum_pi_sq_matches_softmax_and_is_stable():
    z = torch.randn(5, 7, 31, dtype=torch.float64)
    torch.testing.assert_close(
        sum_pi_sq(z), torch.softmax(z, -1).pow(2).sum(-1), rtol=1e-12, atol=0
    )
    big = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [-1e4, -1e4, -1e4]], dtype=torch.float32)
    s = sum_pi_sq(big)
    assert torch.all(torch.isfinite(s))
    e = torch.exp(torch.tensor(-1.0))
    want = torch.tensor([(1 + e**2) / (1 + e) ** 2, 1 / 3])
    torch.testing.assert_close(s, want, rtol=1e-5, atol=0)
    assert sum_pi_sq(torch.full((3, 10), 1e4, dtype=torch.bfloat16)).dtype == torch.float32


def test_logit_proxy_is_squared_logit_gradient():
    z = torch.randn(4, 6, 17, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 17, (4, 6))
    w = logit_proxy(z, y)
    for idx in [(0, 0), (3, 5), (2, 1)]:
        (g,) = torch.autograd.grad(torch.log_softmax(z[idx], -1)[y[idx]], z)
        torch.testing.assert_close(w[idx], g.pow(2).sum(), rtol=1e-12, atol=0)
    e_y = torch.nn.functional.one_hot(y, 17).double()
    torch.testing.assert_close(w, (e_y - torch.softmax(z, -1)).pow(2).sum(-1), rtol=1e-12, atol=0)
    assert torch.all((w >= 0) & (w < 2))
    with pytest.raises(ValueError, match="tokens has shape"):
        logit_proxy(z, y[:, :3])


@pytest.mark.parametrize("padding", ["right", "left"])
def test_forward_stats_alignment_and_values(padding):
    model = trained_llama().double()
    ids, rm, am = batch(padding)
    st = forward_stats(model, ids, rm, am, hidden_norms=True)
    logits = forward_logits(model, ids, am).logits
    lp = torch.log_softmax(logits, -1)
    b, t = 1, 7
    assert rm[b, t] == 1
    torch.testing.assert_close(st.logp[b, t], lp[b, t - 1, ids[b, t]], rtol=1e-12, atol=0)
    torch.testing.assert_close(st.logp, token_logprobs(logits, ids) * rm, rtol=1e-12, atol=1e-14)
    p = lp[b, t - 1].exp()
    torch.testing.assert_close(st.entropy[b, t], -(p * lp[b, t - 1]).sum(), rtol=1e-10, atol=0)
    torch.testing.assert_close(st.sum_pi_sq[b, t], p.pow(2).sum(), rtol=1e-10, atol=0)
    torch.testing.assert_close(
        st.proxy[b, t], logit_proxy(logits[b, t - 1], ids[b, t]), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(st.cum_proxy, (st.proxy * rm).cumsum(-1) * rm, rtol=1e-12, atol=0)
    for f in (st.logp, st.entropy, st.sum_pi_sq, st.proxy, st.cum_proxy, st.h_sq):
        assert torch.all(f[rm == 0] == 0)
    # the untied head has full column rank (V > hidden): recover h from the logits
    hs = model.lm_head.weight.pinverse() @ logits[b, t - 1]
    torch.testing.assert_close(st.h_sq[b, t], hs.pow(2).sum(), rtol=1e-8, atol=0)


def test_forward_stats_default_float32_and_no_grad():
    model = tiny_llama()
    ids, rm, am = batch()
    assert all(p.requires_grad for p in model.parameters())
    st = forward_stats(model, ids, rm, am)
    assert st.proxy.dtype == torch.float32 and not st.proxy.requires_grad and st.h_sq is None
    assert not st.logp.requires_grad and not st.entropy.requires_grad


def test_eval_mode_switches_a_training_model_and_restores_it():
    """Per-token quantities must not see dropout; a model in training mode is restored after."""
    from varbench.grads._inputs import eval_mode

    model = tiny_llama()
    model.train()
    seen = []
    with eval_mode(model):
        seen = [m.training for m in model.modules()]
    assert not any(seen)
    assert all(m.training for m in model.modules())
    model.eval()
    with eval_mode(model):
        assert not model.training
    assert not model.training
