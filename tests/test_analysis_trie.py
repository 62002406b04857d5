"""Tests of varbench.analysis.trie: prefix-trie shared steps and cancellation diagnostics."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from varbench.analysis.trie import prefix_node_ids, shared_steps, token_net_weight


def _random_groups(seed, P=3, G=5, T=6, V=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (P, G, T), generator=g)
    lengths = torch.randint(1, T + 1, (P, G), generator=g)
    mask = (torch.arange(T) < lengths[..., None]).float()
    return tokens * mask.long(), mask, g


def _brute_shared(tokens, mask):
    """Reference: compare prefixes pairwise; returns {(p, t, frozenset(members))}."""
    P, G, T = tokens.shape
    out = set()
    for p, t in itertools.product(range(P), range(T)):
        live = [i for i in range(G) if mask[p, i, t] != 0]
        classes: dict[tuple, list[int]] = {}
        for i in live:
            classes.setdefault(tuple(tokens[p, i, : t + 1].tolist()), []).append(i)
        for members in classes.values():
            out.add((p, t, frozenset(members)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_node_ids_match_brute_force(seed):
    tokens, mask, _ = _random_groups(seed)
    ids = prefix_node_ids(tokens, mask)
    got = set()
    P, G, T = tokens.shape
    for p, t in itertools.product(range(P), range(T)):
        by_id: dict[int, list[int]] = {}
        for i in range(G):
            if ids[p, i, t] >= 0:
                by_id.setdefault(int(ids[p, i, t]), []).append(i)
        got |= {(p, t, frozenset(m)) for m in by_id.values()}
    assert got == _brute_shared(tokens, mask)
    assert (ids[mask == 0] == -1).all()


def test_env_tokens_are_context_not_steps():
    # Responses agree on policy tokens but differ in a tool output at t=1: they stop sharing.
    tokens = torch.tensor([[[5, 7, 3], [5, 8, 3], [5, 7, 3]]])
    env = torch.tensor([[[0, 1, 0]] * 3])
    mask = 1 - env
    ids = prefix_node_ids(tokens, mask, env)
    assert ids[0, :, 0].unique().numel() == 1
    assert (ids[0, :, 1] == -1).all()
    assert ids[0, 0, 2] == ids[0, 2, 2] != ids[0, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_diagnostics_match_loop(seed):
    tokens, mask, g = _random_groups(seed, V=2)
    adv = torch.randn(tokens.shape, generator=g, dtype=torch.float64) * mask
    coef = torch.rand(tokens.shape, generator=g, dtype=torch.float64) * mask
    df = shared_steps(tokens, adv, coef, mask)
    want = {}
    for p, t, members in _brute_shared(tokens, mask):
        if len(members) < 2:
            continue
        idx = sorted(members)
        a = adv[p, idx, t].numpy()
        c = coef[p, idx, t].numpy()
        wres = ((a - a.mean()) * (c - c.mean())).sum() / np.abs(a * c).sum()
        want[(p, t, int(tokens[p, idx[0], t]), len(idx))] = (
            abs((c * a).sum()), abs(c.mean() * a.sum()), wres
        )
    got = {
        (r.p, r.t, r.token, r.size): (r.residual, r.exchangeable, r.weighting_residual)
        for r in df.itertuples()
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-12, atol=1e-15)


def test_residual_decomposition_identity():
    tokens, mask, g = _random_groups(7, V=2)
    adv = torch.randn(tokens.shape, generator=g, dtype=torch.float64) * mask
    coef = torch.rand(tokens.shape, generator=g, dtype=torch.float64) * mask
    df = shared_steps(tokens, adv, coef, mask)
    signed_exch = df["residual"]  # |c_bar sum A + sum dA dc| = residual
    ex = df["exchangeable"]
    w = df["weighting_residual"] * df["abs_sum"]
    assert (signed_exch <= ex + w.abs() + 1e-12).all()
    assert (signed_exch >= (ex - w.abs()).abs() - 1e-12).all()


def _full_share_batch():
    # Group of 4: all share the first two tokens; lengths 2, 3, 4, 4.
    tokens = torch.tensor([[[1, 2, 0, 0], [1, 2, 3, 0], [1, 2, 3, 4], [1, 2, 5, 6]]])
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]]).double()
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    adv = (r - r.mean(-1, keepdim=True))[..., None] * mask
    return tokens, mask, adv


def test_known_answer_constant_weight_cancels_exactly():
    tokens, mask, adv = _full_share_batch()
    coef = mask / 4  # seq-mean-token-sum with ratio 1: the same weight for every response
    df = shared_steps(tokens, adv, coef, mask)
    full = df[df["full_group"]]
    assert len(full) == 2
    assert full["residual"].max() < 1e-15 and full["exchangeable"].max() < 1e-15


def test_known_answer_length_normalisation_breaks_cancellation():
    tokens, mask, adv = _full_share_batch()
    coef = mask / (4 * mask.sum(-1, keepdim=True))  # seq-mean-token-mean, unequal lengths
    df = shared_steps(tokens, adv, coef, mask)
    full = df[df["full_group"]]
    assert (full["exchangeable"] < 1e-15).all()
    assert (full["residual"] > 1e-3).all()
    np.testing.assert_allclose(full["residual"], full["weighting_residual"].abs() * full["abs_sum"])


def test_grad_ratio_equals_scalar_ratio_when_shared_grads_agree():
    tokens, mask, g = _random_groups(11, V=2)
    adv = torch.randn(tokens.shape, generator=g, dtype=torch.float64) * mask
    coef = torch.rand(tokens.shape, generator=g, dtype=torch.float64) * mask
    # A gradient that depends only on the prefix: identical within a trie node.
    ids = prefix_node_ids(tokens, mask)
    t_idx = torch.arange(tokens.shape[2]).expand_as(ids)
    emb = torch.randn(1000, 8, generator=g, dtype=torch.float64)
    grads = emb[(ids.clamp(min=0) * 37 + t_idx * 11 + torch.arange(3)[:, None, None] * 5) % 1000]
    df = shared_steps(tokens, adv, coef, mask, token_grads=grads).dropna(subset=["grad_ratio"])
    assert len(df) > 0
    np.testing.assert_allclose(df["grad_ratio"], df["scalar_ratio"], rtol=1e-10)


def test_token_net_weight():
    tokens = torch.tensor([[[1, 2], [1, 3]]])
    mask = torch.ones(1, 2, 2)
    adv = torch.tensor([[[1.0, 1.0], [-1.0, -1.0]]])
    coef = torch.tensor([[[0.5, 0.5], [0.25, 0.25]]])
    df = token_net_weight(tokens, adv, coef, mask).set_index("token")
    assert df.loc[1, "count"] == 2 and df.loc[1, "net_weight"] == pytest.approx(0.25)
    assert df.loc[1, "abs_weight"] == pytest.approx(0.75)
    assert df.loc[3, "net_weight"] == pytest.approx(-0.25)
    assert list(df.index)[0] == 1  # most frequent first


def test_bad_shapes():
    tokens, mask, _ = _random_groups(0)
    with pytest.raises(ValueError, match="adv"):
        shared_steps(tokens, torch.zeros(2, 2, 2), mask, mask)
