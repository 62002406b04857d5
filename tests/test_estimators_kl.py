"""varbench.estimators.kl: the k1 / k2 / k3 KL estimators against closed forms on small
categorical distributions (exact enumeration), golden values and the mask."""

from __future__ import annotations

import math

import pytest
import torch

import varbench.estimators as E
from varbench.estimators.kl import kl_penalty


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


def _categorical(seed, V=5):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_against_closed_forms(seed):
    """E_{y~p}[k(y)] by exact enumeration: k1 and k3 equal KL(p||q); k2 equals its own
    closed form 0.5 E_p[log^2(p/q)], which matches KL to second order as q -> p."""
    logp, logq = _categorical(seed), _categorical(seed + 100)
    p = logp.exp()
    kl = float((p * (logp - logq)).sum())
    e = {k: float((p * kl_penalty(logp, logq, k)).sum()) for k in ("k1", "k2", "k3")}
    assert e["k1"] == pytest.approx(kl, rel=1e-12)
    assert e["k3"] == pytest.approx(kl, rel=1e-12)
    assert e["k2"] == pytest.approx(float((p * 0.5 * (logp - logq) ** 2).sum()), rel=1e-12)
    assert (kl_penalty(logp, logq, "k3") >= 0).all() and (kl_penalty(logp, logq, "k2") >= 0).all()
    # Near q = p the three agree to second order: relative gap shrinks with the distance.
    logq_near = torch.log_softmax(logp + 0.01 * (logq - logp), -1)
    kl_near = float((p * (logp - logq_near)).sum())
    e2 = float((p * kl_penalty(logp, logq_near, "k2")).sum())
    assert abs(e2 - kl_near) / kl_near < 0.05


def test_k3_clamp_is_verls():
    x = torch.tensor([-40.0, -5.0, 0.0, 3.0, 25.0], dtype=torch.float64)  # logp - logp_ref
    got = E.kl_penalty(x, torch.zeros_like(x), "k3", clamp=True)
    neg = (-x).clamp(-20, 20)
    want = (torch.exp(neg) - neg - 1).clamp(-10, 10)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
    plain = E.kl_penalty(x, torch.zeros_like(x), "k3")
    assert float(plain[0]) > 1e16 and float(got[0]) == 10.0
