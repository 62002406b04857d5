"""Hand-computed golden values for every scheme (the arithmetic is written out here) and the
numerical edges: G = 1 and near-constant float32 groups."""

from __future__ import annotations

import math

import pytest
import torch

import varbench.estimators as E


def _mask(lengths, T):
    return torch.tensor([[[1.0 if t < L else 0.0 for t in range(T)] for L in lengths]])


# One group: R = [3, 1, 0, 0], lengths [2, 1, 3, 2], T = 3; mu = 1, deviations [2, 0, -1, -1].
R = torch.tensor([[3.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
MASK = _mask([2, 1, 3, 2], 3)


def _per_response(scheme, **kw):
    A = E.advantages(scheme, R, MASK, **kw)
    # Every valid token of a response carries the same value for the outcome schemes.
    first = A[0, :, 0].tolist()
    assert torch.equal(A, torch.where(MASK != 0, A[..., :1], 0))
    return first


def test_golden_raw_centered_rloo():
    assert _per_response("raw") == [3, 1, 0, 0]
    assert _per_response("centered") == [2, 0, -1, -1]
    # rloo: R_i - mean of the other three: 3 - 1/3, 1 - 3/3, 0 - 4/3, 0 - 4/3
    assert _per_response("rloo") == pytest.approx([8 / 3, 0, -4 / 3, -4 / 3], abs=1e-15)


def test_golden_normalized():
    # unbiased var = (4 + 0 + 1 + 1) / 3 = 2; biased = 6 / 4 = 1.5
    s = math.sqrt(2) + 1e-6
    assert _per_response("normalized") == pytest.approx([2 / s, 0, -1 / s, -1 / s], abs=1e-15)
    s = math.sqrt(1.5) + 0.1
    got = _per_response("normalized", unbiased_std=False, eps=0.1)
    assert got == pytest.approx([2 / s, 0, -1 / s, -1 / s], abs=1e-15)


def test_golden_topk():
    # k = 2: 2nd largest reward is 1 -> keep responses 0 and 1 (centered 2 and 0).
    assert _per_response("topk", k=2) == [2, 0, 0, 0]
    # k = 3: 3rd largest is 0, tied with the 4th: both kept -> plain centered.
    assert _per_response("topk", k=3) == [2, 0, -1, -1]
    assert _per_response("topk", k=1) == [2, 0, 0, 0]
    assert _per_response("topk", k=9) == [2, 0, -1, -1]


def test_golden_opo():
    # b = (2*3 + 1*1 + 3*0 + 2*0) / (2 + 1 + 3 + 2) = 7/8
    assert _per_response("opo") == pytest.approx([3 - 7 / 8, 1 - 7 / 8, -7 / 8, -7 / 8])


def test_golden_reinforce_pp_baseline():
    # token values of the centered advantage: resp0 2,2; resp1 0; resp2 -1,-1,-1; resp3 -1,-1
    vals = [2, 2, 0, -1, -1, -1, -1, -1]
    mu = sum(vals) / 8  # = -1/8
    var = sum((v - mu) ** 2 for v in vals) / 7
    want = [(c - mu) / math.sqrt(var + 1e-8) for c in (2, 0, -1, -1)]
    assert _per_response("reinforce_pp_baseline") == pytest.approx(want, abs=1e-14)


def test_golden_passk():
    # R = [1, 0, 0, 0]: N = 4, N- = 3. k = 2: Rbar = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2,
    # sigma = 1/2; correct: (1 - 1/2)/(1/2) = 1; failed: (1/2 - C(2,1)/C(3,1))/(1/2) = -1/3.
    Rb = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    A = E.advantages("passk", Rb, torch.ones(1, 4, 2), k=2)
    assert A[0, :, 1].tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3])
    # k = 1: Rbar = 1/4, sigma = sqrt(3)/4: correct 3/sqrt(3) = sqrt(3), failed -1/sqrt(3).
    A = E.advantages("passk", Rb, torch.ones(1, 4, 2), k=1)
    assert A[0, :, 0].tolist() == pytest.approx([math.sqrt(3)] + [-1 / math.sqrt(3)] * 3)
    # all agree: Rbar in {0, 1}, sigma = 0 -> 0
    assert E.advantages("passk", torch.ones(1, 4), torch.ones(1, 4, 2), k=2).abs().max() == 0


def test_golden_otb_and_tail():
    # R = [1, 0], lengths [3, 1]; w0 = [1, 2, 1], w1 = [2] -> W0 = [1, 3, 4], W1 = [2].
    Ro = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = _mask([3, 1], 3)
    w = torch.tensor([[[1.0, 2.0, 1.0], [2.0, 9.0, 9.0]]], dtype=torch.float64)
    A = E.advantages("otb", Ro, mask, token_weights=w)
    b0 = (1 * 1 + 0 * 2) / (1 + 2 + 1e-8)  # t = 0: both running
    assert A[0, 0].tolist() == pytest.approx([1 - b0, 1, 1], abs=1e-15)  # tail: B = 0
    assert A[0, 1].tolist() == pytest.approx([-b0, 0, 0], abs=1e-15)
    A = E.advantages("otb", Ro, mask, token_weights=w, handle_zero_tail=False)
    # t = 1, 2: only response 0: B = 1*W/(W + 1e-8)
    tail = [1 - 3 / (3 + 1e-8), 1 - 4 / (4 + 1e-8)]
    assert A[0, 0].tolist() == pytest.approx([1 - b0] + tail, abs=1e-15)
    # otb_loo: B^(-0)_0 = 0*2/(2 + eps) = 0; B^(-1)_0 = 1*1/(1 + eps); tail has no others -> 0.
    A = E.advantages("otb_loo", Ro, mask, token_weights=w)
    assert A[0, 0].tolist() == [1, 1, 1]
    assert A[0, 1].tolist() == pytest.approx([-1 / (1 + 1e-8), 0, 0], abs=1e-15)


def test_golden_otb_multi_turn_compaction():
    # R = [1, 0], w = 1. mask0 = [1, 0, 1] (env token at t = 1), mask1 = [1, 1, 0].
    # Compacted, response 0's 2nd generated token (t = 2) meets response 1's (t = 1):
    # c = 0: W = 1, 1 -> B = 1/2;  c = 1: W = 2, 2 -> B = 1/2.
    Ro = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]])
    ones = torch.ones(1, 2, 3, dtype=torch.float64)
    A = E.advantages("otb", Ro, mask, token_weights=ones)
    half = 1 - 1 / (2 + 1e-8)  # 1 - B with B = (1*1 + 0*1) / (1 + 1 + 1e-8)
    assert A[0, 0].tolist() == pytest.approx([0.5, 0, 0.5], abs=1e-8)
    assert A[0, 0, 0].item() == pytest.approx(half, abs=1e-15)
    assert A[0, 1].tolist() == pytest.approx([-0.5, -0.5, 0], abs=1e-8)
    # Without compaction t = 1 and t = 2 each have a single response: tail B = 0 -> A = G_t.
    A = E.advantages("otb", Ro, mask, token_weights=ones, compact=False)
    assert A[0, 0].tolist() == pytest.approx([0.5, 0, 1], abs=1e-8)
    assert A[0, 1].tolist() == pytest.approx([-0.5, 0, 0], abs=1e-8)


