"""Hypothesis property tests of the estimator algebra (float64 inputs)."""

from __future__ import annotations

import torch
from _fixtures_estimators import random_case
from hypothesis import given, settings
from hypothesis import strategies as st

import varbench.estimators as E

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
    G = max(G, 2)  # G = 1 conventions are tested in test_estimators_golden
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
    if scheme.startswith("otb"):
        assert A.abs().max().item() < 1e-6  # R * 1e-8 / (W + 1e-8) with W >= 1e-3 here
    else:
        assert A.abs().max().item() == 0.0  # exact: R - min(R) = 0


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


@SETTINGS
@given(shapes, st.booleans())
def test_transforms_cancel_the_shared_step(shape, per_token):
    P, G, T, seed = shape
    rewards, mask, _ = random_case(P, G, T, seed)
    gen = torch.Generator().manual_seed(seed)
    A = E.advantages("centered", rewards, mask)[..., 0]  # [P, G], every response has t = 0
    v = torch.rand(P, G, generator=gen, dtype=torch.float64) + 0.1
    if per_token:
        A, v = A.unsqueeze(-1).expand(P, G, T), v.unsqueeze(-1) * torch.rand(
            P, G, T, generator=gen, dtype=torch.float64
        )
        A = torch.where(mask, A, 0)
    m = mask if per_token else None
    ortho = E.adv_orthogonal(v, torch.randn(v.shape, generator=gen, dtype=torch.float64), m)
    r = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    assert ((E.adv_orthogonal(v, r, m) * r).sum(1).abs() < 1e-12).all()
    assert ((E.adv_orthogonal(v, A, m) * A).sum(1).abs() < 1e-12).all()
    # Min-Replace cancels against centered advantages (sum_i A_i = 0 over the group); in the
    # per-token case at positions every response reaches (t = 0).
    mr = E.min_replace(v, m)
    prod = (mr * A).sum(1)
    assert (prod[..., 0].abs() < 1e-12).all() if per_token else (prod.abs() < 1e-12).all()
    assert ortho.shape == v.shape
