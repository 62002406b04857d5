"""The trainer's loss against docs/science.md section 7 written out by hand, and the KL estimators
against closed forms on small categorical distributions."""

from __future__ import annotations

import math

import pytest
import torch

from varbench.estimators.kl import kl_penalty
from varbench.train.config import TrainConfig
from varbench.train.loop import lr_at, minibatch_loss

# Hand-built [P=1, G=2, T=3]: response 0 has 3 valid tokens, response 1 has 2.
LOGP = [[0.10 - 1.0, -0.70, -0.20], [-1.50, 0.30 - 2.0, 0.0]]
LOGP_OLD = [[-1.00, -0.50, -0.25], [-1.20, -2.00, 0.0]]
LOGP_REF = [[-0.90, -0.80, -0.30], [-1.00, -1.70, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _t(x):
    return torch.tensor([x], dtype=torch.float64)


def _by_hand(eps_lo, eps_hi, beta, mode, kind):
    """-min(r A, clip(r, 1-eps_lo, 1+eps_hi) A) + beta * KL, aggregated by ``mode``."""
    def kl(x):
        return {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1}[kind]

    B = 2
    total = 0.0
    n_tokens = sum(sum(row) for row in MASK)
    for i in range(2):
        length = sum(MASK[i])
        for t in range(3):
            if not MASK[i][t]:
                continue
            r = math.exp(LOGP[i][t] - LOGP_OLD[i][t])
            a = ADV[i][t]
            term = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            term += beta * kl(LOGP[i][t] - LOGP_REF[i][t])
            weight = {"token-mean": 1 / n_tokens, "seq-mean-token-mean": 1 / (B * length),
                      "seq-mean-token-sum": 1 / B}[mode]
            total += weight * term
    return total


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_loss_matches_section7_by_hand(mode, kind):
    cfg = TrainConfig(agg=mode, clip_low=0.1, clip_high=0.3, kl_coef=0.05, kl_kind=kind)
    loss, metrics = minibatch_loss(cfg, _t(LOGP), _t(LOGP_OLD), _t(ADV), _t(MASK).bool(),
                                   _t(LOGP_REF))
    want = _by_hand(0.1, 0.3, 0.05, mode, kind)
    assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert metrics["loss/total"] == pytest.approx(want, rel=1e-12)


def test_loss_without_kl_and_clip_is_active():
    cfg = TrainConfig(clip_low=0.2, clip_high=0.2)
    loss, metrics = minibatch_loss(cfg, _t(LOGP), _t(LOGP_OLD), _t(ADV), _t(MASK).bool(), None)
    assert float(loss) == pytest.approx(_by_hand(0.2, 0.2, 0.0, "token-mean", "k3"), rel=1e-12)
    # Which tokens does the clip bind (its term is the larger one)? r = exp(logp - logp_old):
    # resp 0: e^0.1, e^-0.2, e^0.05 with A = +1 -> all inside [0.8, 1.2] or below with A > 0
    #   (e^-0.2 = 0.819 is inside): none binds;
    # resp 1: e^-0.3 = 0.741 < 0.8 with A = -1 -> -A*clip = 0.8 > 0.741: binds;
    #         e^0.3 = 1.35 > 1.2 with A = -1 -> -A*r = 1.35 > 1.2: the clip does not bind.
    assert metrics["ppo/clip_frac"] == pytest.approx(1 / 5)
    # Raise resp 0 token 0 to r = e^0.5 = 1.65 > 1.2 with A = +1: a second binding token.
    logp = _t([[0.5 - 1.0, -0.70, -0.20], [-1.50, 0.30 - 2.0, 0.0]])
    _, m2 = minibatch_loss(cfg, logp, _t(LOGP_OLD), _t(ADV), _t(MASK).bool(), None)
    assert m2["ppo/clip_frac"] == pytest.approx(2 / 5)


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


def test_lr_schedules():
    c = TrainConfig(lr=1.0, steps=10, warmup_steps=2, lr_schedule="linear")
    assert [lr_at(c, s) for s in (1, 2, 3)] == [0.5, 1.0, 1.0]
    assert lr_at(c, 10) == pytest.approx(1 - 7 / 8)
    c = TrainConfig(lr=1.0, steps=10, lr_schedule="cosine")
    assert lr_at(c, 1) == 1.0 and lr_at(c, 6) == pytest.approx(0.5) and lr_at(c, 10) < 0.03
    assert lr_at(TrainConfig(lr=0.1), 50) == 0.1
