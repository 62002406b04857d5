"""Aggregation weights, policy_loss, token_coefficients (vs autograd), KL, transforms."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_estimators import random_case
from reference_estimators import (
    ref_aggregation_weights,
    ref_policy_loss,
    ref_token_coefficients,
)

import varbench.estimators as E


def _loss_inputs(seed, P=2, G=3, T=5, multi_turn=True, spread=0.4):
    _, mask, _ = random_case(P, G, T, seed, multi_turn=multi_turn, allow_empty=True)
    gen = torch.Generator().manual_seed(100 + seed)
    logp_old = -torch.rand(P, G, T, generator=gen, dtype=torch.float64) * 3
    logp = logp_old + spread * torch.randn(P, G, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(P, G, T, generator=gen, dtype=torch.float64)
    return logp, logp_old, adv, mask


# ---- aggregation ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_aggregation_matches_loop(mode, seed):
    _, _, _, mask = _loss_inputs(seed)
    got = E.aggregation_weights(mask.double(), mode, max_len=7 if seed else None)
    torch.testing.assert_close(got, ref_aggregation_weights(mask, mode, 7 if seed else None))


def test_aggregation_golden():
    # Two sequences of lengths 2 and 3 (T = 4): total 5 tokens, B = 2.
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 0]]], dtype=torch.float64)
    w = E.aggregation_weights(mask, "token-mean")
    assert w[0, 0].tolist() == [1 / 5, 1 / 5, 0, 0]
    w = E.aggregation_weights(mask, "seq-mean-token-mean")
    assert w[0, 0].tolist() == [1 / 4, 1 / 4, 0, 0]  # 1 / (B |o| ) = 1 / (2 * 2)
    assert w[0, 1].tolist() == [1 / 6, 1 / 6, 1 / 6, 0]  # 1 / (2 * 3)
    assert E.aggregation_weights(mask, "seq-mean-token-sum")[0, 1, 0].item() == 1 / 2
    assert E.aggregation_weights(mask, "seq-mean-token-sum-norm")[0, 1, 0].item() == 1 / 8
    assert E.aggregation_weights(mask, "seq-mean-token-sum-norm", max_len=10)[0, 1, 0] == 1 / 20


def test_aggregation_errors():
    with pytest.raises(ValueError, match="mode='mean'.*token-mean"):
        E.aggregation_weights(torch.ones(1, 1, 2), "mean")
    with pytest.raises(ValueError, match="max_len=0"):
        E.aggregation_weights(torch.ones(1, 1, 2), "seq-mean-token-sum-norm", max_len=0)
    with pytest.raises(ValueError, match="no valid token"):
        E.aggregation_weights(torch.zeros(1, 1, 2), "token-mean")


# ---- policy loss and coefficients ----------------------------------------------------------


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("ratio", E.RATIO_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_and_coefficients_match_references(mode, ratio, seed):
    logp, logp_old, adv, mask = _loss_inputs(seed)
    if ratio == "sequence":
        adv = adv[..., :1].expand_as(adv)  # GSPO: one advantage per response
    clip = (0.2, 0.28) if seed % 2 else (0.1, 0.1)
    loss, metrics = E.policy_loss(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    want = ref_policy_loss(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    c = E.token_coefficients(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    c_ref = ref_token_coefficients(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    torch.testing.assert_close(c, c_ref, atol=1e-13, rtol=1e-10)
    if ratio == "token":  # the clip path is exercised: spread 0.4 clips some tokens here
        assert metrics["clip_frac"].item() > 0


def test_coefficients_reproduce_model_gradient():
    # A tiny softmax policy over 4 tokens with context-dependent logits: sum_t c_t grad logp_t
    # must equal the autograd gradient of the loss w.r.t. the parameters (GSPO coupling too).
    gen = torch.Generator().manual_seed(0)
    P, G, T, V, H = 2, 3, 4, 4, 5
    _, mask, _ = random_case(P, G, T, 3, multi_turn=True)
    feats = torch.randn(P, G, T, H, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (P, G, T), generator=gen)
    W = torch.randn(H, V, generator=gen, dtype=torch.float64, requires_grad=True)
    adv = torch.randn(P, G, 1, generator=gen, dtype=torch.float64).expand(P, G, T)

    def logp_of(W):
        return torch.log_softmax(feats @ W, -1).gather(-1, tokens[..., None])[..., 0]

    logp_old = (logp_of(W) + 0.3 * torch.randn(P, G, T, generator=gen)).detach()
    for ratio in E.RATIO_KINDS:
        for mode in E.AGGREGATION_MODES:
            kw = dict(clip=(0.1, 0.15), ratio=ratio)
            loss, _ = E.policy_loss(logp_of(W), logp_old, adv, mask, mode, **kw)
            (g_loss,) = torch.autograd.grad(loss, W)
            c = E.token_coefficients(logp_of(W), logp_old, adv, mask, mode, **kw)
            (g_c,) = torch.autograd.grad((c * logp_of(W)).sum(), W)
            torch.testing.assert_close(g_c, g_loss, atol=1e-12, rtol=1e-10)


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
    c = E.token_coefficients(logp, logp_old, adv, mask, "token-mean")
    assert c[0, 0].tolist() == pytest.approx([0.0, -0.5 * math.exp(-0.1)])
    # GSPO: s = exp((0.5 - 0.1) / 2) = e^{0.2} = 1.2214 > 1.2 -> clipped for every token, c = 0.
    c = E.token_coefficients(logp, logp_old, adv, mask, "token-mean", ratio="sequence")
    assert c.abs().max().item() == 0.0
    # With clip (0.2, 0.3) it is unclipped: c_t' = (1/|o|) sum_t omega (-A) s = 0.5 * -e^{0.2}.
    c = E.token_coefficients(
        logp, logp_old, adv, mask, "token-mean", ratio="sequence", clip=(0.2, 0.3)
    )
    assert c[0, 0].tolist() == pytest.approx([-0.5 * math.exp(0.2)] * 2)


def test_policy_loss_errors():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="ratio='seq'"):
        E.policy_loss(x, x, x, x + 1, "token-mean", ratio="seq")
    with pytest.raises(ValueError, match=r"adv has shape \[1, 2\]"):
        E.policy_loss(x, x, x[..., 0], x + 1, "token-mean")
    with pytest.raises(ValueError, match="clip="):
        E.policy_loss(x, x, x, x + 1, "token-mean", clip=(1.5, 0.2))


def test_masked_inputs_do_not_leak_into_loss():
    logp, logp_old, adv, mask = _loss_inputs(1)
    noise = torch.randn_like(logp) * 5
    m = mask != 0
    args = [torch.where(m, x, x + noise) for x in (logp, logp_old, adv)]
    for ratio in E.RATIO_KINDS:
        a = E.policy_loss(logp, logp_old, adv, mask, "seq-mean-token-mean", ratio=ratio)[0]
        b = E.policy_loss(*args, mask, "seq-mean-token-mean", ratio=ratio)[0]
        assert a.item() == pytest.approx(b.item(), rel=1e-12)


# ---- KL penalties --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_kl_estimators_against_closed_form(seed):
    # E_{y~pi}[k(y)] by exact enumeration over a small categorical vs KL(pi || pi_ref).
    gen = torch.Generator().manual_seed(seed)
    V = 6
    pi = torch.randn(V, generator=gen, dtype=torch.float64).softmax(0)
    scale = 0.05 if seed < 2 else 1.0
    ref = (pi.log() + scale * torch.randn(V, generator=gen, dtype=torch.float64)).softmax(0)
    kl = (pi * (pi.log() - ref.log())).sum().item()
    e = {k: (pi * E.kl_penalty(pi.log(), ref.log(), k)).sum().item() for k in E.KL_KINDS}
    assert e["k1"] == pytest.approx(kl, rel=1e-12)
    assert e["k3"] == pytest.approx(kl, rel=1e-10)
    assert (E.kl_penalty(pi.log(), ref.log(), "k3") >= 0).all()
    assert (E.kl_penalty(pi.log(), ref.log(), "k2") >= 0).all()
    if scale < 0.1:  # k2 matches KL to second order near pi = pi_ref
        assert e["k2"] == pytest.approx(kl, rel=0.1)


def test_kl_golden_and_mask():
    x = torch.tensor([0.5, -0.1, float("-inf")])
    ref = torch.zeros(3)
    mask = torch.tensor([1, 1, 0])
    k3 = E.kl_penalty(x, ref, "k3", mask=mask)
    assert k3.tolist()[:2] == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.exp(0.1) - 0.1 - 1])
    assert k3[2].item() == 0.0
    assert E.kl_penalty(x, ref, "k2", mask=mask).tolist() == pytest.approx([0.125, 0.005, 0])
    with pytest.raises(ValueError, match="kind='k4'"):
        E.kl_penalty(x, ref, "k4")


# ---- transforms ----------------------------------------------------------------------------


def test_transforms_golden_and_detached():
    v = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
    a = torch.tensor([[1.0, 0.0, -1.0]])
    assert E.min_replace(v).tolist() == [[1.0, 1.0, 1.0]]
    # A.v = 1 - 4 = -3, A.A = 2 -> v~ = v + 1.5 A = [2.5, 2, 2.5]
    out = E.adv_orthogonal(v, a)
    assert out.tolist() == [[2.5, 2.0, 2.5]]
    assert not out.requires_grad and not E.min_replace(v).requires_grad
    assert E.adv_orthogonal(v, torch.zeros(1, 3)).tolist() == [[1.0, 2.0, 4.0]]
    mask = torch.tensor([[1, 1, 0]])
    assert E.min_replace(v, mask).tolist() == [[1.0, 1.0, 0.0]]
