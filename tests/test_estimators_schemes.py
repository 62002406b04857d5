"""varbench.estimators.schemes: the group schemes (raw, centered, normalized, rloo, topk, opo,
reinforce_pp_baseline, passk) against the loop references and hand-computed golden values, the
numerical edges (G = 1, near-constant float32 groups), and the property tests every built-in
scheme must pass (otb included: its own properties are in tests/test_estimators_otb.py)."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_estimators import random_case
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_estimators import passk_bruteforce, ref_advantages

import varbench.estimators as E

OUTCOME = ["raw", "centered", "normalized", "rloo", "topk", "opo", "reinforce_pp_baseline"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scheme", OUTCOME)
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_matches_loop_reference_float64(scheme, seed, token_rewards, multi_turn):
    # Shapes vary with the seed; tolerance 1e-9 absolute on float64 (sums of <= 10 terms).
    # (otb and otb_loo: the same test in tests/test_estimators_otb.py.)
    P, G, T = 2 + seed % 2, 1 + (seed * 3) % 5, 3 + seed
    rewards, mask, opts = random_case(
        P, G, T, seed, token_rewards=token_rewards, multi_turn=multi_turn, allow_empty=True
    )
    kw = {}
    if scheme == "topk":
        kw = {"k": 1 + seed % 3}
    if scheme == "normalized" and seed % 2:
        kw = {"unbiased_std": False, "eps": 1e-3}
    got = E.advantages(scheme, rewards, mask, **kw)
    want = ref_advantages(scheme, rewards, mask, **kw)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_passk_matches_loop_and_bruteforce(seed):
    G = 2 + seed
    rewards, mask, _ = random_case(5, G, 3, seed, binary=True)
    for k in range(1, G + 1):
        got = E.advantages("passk", rewards, mask, k=k)
        torch.testing.assert_close(got, ref_advantages("passk", rewards, mask, k=k))
        for p in range(5):
            brute = passk_bruteforce(rewards[p].tolist(), k)
            row = [got[p, i][mask[p, i]][0].item() for i in range(G)]
            assert row == pytest.approx(brute, abs=1e-12)


# ---- golden values (the arithmetic is written out here) ------------------------------------


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


# ---- properties (Hypothesis, float64 inputs) -----------------------------------------------


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


BASELINE = ["centered", "normalized", "rloo", "topk", "opo", "reinforce_pp_baseline"]


ALL = ["raw", *BASELINE, "passk", "otb", "otb_loo"]


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.integers(0, 10_000)
)


def _kw(scheme, opts, **extra):
    if scheme.startswith("otb"):
        return {k: opts[k] for k in ("logprobs", "sum_pi_sq", "importance_weights")} | extra
    if scheme == "topk":
        return {"k": 2}
    return {}


@SETTINGS
@given(shapes, st.sampled_from(ALL), st.booleans(), st.booleans())
def test_permutation_equivariance(shape, scheme, multi_turn, token_rewards):
    P, G, T, seed = shape
    binary = scheme == "passk"
    rewards, mask, opts = random_case(P, G, T, seed, multi_turn=multi_turn, binary=binary,
                                      token_rewards=token_rewards and not binary)
    kw = _kw(scheme, opts)
    perm = torch.randperm(G, generator=torch.Generator().manual_seed(seed))
    A = E.advantages(scheme, rewards, mask, **kw)
    kw_p = {k: v[:, perm] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    A_p = E.advantages(scheme, rewards[:, perm], mask[:, perm], **kw_p)
    torch.testing.assert_close(A_p, A[:, perm], atol=1e-12, rtol=1e-10)


@SETTINGS
@given(shapes, st.sampled_from(ALL), st.booleans())
def test_masked_positions_zero_and_masked_inputs_do_not_leak(shape, scheme, multi_turn):
    P, G, T, seed = shape
    binary = scheme == "passk"
    rewards, mask, opts = random_case(P, G, T, seed, multi_turn=multi_turn, binary=binary,
                                      token_rewards=not binary, allow_empty=True)
    if binary:
        rewards = rewards.unsqueeze(-1).expand(P, G, T) * mask  # token rewards, 0/1 returns
        rewards = torch.where(mask.cumsum(-1) == mask.sum(-1, keepdim=True), rewards, 0)
    kw = _kw(scheme, opts)
    A = E.advantages(scheme, rewards, mask, **kw)
    assert (A[~mask] == 0).all()
    gen = torch.Generator().manual_seed(seed + 1)

    def scramble(x):
        return torch.where(mask, x, 10 * torch.randn(x.shape, generator=gen, dtype=x.dtype))

    kw_s = {k: scramble(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    A_s = E.advantages(scheme, scramble(rewards), mask, **kw_s)
    assert torch.equal(A, A_s)


@SETTINGS
@given(shapes, st.sampled_from([*BASELINE, "otb", "otb_loo"]), st.floats(-50, 50))
def test_shift_invariance(shape, scheme, c):
    P, G, T, seed = shape
    G = max(G, 2)  # G = 1: normalized, rloo, otb_loo return R (no baseline), not invariant
    rewards, mask, opts = random_case(P, G, T, seed)
    if scheme == "otb_loo":
        mask = torch.ones_like(mask)  # the leave-one-out tail (A = R) is not shift invariant
    kw = _kw(scheme, opts, handle_zero_tail=False) if scheme.startswith("otb") else _kw(scheme,
                                                                                        opts)
    A = E.advantages(scheme, rewards, mask, **kw)
    A_c = E.advantages(scheme, rewards + c, mask, **kw)
    # otb's +1e-8 in the denominator makes B shift by c * W/(W + 1e-8): |error| <= |c| 1e-8/W.
    tol = 1e-5 if scheme.startswith("otb") else 1e-9
    torch.testing.assert_close(A_c, A, atol=tol * (1 + abs(c)), rtol=0)


@SETTINGS
@given(shapes, st.sampled_from([*BASELINE, "passk", "otb", "otb_loo"]), st.booleans())
def test_all_agree_groups_give_zero(shape, scheme, multi_turn):
    P, G, T, seed = shape
    G = max(G, 2)  # G = 1 conventions: test_single_response_groups above
    rewards, mask, opts = random_case(P, G, T, seed, multi_turn=multi_turn)
    level = (torch.arange(P, dtype=torch.float64) % 2).unsqueeze(-1)  # 0/1 levels per group
    rewards = level.expand(P, G).clone()
    if scheme == "reinforce_pp_baseline":
        mask = torch.ones_like(mask)  # batch re-centring is 0 only with equal lengths (doc'd)
    if scheme == "otb_loo":
        mask = torch.ones_like(mask)  # otherwise its tail keeps A = R by construction
    kw = _kw(scheme, opts, handle_zero_tail=False) if scheme.startswith("otb") else _kw(scheme,
                                                                                        opts)
    A = E.advantages(scheme, rewards, mask, **kw)
    # exact: R - min(R) = 0; OTB detects the all-agree group (B = R exactly)
    assert A.abs().max().item() == 0.0


@SETTINGS
@given(shapes)
def test_rloo_is_rescaled_centered(shape):
    P, G, T, seed = shape
    G = max(G, 2)
    rewards, mask, _ = random_case(P, G, T, seed)
    torch.testing.assert_close(
        E.advantages("rloo", rewards, mask),
        G / (G - 1) * E.advantages("centered", rewards, mask),
        atol=1e-12, rtol=1e-12,
    )