def test_golden_token_rewards():
    # r0 = [0, 1, 1] (len 3) -> G0 = [2, 2, 1]; r1 = [1, 0, x] (len 2) -> G1 = [1, 0]; w = 1.
    r = torch.tensor([[[0.0, 1.0, 1.0], [1.0, 0.0, 7.0]]], dtype=torch.float64)
    mask = _mask([3, 2], 3)
    A = E.advantages("otb", r, mask, token_weights=torch.ones(1, 2, 3, dtype=torch.float64))
    # t0: B = (2*1 + 1*1)/2 = 1.5; t1: B = (2*2 + 0*2)/4 = 1; t2: tail -> B = 0.
    assert A[0, 0].tolist() == pytest.approx([0.5, 1, 1], abs=1e-8)
    assert A[0, 1].tolist() == pytest.approx([-0.5, -1, 0], abs=1e-8)
    # Group schemes use the return R_i = sum of valid token rewards: [2, 1] -> centered +-0.5.
    assert E.advantages("centered", r, mask)[0, :, 0].tolist() == [0.5, -0.5]


def test_golden_proxy_and_importance_weights():
    # w = 1 - 2 p + sum_pi_sq: p = 0.5, sum_pi_sq = 0.5 -> w = 0.5; rho = 2 -> w rho^2 = 2.
    lp = torch.full((1, 1, 2), math.log(0.5), dtype=torch.float64)
    sp = torch.full((1, 1, 2), 0.5, dtype=torch.float64)
    rho = torch.full((1, 1, 2), 2.0, dtype=torch.float64)
    opts = dict(logprobs=lp, sum_pi_sq=sp, importance_weights=rho)
    W = E.cumulative_weights(torch.ones(1, 1, 2, dtype=torch.bool), E.SchemeOptions(**opts))
    assert W.tolist() == [[[2.0, 4.0]]]
    assert E.proxy_from_logprobs(lp, sp).tolist() == [[[0.5, 0.5]]]


