"""varbench.estimators.coefficients: token_coefficients (the per-token scalars of
grad policy_loss) against the loop reference, a golden clip and autograd through a model;
sample_weights (the advantage-free weights of the cancellation analysis)."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_estimators import loss_inputs, random_case, shared_prefix_groups
from reference_estimators import ref_token_coefficients

import varbench.estimators as E
from varbench.estimators import coefficients as coefmod
from varbench.estimators.coefficients import sample_weights
from varbench.estimators.registry import advantages


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("ratio", E.RATIO_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_token_coefficients_match_reference(mode, ratio, seed):
    # (policy_loss on the same inputs: tests/test_estimators_loss.py)
    logp, logp_old, adv, mask = loss_inputs(seed)
    if ratio == "sequence":
        adv = adv[..., :1].expand_as(adv)  # GSPO: one advantage per response
    clip = (0.2, 0.28) if seed % 2 else (0.1, 0.1)
    c = E.token_coefficients(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    c_ref = ref_token_coefficients(logp, logp_old, adv, mask, mode, clip=clip, ratio=ratio)
    torch.testing.assert_close(c, c_ref, atol=1e-13, rtol=1e-10)


def test_token_coefficients_golden_clip():
    # One response of two tokens, A = 1, clip (0.2, 0.2), token-mean (omega = 1/2).
    # token 0: r = e^{0.5} = 1.6487 > 1.2 -> clipped term -1.2 is larger than -1.6487: loss -1.2,
    #          gradient 0;  token 1: r = e^{-0.1} = 0.9048 (inside) -> loss -0.9048, grad -0.9048.
    logp_old = torch.zeros(1, 1, 2, dtype=torch.float64)
    logp = torch.tensor([[[0.5, -0.1]]], dtype=torch.float64)
    adv, mask = torch.ones(1, 1, 2, dtype=torch.float64), torch.ones(1, 1, 2)
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


# ---- sample_weights ------------------------------------------------------------------------


def test_weights_times_advantage_equal_loss_coefficients():
    tokens, mask, rewards, logp = shared_prefix_groups()
    adv = advantages("centered", rewards, mask != 0)
    g = torch.Generator().manual_seed(1)
    new = logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=torch.float64) * mask
    for ratio in ("token", "sequence"):
        c = sample_weights(new, logp, adv, mask, "seq-mean-token-mean", ratio=ratio)
        want = -coefmod.token_coefficients(new, logp, adv, mask != 0, "seq-mean-token-mean",
                                           ratio=ratio)
        torch.testing.assert_close(c * adv, want, rtol=1e-12, atol=1e-15)
        assert (c[mask != 0] >= 0).all()


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_sample_weights_times_the_advantage_is_minus_the_coefficients_where_a_is_nonzero(
        mode, seed):
    """Token ratio, token-level advantages with exact zeros, the clip binding on some tokens:
    c * A = -token_coefficients where A != 0; where A = 0, c is the weight of sign(0) = +1."""
    logp, logp_old, adv, mask = loss_inputs(seed)
    gen = torch.Generator().manual_seed(seed)
    adv = torch.where(torch.rand(adv.shape, generator=gen) < 0.3, 0.0, adv)
    adv[0, 0, 0] = 0.0  # a valid token (random_case keeps mask[0, 0, 0])
    m = mask != 0
    nz, zero = m & (adv != 0), m & (adv == 0)
    assert nz.any() and zero.any()
    kw = dict(clip=(0.1, 0.15), max_len=7)
    c = sample_weights(logp, logp_old, adv, mask, mode, **kw)
    want = -coefmod.token_coefficients(logp, logp_old, adv, m, mode, **kw)
    torch.testing.assert_close((c * adv)[nz], want[nz], rtol=1e-12, atol=1e-15)
    plus = -coefmod.token_coefficients(logp, logp_old, torch.ones_like(adv), m, mode, **kw)
    torch.testing.assert_close(c[zero], plus[zero], rtol=1e-12, atol=1e-15)
    assert (c[m] >= 0).all() and (c[~m] == 0).all()
    assert (c[nz] == 0).any() and (c[nz] > 0).any()  # the clip took over on some tokens only


def test_sample_weights_sequence_ratio_with_zero_advantage_responses():
    logp, logp_old, adv, mask = loss_inputs(4, G=4)
    adv = adv[..., :1].expand_as(adv).clone()  # GSPO: one advantage per response
    adv[0, 1] = 0.0
    m = mask != 0
    c = sample_weights(logp, logp_old, adv, mask, "seq-mean-token-sum", ratio="sequence")
    want = -coefmod.token_coefficients(logp, logp_old, adv, m, "seq-mean-token-sum",
                                       ratio="sequence")
    nz = m & (adv != 0)
    torch.testing.assert_close((c * adv)[nz], want[nz], rtol=1e-12, atol=1e-15)
    plus = -coefmod.token_coefficients(logp, logp_old, torch.ones_like(adv), m,
                                       "seq-mean-token-sum", ratio="sequence")
    torch.testing.assert_close(c[0, 1][m[0, 1]], plus[0, 1][m[0, 1]], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("ratio", E.RATIO_KINDS)
def test_sample_weights_apply_the_transforms(mode, ratio):
    logp, logp_old, adv, mask = loss_inputs(2, G=4)
    adv = adv[..., :1].expand_as(adv).contiguous()
    m = mask != 0
    base = sample_weights(logp, logp_old, adv, mask, mode, ratio=ratio)
    mr = sample_weights(logp, logp_old, adv, mask, mode, ratio=ratio, transform="min_replace")
    ao = sample_weights(logp, logp_old, adv, mask, mode, ratio=ratio, transform="adv_orthogonal")
    ap = sample_weights(logp, logp_old, adv, mask, mode, ratio=ratio,
                        transform="adv_orthogonal_position")
    assert torch.equal(mr, E.min_replace(base, m))
    assert torch.equal(ao, E.adv_orthogonal(base, adv, m))
    assert torch.equal(ap, E.adv_orthogonal(base, adv, m, per="position"))
    for x in (mr, ao, ap):
        assert not torch.allclose(x, base)  # they did something
    assert (ap * adv * m).sum(1).abs().max() < 1e-12  # orthogonal to A at every position
    # per response: the responses' mean weights are orthogonal to A over the group
    n = m.sum(-1).clamp(min=1)
    vi = torch.where(m, ao, 0).sum(-1) / n
    assert (vi * adv[..., 0]).sum(1).abs().max() < 1e-12
    assert sample_weights(logp, logp_old, adv, mask, mode, ratio=ratio, transform="none").equal(
        base)
    with pytest.raises(ValueError, match=r"transform='max_replace' is not valid.*'min_replace'"):
        sample_weights(logp, logp_old, adv, mask, mode, transform="max_replace")


@pytest.mark.parametrize("ratio", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_token_coefficients_per_group_equals_one_call_per_group(mode, ratio):
    """``per_group=True`` (the exact-moment configurations of the variance analysis in one
    pass) is bitwise one call per ``[c : c + 1]``."""
    g = torch.Generator().manual_seed(3)
    C, G, T = 5, 3, 4
    mask = (torch.rand(C, G, T, generator=g) > 0.3).double()
    mask[:, :, 0] = 1
    adv = torch.randn(C, G, T, generator=g, dtype=torch.float64) * mask
    lp = torch.randn(C, G, T, generator=g, dtype=torch.float64) * 0.1
    old = lp + 0.05 * torch.randn(C, G, T, generator=g, dtype=torch.float64)
    want = torch.cat([E.token_coefficients(lp[c : c + 1], old[c : c + 1], adv[c : c + 1],
                                           mask[c : c + 1], mode, ratio=ratio)
                      for c in range(C)])
    got = E.token_coefficients(lp, old, adv, mask, mode, ratio=ratio, per_group=True)
    assert torch.equal(got, want)
