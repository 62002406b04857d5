"""varbench.estimators.loss: policy_loss against the loop reference and a golden clip, its
errors, and masked inputs that must not leak into the loss."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_estimators import loss_inputs
from reference_estimators import ref_policy_loss

import varbench.estimators as E


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("ratio", E.RATIO_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_matches_reference(mode, ratio, seed):
    # (token_coefficients on the same inputs: tests/test_estimators_coefficients.py)
    logp, logp_old, adv, mask = loss_inputs(seed)
    if ratio == "sequence":
        adv = adv[..., :1].expand_as(adv)  # GSPO: one advantage per response
    clip = (0.2, 0.28) if seed % 2 else (0.1, 0.1)
    loss, metrics = E.policy_loss(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    want = ref_policy_loss(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    if ratio == "token":  # the clip path is exercised: spread 0.4 clips some tokens here
        assert metrics["clip_frac"].item() > 0


def test_policy_loss_golden_clip():
    # One response of two tokens, A = 1, clip (0.2, 0.2), token-mean (omega = 1/2).
    # token 0: r = e^{0.5} = 1.6487 > 1.2 -> clipped term -1.2 is larger than -1.6487: loss -1.2,
    #          gradient 0;  token 1: r = e^{-0.1} = 0.9048 (inside) -> loss -0.9048, grad -0.9048.
    logp_old = torch.zeros(1, 1, 2, dtype=torch.float64)
    logp = torch.tensor([[[0.5, -0.1]]], dtype=torch.float64)
    adv, mask = torch.ones(1, 1, 2, dtype=torch.float64), torch.ones(1, 1, 2)
    loss, m = E.policy_loss(logp, logp_old, adv, mask, "token-mean")
    assert loss.item() == pytest.approx(0.5 * (-1.2 - math.exp(-0.1)))
    assert m["clip_frac"].item() == 0.5
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5))
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.1))
    kl = 0.5 * sum(math.exp(x) - 1 - x for x in (0.5, -0.1))  # k3 of KL(pi_old || pi)
    assert m["approx_kl"].item() == pytest.approx(kl)


def test_policy_loss_errors():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="ratio='seq'"):
        E.policy_loss(x, x, x, x + 1, "token-mean", ratio="seq")
    with pytest.raises(ValueError, match=r"adv has shape \[1, 2\]"):
        E.policy_loss(x, x, x[..., 0], x + 1, "token-mean")
    with pytest.raises(ValueError, match="clip="):
        E.policy_loss(x, x, x, x + 1, "token-mean", clip=(1.5, 0.2))


def test_masked_inputs_do_not_leak_into_loss():
    logp, logp_old, adv, mask = loss_inputs(1)
    noise = torch.randn_like(logp) * 5
    m = mask != 0
    args = [torch.where(m, x, x + noise) for x in (logp, logp_old, adv)]
    for ratio in E.RATIO_KINDS:
        a = E.policy_loss(logp, logp_old, adv, mask, "seq-mean-token-mean", ratio=ratio)[0]
        b = E.policy_loss(*args, mask, "seq-mean-token-mean", ratio=ratio)[0]
        assert a.item() == pytest.approx(b.item(), rel=1e-12)


# ---- dual clip and GSPO-token ----------------------------------------------------------------


def _loss_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 4, 6)
    mask = torch.rand(shape, generator=gen) < 0.8
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2
    logp = old + torch.randn(shape, generator=gen, dtype=torch.float64) * 1.2
    adv = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    return logp, old, adv, mask


def test_dual_clip_caps_negative_advantage_terms_and_its_coefficients_are_the_gradient():
    logp, old, adv, mask = _loss_case()
    lp = logp.clone().requires_grad_()
    loss, metrics = E.policy_loss(lp, old, adv, mask, "token-mean", clip_ratio_c=3.0)
    loss.backward()
    # per token, literally: min(max(-A r, -A clip(r)), -3 A) where A < 0
    r = torch.exp(logp - old)
    per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    per = torch.where(adv < 0, torch.minimum(per, -adv * 3.0), per)
    m = mask.double()
    torch.testing.assert_close(loss, (per * m).sum() / m.sum(), rtol=1e-14, atol=1e-14)
    assert float(metrics["clip_frac_lower"]) > 0
    coef = E.token_coefficients(logp, old, adv, mask, "token-mean", clip_ratio_c=3.0)
    torch.testing.assert_close(coef, lp.grad, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0"):
        E.policy_loss(logp, old, adv, mask, clip_ratio_c=1.0)


def test_gspo_token_has_the_sequence_value_and_per_token_gradients():
    logp, old, adv, mask = _loss_case(1)
    lp_tok, lp_seq = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    tok, _ = E.policy_loss(lp_tok, old, adv, mask, "token-mean", ratio="sequence-token")
    seq, _ = E.policy_loss(lp_seq, old, adv, mask, "token-mean", ratio="sequence")
    torch.testing.assert_close(tok, seq, rtol=1e-14, atol=1e-14)
    tok.backward()
    seq.backward()
    coef = E.token_coefficients(logp, old, adv, mask, "token-mean", ratio="sequence-token")
    torch.testing.assert_close(coef, lp_tok.grad, rtol=1e-13, atol=1e-15)
    assert (lp_tok.grad - lp_seq.grad).abs().max() > 1e-3  # token-level A: not GSPO's gradient


def test_verl_conventions_leave_empty_rows_out_of_the_sequence_count():
    mask = torch.ones(2, 3, 4)
    mask[0, 1] = 0  # one empty response of six
    w_default = E.aggregation_weights(mask, "seq-mean-token-sum")
    w_verl = E.aggregation_weights(mask, "seq-mean-token-sum", conventions="verl")
    assert float(w_default[0, 0, 0]) == pytest.approx(1 / 6)
    assert float(w_verl[0, 0, 0]) == pytest.approx(1 / 5)
    w = E.aggregation_weights(mask, "seq-mean-token-mean", conventions="verl",
                              dtype=torch.float64)
    assert float(w[0, 0, 0]) == 1 / (5 * (4 + 1e-8))
