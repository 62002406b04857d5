"""Known answers of the cancellation analysis (docs/science.md §4) with the estimators'
coefficients; the pipeline on a micro policy. (sample_weights itself is tested in
tests/test_estimators_coefficients.py.)"""

from __future__ import annotations

import pytest
import torch
from _fixtures_estimators import shared_prefix_groups

from varbench.analysis.cancellation import cancellation, sample_weights
from varbench.analysis.trie import shared_steps
from varbench.estimators.registry import advantages
from varbench.models import build_preset
from varbench.tasks import get_task


def _full(mode, transform="none", ratio="token", logp_new=None, scheme="centered"):
    tokens, mask, rewards, logp = shared_prefix_groups()
    adv = advantages(scheme, rewards, mask != 0)
    new = logp if logp_new is None else logp_new
    c = sample_weights(new, logp, adv, mask, mode, ratio=ratio, transform=transform, max_len=5)
    df = shared_steps(tokens, adv, c, mask)
    full = df[df["full_group"]]
    assert len(full) == 4  # two full-group steps per group
    return full, c, adv, mask


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"])
def test_exchangeable_modes_cancel_exactly_at_ratio_one(mode):
    full, *_ = _full(mode)
    assert full["residual"].max() < 1e-15
    assert full["exchangeable"].max() < 1e-15


def test_seq_mean_token_mean_with_unequal_lengths_does_not_cancel():
    full, *_ = _full("seq-mean-token-mean")
    assert (full["residual"] > 1e-3).all()
    assert (full["exchangeable"] < 1e-15).all()  # the whole residual is weighting-induced
    torch.testing.assert_close(
        torch.tensor(full["residual"].to_numpy()),
        torch.tensor((full["weighting_residual"] * full["abs_sum"]).abs().to_numpy()),
    )


def test_gspo_sequence_ratio_breaks_cancellation_after_an_update():
    tokens, mask, rewards, logp = shared_prefix_groups()
    g = torch.Generator().manual_seed(2)
    new = logp + 0.05 * torch.randn(logp.shape, generator=g, dtype=torch.float64) * mask
    full, *_ = _full("seq-mean-token-sum", ratio="sequence", logp_new=new)
    assert (full["residual"] > 1e-6).all()


@pytest.mark.parametrize("transform", ["min_replace", "adv_orthogonal", "adv_orthogonal_position"])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_transforms_restore_cancellation(mode, transform):
    tokens, mask, rewards, logp = shared_prefix_groups()
    g = torch.Generator().manual_seed(3)
    new = logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=torch.float64) * mask
    full, c, adv, m = _full(mode, transform=transform, ratio="sequence", logp_new=new)
    assert full["residual"].max() < 1e-12
    if transform == "adv_orthogonal_position":  # sum_i A_i v~_i = 0 at every position
        assert (c * adv * m).sum(1).abs().max() < 1e-12
    if transform == "adv_orthogonal":
        # the definition: one weight per response (GSPO's s_i and 1/|o_i| are constant over
        # a response), orthogonal to A over the whole group
        v = torch.where(m != 0, c, float("nan")).nanmean(-1)  # [P, G]
        a = adv[..., 0]
        assert torch.allclose(c, torch.where(m != 0, v.unsqueeze(-1), 0), atol=1e-15)
        assert (a * v).sum(1).abs().max() < 1e-12


def test_adv_orthogonal_per_response_differs_from_per_position_at_partial_steps():
    """Side by side: at ratio 1 under seq-mean-token-sum (exchangeable, centered A), the
    per-response transform leaves every weight at 1/B (nothing to remove), while the
    per-position variant changes the weights where only some responses are still running."""
    tokens, mask, rewards, logp = shared_prefix_groups()
    adv = advantages("centered", rewards, mask != 0)
    base = sample_weights(logp, logp, adv, mask, "seq-mean-token-sum", max_len=5)
    resp = sample_weights(logp, logp, adv, mask, "seq-mean-token-sum", max_len=5,
                          transform="adv_orthogonal")
    pos = sample_weights(logp, logp, adv, mask, "seq-mean-token-sum", max_len=5,
                         transform="adv_orthogonal_position")
    assert torch.equal(resp, base)
    partial = (mask != 0).sum(1, keepdim=True) < mask.shape[1]
    assert ((pos - base).abs() * partial * (mask != 0)).max() > 1e-6