# ---- G = 1 ---------------------------------------------------------------------------------

G1 = {  # scheme -> expected A for a single response with R = 2.5 (documented conventions)
    "raw": 2.5, "centered": 0.0, "normalized": 2.5, "rloo": 2.5, "topk": 0.0, "opo": 0.0,
    "reinforce_pp_baseline": 0.0, "otb": 2.5, "otb_loo": 2.5,
}


@pytest.mark.parametrize("scheme", sorted(G1))
def test_single_response_groups(scheme):
    R1 = torch.full((3, 1), 2.5)
    kw = {"token_weights": torch.ones(3, 1, 4)} if scheme.startswith("otb") else {}
    A = E.advantages(scheme, R1, torch.ones(3, 1, 4), **kw)
    assert A.tolist() == [[[G1[scheme]] * 4]] * 3
    assert E.advantages("passk", torch.ones(2, 1), torch.ones(2, 1, 3)).abs().max() == 0


# ---- near-constant groups in float32 -------------------------------------------------------


def test_normalized_near_constant_group_float32():
    # Rewards 1.0 vs 1.00001 in float32. d = fl32(1.00001) - 1 (exact, Sterbenz).
    R32 = torch.tensor([[1.0, 1.00001]], dtype=torch.float32)
    d = R32[0, 1].double().item() - 1.0
    sigma = d / math.sqrt(2)  # unbiased std of {0, d}
    want = [-(d / 2) / (sigma + 1e-6), (d / 2) / (sigma + 1e-6)]  # = -+0.6195
    A = E.advantages("normalized", R32, torch.ones(1, 2, 1))
    assert A.dtype == torch.float32
    assert A[0, :, 0].tolist() == pytest.approx(want, rel=1e-6)
    # Documented bound |A| <= (G-1)/sqrt(G): O(1), not ~0, despite a 1e-5 reward difference.
    assert A.abs().max().item() <= 1 / math.sqrt(2)


@pytest.mark.parametrize("unbiased", [True, False])
def test_normalized_bound_and_precision_large_group(unbiased):
    gen = torch.Generator().manual_seed(0)
    G = 16
    R32 = (1.0 + 1e-5 * torch.randint(0, 3, (64, G), generator=gen)).float()
    A = E.advantages("normalized", R32, torch.ones(64, G, 1), unbiased_std=unbiased)[..., 0]
    A64 = E.advantages("normalized", R32.double(), torch.ones(64, G, 1), unbiased_std=unbiased)
    bound = (G - 1) / math.sqrt(G) if unbiased else math.sqrt(G - 1)
    assert A.abs().max().item() <= bound
    # The min-shift keeps float32 as accurate as float64 on the same (rounded) inputs.
    torch.testing.assert_close(A.double(), A64[..., 0], rtol=1e-5, atol=1e-5)
