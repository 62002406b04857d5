"""The transformed surrogate of ``minibatch_loss`` off-policy (ratio != 1, clip acting), against
a float64 Python-loop reference of its gradient (issue 31: the GSPO arms with several updates
per batch, where Min-Replace and Adv-Orthogonal see clipped members).

Reference, per group and response i (A_i constant over the response, an outcome reward):
ratio r (token: per token; sequence: ``exp(mean_t log r_t)``), the PPO indicator
``act = r A <= clip(r) A`` (the unclipped term is the smaller one: gradient flows), the
aggregation weight omega, the untransformed weight ``v = omega x r x act`` (sequence: the
response's sum of omega, spread evenly over its tokens), then Min-Replace (the minimum over
the responses valid at each position) or Adv-Orthogonal (``v_i - lambda A_i`` with
``lambda = sum_i A_i v_i / sum_i A_i^2``, v_i the response's mean weight), and
``d loss / d logp_{i,t} = -v~_{i,t} A_i``. Tolerance 1e-12 (float64 rounding of a few sums).
"""

from __future__ import annotations

import math

import pytest
import torch

from varbench.estimators import policy_loss
from varbench.train.config import TrainConfig
from varbench.train.loop import minibatch_loss

P, G, T = 3, 4, 5
LENGTHS = [[5, 3, 4, 2], [4, 4, 1, 5], [2, 5, 3, 3]]
ADV = [[1.0, -1.0, 0.5, -0.5], [-1.2, 0.4, 0.8, 0.0], [0.7, -0.7, 0.3, -0.3]]


def _inputs(ratio: str) -> tuple[torch.Tensor, ...]:
    """float64 ``logp, logp_old, adv, mask [P, G, T]``; log-ratios chosen so that group 0 has
    members clipped on both sides, group 1 one member clipped, group 2 none (sequence: the
    GSPO range 3e-4 / 4e-4; token: 0.2 / 0.2)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(P, G, T, dtype=torch.bool)
    for p in range(P):
        for i in range(G):
            mask[p, i, : LENGTHS[p][i]] = True
    old = -torch.rand(P, G, T, generator=g, dtype=torch.float64) * 3 - 0.1
    scale = 1e-3 if ratio == "sequence" else 0.5
    shift = torch.tensor([[1.0, -1.0, 0.2, 0.1], [1.0, 0.1, -0.2, 0.3], [0.1, -0.1, 0.2, 0.05]],
                         dtype=torch.float64)[..., None] * scale
    jitter = (torch.rand(P, G, T, generator=g, dtype=torch.float64) - 0.5) * scale * 0.1
    logp = torch.where(mask, old + shift + jitter, 0.0)
    adv = torch.tensor(ADV, dtype=torch.float64)[..., None].expand(P, G, T).contiguous()
    return logp, torch.where(mask, old, 0.0), torch.where(mask, adv, 0.0), mask


def _reference_grad(logp, old, adv, mask, agg, ratio, clip, transform) -> torch.Tensor:
    lo, hi = clip
    n_tok = int(mask.sum())
    grad = torch.zeros(P, G, T, dtype=torch.float64)
    for p in range(P):
        v = [[0.0] * T for _ in range(G)]
        for i in range(G):
            n = LENGTHS[p][i]
            A = float(adv[p, i, 0])
            omega = [(1.0 / n_tok if agg == "token-mean" else 1.0 / (P * G * n)) for _ in range(n)]
            if ratio == "sequence":
                s = math.exp(sum(float(logp[p, i, t] - old[p, i, t]) for t in range(n)) / n)
                act = s * A <= min(max(s, 1 - lo), 1 + hi) * A
                w = sum(omega) * s * act / n
                for t in range(n):
                    v[i][t] = w
            else:
                for t in range(n):
                    r = math.exp(float(logp[p, i, t] - old[p, i, t]))
                    act = r * A <= min(max(r, 1 - lo), 1 + hi) * A
                    v[i][t] = omega[t] * r * act
        if transform == "min_replace":
            vt = [[0.0] * T for _ in range(G)]
            for t in range(T):
                live = [i for i in range(G) if t < LENGTHS[p][i]]
                for i in live:
                    vt[i][t] = min(v[j][t] for j in live)
        elif transform == "adv_orthogonal":
            means = [sum(v[i][: LENGTHS[p][i]]) / LENGTHS[p][i] for i in range(G)]
            As = [float(adv[p, i, 0]) for i in range(G)]
            lam = sum(a * m for a, m in zip(As, means, strict=True)) / sum(a * a for a in As)
            vt = [[(v[i][t] - lam * As[i]) if t < LENGTHS[p][i] else 0.0 for t in range(T)]
                  for i in range(G)]
        else:
            vt = v
        for i in range(G):
            for t in range(LENGTHS[p][i]):
                grad[p, i, t] = -vt[i][t] * float(adv[p, i, 0])
    return grad


CASES = [("sequence", "seq-mean-token-mean", (3e-4, 4e-4)),
         ("sequence", "token-mean", (3e-4, 4e-4)),
         ("token", "seq-mean-token-mean", (0.2, 0.2)),
         ("token", "token-mean", (0.2, 0.2))]


@pytest.mark.parametrize("ratio,agg,clip", CASES)
@pytest.mark.parametrize("transform", ["none", "min_replace", "adv_orthogonal"])
def test_transformed_surrogate_gradient_matches_loop_reference(ratio, agg, clip, transform):
    logp, old, adv, mask = _inputs(ratio)
    cfg = TrainConfig(ratio=ratio, agg=agg, clip_low=clip[0], clip_high=clip[1],
                      transform=transform)
    x = logp.clone().requires_grad_(True)
    loss, metrics = minibatch_loss(cfg, x, old, adv, mask, None)
    (got,) = torch.autograd.grad(loss, x)
    want = _reference_grad(logp, old, adv, mask, agg, ratio, clip, transform)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # the inputs do exercise the clip: some members active, some not, in both signs of A
    assert 0 < metrics["ppo/clip_frac"] < 1
    # the recorded loss value stays the untransformed PPO/GSPO loss
    plain, _ = policy_loss(logp, old, adv, mask, agg, clip=clip, ratio=ratio)
    assert float(loss.detach()) == pytest.approx(float(plain), abs=1e-15)


def test_min_replace_zeroes_a_group_once_a_member_is_clipped_off_policy():
    """Off-policy, a GSPO member whose sequence ratio the clip has taken over has weight 0, so
    Min-Replace gives 0 to every position that member is valid at: in group 0 (members clipped
    on both sides) the positions every member shares get no gradient; in group 2 (none
    clipped) every token does."""
    logp, old, adv, mask = _inputs("sequence")
    cfg = TrainConfig(ratio="sequence", agg="seq-mean-token-mean", clip_low=3e-4,
                      clip_high=4e-4, transform="min_replace")
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(minibatch_loss(cfg, x, old, adv, mask, None)[0], x)
    shared = min(LENGTHS[0])
    assert g[0, :, :shared].abs().max() == 0
    assert (g[2][mask[2]] != 0).all()
