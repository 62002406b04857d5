"""varbench.models.logits: the statistics of pi (log-probs, entropy, sum_pi_sq, the
Logit-Gradient Proxy) against float64 brute force, stable for any logit scale (docs/science.md
section 2.3)."""

from __future__ import annotations

import pytest
import torch
from reference_models import brute_pi_stats

from varbench.models.logits import (
    logit_proxy,
    pi_stats,
    proxy_from_logprobs,
    stat_dtype,
    sum_pi_sq,
    token_logprobs,
    upcast,
)


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


def _logits(seed, shape=(3, 4, 11), scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return z.to(dtype), y


@pytest.mark.parametrize("seed", range(3))
def test_pi_stats_match_the_float64_brute_force(seed):
    z, y = _logits(seed)
    s = pi_stats(z, y)
    logp, ent, sq = brute_pi_stats(z, y)
    for got, want in zip(s[:3], (logp, ent, sq), strict=True):
        assert got.dtype == torch.float64 and got.shape == y.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum_pi_sq(z), sq, rtol=1e-12, atol=1e-14)
    # float32 logits: computed in float32, close to the float64 truth
    s32 = pi_stats(z.float(), y)
    assert s32.logp.dtype == s32.entropy.dtype == s32.sum_pi_sq.dtype == torch.float32
    for got, want in zip(s32[:3], (logp, ent, sq), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_masked_logits_give_finite_entropy_and_sum_pi_sq():
    """A -inf logit (a masked vocabulary entry) contributes exactly 0, never NaN."""
    z, y = _logits(5, shape=(2, 6, 9))
    z[..., 3] = float("-inf")
    z[1, 2, :] = float("-inf")
    z[1, 2, 4] = 0.0  # one live entry: pi is one-hot there
    y[1, 2] = 4
    y = torch.where(y == 3, 0, y)  # the sampled token is never a masked one
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        s = pi_stats(z.to(dtype), y)
        for x in (*s[:4], sum_pi_sq(z.to(dtype)), logit_proxy(z.to(dtype), y)):
            assert torch.isfinite(x).all(), dtype
    s = pi_stats(z, y)
    logp, ent, sq = brute_pi_stats(z, y)
    torch.testing.assert_close(s.entropy, ent, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s.sum_pi_sq, sq, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s.logp, logp, rtol=1e-12, atol=1e-14)
    assert s.entropy[1, 2].item() == 0.0 and s.sum_pi_sq[1, 2].item() == 1.0
    assert s.logp[1, 2].item() == 0.0 and logit_proxy(z, y)[1, 2].item() == 0.0


def test_reduced_precision_logits_are_computed_in_float32():
    z, y = _logits(1, dtype=torch.bfloat16)
    s = pi_stats(z, y)
    want = pi_stats(z.float(), y)  # the same bf16 values, upcast first
    for got, ref in zip(s[:4], want[:4], strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, ref)
    assert sum_pi_sq(z).dtype == torch.float32 and torch.equal(sum_pi_sq(z), want.sum_pi_sq)
    assert logit_proxy(z.half(), y).dtype == torch.float32
    assert [stat_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32,
                                     torch.float64)] == [torch.float32] * 3 + [torch.float64]
    for d in (torch.float32, torch.float64):
        x = z.to(d)
        assert upcast(x) is x  # no copy
    assert upcast(z).dtype == torch.float32


def test_proxy_from_logprobs_equals_logit_proxy():
    z, y = _logits(2)
    s = pi_stats(z, y)
    logp, sq = s.logp.clone(), s.sum_pi_sq.clone()
    w = proxy_from_logprobs(s.logp, s.sum_pi_sq)
    assert torch.equal(s.logp, logp) and torch.equal(s.sum_pi_sq, sq)  # inputs not modified
    torch.testing.assert_close(w, logit_proxy(z, y), rtol=0, atol=0)
    blogp, _, bsq = brute_pi_stats(z, y)
    torch.testing.assert_close(w, 1 - 2 * blogp.exp() + bsq, rtol=1e-12, atol=1e-14)
    assert ((w >= 0) & (w < 2)).all()
    # the in-place path (no autograd) and the differentiable path give the same numbers
    lp = s.logp.clone().requires_grad_(True)
    w_grad = proxy_from_logprobs(lp, s.sum_pi_sq)
    assert w_grad.requires_grad
    torch.testing.assert_close(w_grad.detach(), w, rtol=1e-15, atol=1e-15)


def test_logit_proxy_is_differentiable():
    z, y = _logits(4, shape=(2, 3, 5), scale=1.0)
    z.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: logit_proxy(x, y), (z,))
    # d w / d z against the closed form: w = ||e_y - p||^2, dw/dz = 2 J^T (p - e_y), with
    # J = diag(p) - p p^T the softmax Jacobian
    (g,) = torch.autograd.grad(logit_proxy(z, y).sum(), z)
    p = torch.softmax(z.detach(), -1)
    d = p - torch.nn.functional.one_hot(y, 5).double()
    want = 2 * (p * d - p * (p * d).sum(-1, keepdim=True))
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)


def test_token_logprobs_alignment_and_shape_errors():
    z, ids = _logits(6, shape=(2, 5, 7))
    lp = token_logprobs(z, ids)
    assert lp.shape == (2, 5) and (lp[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 5):
            want = torch.log_softmax(z[b, t - 1], -1)[ids[b, t]]
            torch.testing.assert_close(lp[b, t], want, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"tokens has shape \[2, 4\], expected \[2, 5\]"):
        pi_stats(z, ids[:, :4])
