"""varbench.grads.stats: forward statistics aligned with the response mask (docs/science.md
section 2.3); float32 by default, no graph kept."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama, trained_llama

from varbench.grads import forward_stats
from varbench.models.forward import forward_logits
from varbench.models.logits import logit_proxy, token_logprobs


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
