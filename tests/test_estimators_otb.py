"""varbench.estimators.otb: otb / otb_loo against the loop reference and golden values, the
aligned fast paths, prefix detection, the baseline accessor and cumulative weights."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_estimators import random_case
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_estimators import ref_advantages

import varbench.estimators as E


def _opts_for(scheme, opts, variant):
    if scheme not in ("otb", "otb_loo"):
        return {}
    if variant == "weights":
        return {"token_weights": opts["token_weights"]}
    if variant == "proxy_rho":
        return {k: opts[k] for k in ("logprobs", "sum_pi_sq", "importance_weights")}
    return {"token_weights": opts["token_weights"], "handle_zero_tail": False}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scheme", ["otb", "otb_loo"])
@pytest.mark.parametrize("token_rewards", [False, True])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_matches_loop_reference_float64(scheme, seed, token_rewards, multi_turn):
    # Shapes vary with the seed; tolerance 1e-9 absolute on float64 (sums of <= 10 terms).
    # (The outcome schemes: the same test in tests/test_estimators_schemes.py.)
    P, G, T = 2 + seed % 2, 1 + (seed * 3) % 5, 3 + seed
    rewards, mask, opts = random_case(
        P, G, T, seed, token_rewards=token_rewards, multi_turn=multi_turn, allow_empty=True
    )
    variant = ["weights", "proxy_rho", "no_tail"][seed % 3]
    kw = _opts_for(scheme, opts, variant)
    got = E.advantages(scheme, rewards, mask, **kw)
    want = ref_advantages(scheme, rewards, mask, **kw)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_otb_baseline_accessor_matches_advantages():
    rewards, mask, opts = random_case(3, 4, 6, 0, multi_turn=True)
    kw = {"token_weights": opts["token_weights"]}
    B = E.otb_baseline(rewards, mask, **kw)
    A = E.advantages("otb", rewards, mask, **kw)
    torch.testing.assert_close(A, torch.where(mask, rewards.unsqueeze(-1) - B, 0))
    Bl = E.otb_baseline(rewards, mask, leave_one_out=True, **kw)
    Al = E.advantages("otb_loo", rewards, mask, **kw)
    torch.testing.assert_close(Al, torch.where(mask, rewards.unsqueeze(-1) - Bl, 0))


def test_compact_false_aligns_raw_positions():
    rewards, mask, opts = random_case(2, 3, 6, 1, multi_turn=True)
    kw = {"token_weights": opts["token_weights"], "compact": False}
    torch.testing.assert_close(
        E.advantages("otb", rewards, mask, **kw), ref_advantages("otb", rewards, mask, **kw)
    )


@pytest.mark.parametrize(
    ("rows", "want"),
    [
        ([[1, 1, 1], [1, 0, 0], [0, 0, 0]], [3, 1, 0]),
        ([[1, 0, 1], [1, 1, 0], [1, 1, 1]], None),  # a hole after the first 0
        ([[0, 1, 1], [1, 1, 1], [1, 1, 1]], None),  # starts with 0 then valid tokens
        ([[1, 1, 0], [0, 0, 0], [1, 1, 1]], [2, 0, 3]),
    ],
)
def test_prefix_lengths_detects_holes(rows, want):
    from varbench.estimators.otb import _prefix_lengths

    mask = torch.tensor(rows, dtype=torch.bool).unsqueeze(0)
    got = _prefix_lengths(mask)
    if want is None:
        assert got is None
    else:
        assert got.tolist() == [want]


@pytest.mark.parametrize("seed", range(3))
def test_otb_aligned_fast_path_matches_generic_path(seed):
    # Prefix masks + outcome rewards take the aligned paths; the same rewards given as token
    # rewards on the last valid token take the generic [P, G, T] path. Lengths include 0 and T.
    rewards, mask, opts = random_case(6, 5, 7, seed, allow_empty=True)
    mask[1, 2] = True
    tok = E.outcome_to_token_rewards(rewards, mask)
    for scheme in ("otb", "otb_loo"):
        for tail in (True, False):
            kw = {"token_weights": opts["token_weights"], "handle_zero_tail": tail}
            fast = E.advantages(scheme, rewards, mask, **kw)
            slow = E.advantages(scheme, tok, mask, **kw)
            torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
            ref = ref_advantages(scheme, rewards, mask, **kw)
            torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-9)


# ---- golden values (the arithmetic is written out here) ------------------------------------


def _mask(lengths, T):
    return torch.tensor([[[1.0 if t < L else 0.0 for t in range(T)] for L in lengths]])


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


# ---- properties (Hypothesis, float64 inputs) -----------------------------------------------


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.integers(0, 10_000)
)


@SETTINGS
@given(shapes, st.floats(0.1, 5))
def test_otb_constant_w_equal_lengths_is_centered_and_loo_is_rloo(shape, w):
    P, G, T, seed = shape
    G = max(G, 2)
    rewards, _, _ = random_case(P, G, T, seed)
    mask = torch.ones(P, G, T, dtype=torch.bool)
    tw = torch.full((P, G, T), w, dtype=torch.float64)
    # Only the 1e-8 in B's denominator differs: |error| <= max|R| * 1e-8 / W with W >= w.
    tol = 2e-8 / w * (1 + rewards.abs().max().item())
    otb = E.advantages("otb", rewards, mask, token_weights=tw)
    torch.testing.assert_close(otb, E.advantages("centered", rewards, mask), atol=tol, rtol=0)
    loo = E.advantages("otb_loo", rewards, mask, token_weights=tw)
    torch.testing.assert_close(loo, E.advantages("rloo", rewards, mask), atol=tol, rtol=0)


@SETTINGS
@given(shapes, st.booleans())
def test_otb_with_length_weights_is_opo_where_all_run(shape, multi_turn):
    P, G, T, seed = shape
    rewards, mask, _ = random_case(P, G, T, seed, multi_turn=multi_turn)
    lengths = mask.sum(-1, keepdim=True).to(torch.float64).expand(P, G, T)
    otb = E.advantages("otb", rewards, mask, cumulative_weights=lengths)
    opo = E.advantages("opo", rewards, mask)
    # compacted position c is reached by every response iff c < min length of the group
    c = mask.cumsum(-1) - 1
    everyone = mask & (c < mask.sum(-1).amin(dim=1, keepdim=True).unsqueeze(-1))
    if G == 1:
        everyone = everyone & False  # a lone response is the tail: B = 0 by handle_zero_tail
    torch.testing.assert_close(otb[everyone], opo[everyone], atol=1e-7, rtol=0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 4), st.integers(2, 6), st.integers(1, 7), st.integers(0, 10_000),
       st.sampled_from(["otb", "otb_loo"]), st.sampled_from(["weights", "proxy", "cumulative"]),
       st.sampled_from([torch.float32, torch.float64]), st.booleans(), st.booleans())
def test_all_agree_groups_are_exactly_zero_with_random_weights(
        P, G, T, seed, scheme, source, dtype, multi_turn, token_rewards):
    """Every group with one reward level (random, not 0/1) gets A == 0 exactly wherever the
    baseline formula applies (>= 2 responses running), in float32 and float64, for each way the
    weights arrive; mixed groups in the same batch are unchanged from the formula."""
    rewards, mask, opts = random_case(P, G, T, seed, multi_turn=multi_turn, dtype=dtype,
                                      token_rewards=token_rewards)
    gen = torch.Generator().manual_seed(seed + 1)
    level = torch.randn(P, 1, generator=gen, dtype=dtype) * 3
    agree = torch.arange(P) % 2 == 0  # even groups agree, odd ones keep random rewards
    if token_rewards:
        # one return in every valid token: the last valid token carries the level
        last = mask.cumsum(-1) == mask.sum(-1, keepdim=True)
        flat = torch.where(mask & last, level.unsqueeze(-1), 0)
        rewards = torch.where(agree.view(-1, 1, 1), flat, rewards)
    else:
        rewards = torch.where(agree.view(-1, 1), level.expand(P, G), rewards)
    kw = {"weights": {"token_weights": opts["token_weights"].to(dtype)},
          "proxy": {k: opts[k].to(dtype) for k in ("logprobs", "sum_pi_sq")},
          "cumulative": {"cumulative_weights": opts["token_weights"].to(dtype).cumsum(-1)}}[source]
    A = E.advantages(scheme, rewards, mask, **kw)
    if token_rewards:
        # a reward-to-go is constant only when no reward precedes a later valid token
        rtg = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), 0)
        agree = agree & torch.tensor([bool((rtg[p][mask[p]] == level[p]).all())
                                      for p in range(P)])
    # responses running at each token's compacted position (its generated-token count)
    pos = mask.cumsum(-1) - 1
    n = mask.sum(-1)  # [P, G]
    running = (n[:, None, None, :] > pos[..., None]).sum(-1) >= 2
    sel = agree.view(-1, 1, 1) & mask & running
    assert sel.any() or not agree.any() or not running.any()
    assert A[sel].abs().max().item() == 0.0 if sel.any() else True
    # the other groups: the formula as before (the float64 loop reference)
    if dtype == torch.float64:
        want = ref_advantages(scheme, rewards, mask, **kw)
        keep = ~agree.view(-1, 1, 1) & mask
        torch.testing.assert_close(A[keep], want[keep], atol=1e-9, rtol=1e-9)