@pytest.fixture(scope="module")
def peaked_policy():
    """A micro policy with a sharpened head, so sampled groups share prefixes."""
    pol = build_preset("micro", seed=0)
    with torch.no_grad():
        pol.model.lm_head.weight.mul_(30)
    return pol


def test_pipeline_records_and_grad_ratio(peaked_policy, tmp_path):
    task = get_task("sort", n=3, max_value=2)
    res = cancellation(peaked_policy, [task], n_prompts=3, G=4, reward="inclusion_adjacency",
                       modes=["seq-mean-token-sum", "seq-mean-token-mean"],
                       ratios=["token"], inner_steps=[0], transforms=["none"], sketch_dim=64,
                       cache_dir=str(tmp_path))
    conf = res.records["configs"].set_index("mode")
    nodes = res.records["nodes"]
    assert set(conf.index) == {"seq-mean-token-sum", "seq-mean-token-mean"}
    assert conf["n_shared"].min() > 0
    # Fixed length and ratio 1: every mode is exchangeable, full-group steps (if any) cancel.
    full = nodes[nodes["full_group"]]
    assert (full["residual"] < 1e-6).all()
    ok = nodes.dropna(subset=["grad_ratio"])
    assert len(ok) > 0
    # At a shared step every member has the same gradient: sketch ratio == scalar ratio.
    torch.testing.assert_close(torch.tensor(ok["grad_ratio"].to_numpy()),
                               torch.tensor(ok["scalar_ratio"].to_numpy()), rtol=1e-4, atol=1e-6)
    assert len(res.records["token_ids"]) > 0
    assert all(h.se is None or h.se >= 0 for h in res.headlines)


def test_bad_input(peaked_policy):
    task = get_task("sort", n=2)
    with pytest.raises(ValueError, match="modes"):
        cancellation(peaked_policy, [task], modes=["mean"])
    with pytest.raises(ValueError, match="transform"):
        cancellation(peaked_policy, [task], transforms=["max_replace"])
    with pytest.raises(ValueError, match="tasks"):
        cancellation(peaked_policy, [])
    with pytest.raises(ValueError, match=r"modes=\[\] is empty"):
        cancellation(peaked_policy, [task], modes=[])
    with pytest.raises(ValueError, match=r"ratios=\[\] is empty"):
        cancellation(peaked_policy, [task], ratios=[])
    with pytest.raises(ValueError, match="lr=inf"):
        cancellation(peaked_policy, [task], lr=float("inf"))


def test_headlines_rest_on_weighting_residual_and_grad_ratio_with_counts():
    import pandas as pd

    from varbench.analysis.cancellation import MIN_STEPS, _headlines

    base = {"task": "arith", "mode": "seq-mean-token-mean", "ratio": "token", "inner_steps": 0,
            "transform": "none", "shared_abs_weighting_rel": 0.02,
            "shared_abs_weighting_rel_se": 0.005, "full_abs_weighting_rel": 0.0,
            "grad_ratio": 0.9, "grad_ratio_se": 0.01}
    conf = pd.DataFrame([
        {**base, "config": "a", "n_shared_active": 40, "n_shared_groups": 8, "n_full": 2,
         "n_full_active": 1, "n_grad_steps": 40, "n_grad_groups": 8},
        {**base, "config": "b", "n_shared_active": MIN_STEPS - 1, "n_shared_groups": 2,
         "n_full": 2, "n_full_active": 1, "n_grad_steps": 0, "n_grad_groups": 0},
    ])
    heads, notes = _headlines(conf)
    keys = [h.key for h in heads]
    assert keys == ["arith:a:weighting_residual", "arith:a:grad_ratio",
                    "arith:b:weighting_residual"]
    assert "over 40 active shared steps in 8 groups" in heads[0].text
    assert "WARNING" not in heads[0].text and "WARNING" in heads[2].text
    # full-group steps counted with the inactive ones (an all-agree group's step did occur)
    assert any("2 full-group shared steps occurred, 1 of them active" in n for n in notes)
    assert not any("no full-group shared steps" in n for n in notes)
