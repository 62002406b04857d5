"""Tests of the variance analysis: shared-vector estimates vs autograd, resume, bias.

The count sketch and token_vectors themselves are tested in test_grads_vectors.py."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import varbench.analysis.variance as varmod
from varbench.analysis.variance import estimator_variance, group_advantages, group_estimates
from varbench.estimators.loss import policy_loss
from varbench.grads.vectors import token_vectors
from varbench.models import build_preset, forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.sampler import sample
from varbench.stats.estimates import variance_stats
from varbench.tasks import get_task


@pytest.fixture(scope="module")
def micro64():
    return build_preset("micro", seed=1, dtype=torch.float64)


@pytest.fixture(scope="module")
def arith_batch(micro64):
    task = get_task("arith", digits=1)
    return sample(micro64, task, task.prompts(1, seed=0), 6, seed=0, max_new_tokens=5)


@pytest.fixture(scope="module")
def flat_vectors(micro64, arith_batch):
    return token_vectors(micro64.model, arith_batch, sketch_dim=None)


def test_group_estimates_match_autograd(micro64, arith_batch, flat_vectors):
    """sum_{i,t} c v (flat shared vectors) == -grad policy_loss of each group (ratio 1)."""
    model, b, tv = micro64.model, arith_batch, flat_vectors
    M, G = 2, 3  # the 6 responses as 2 groups of 3
    T = b.T
    mask = (b.mask != 0).reshape(M, G, T)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 2.0]], dtype=torch.float64)
    logp = b.logprobs.reshape(M, G, T)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = b.flat()
    logits = forward_logits(model, flat.input_ids, flat.attention_mask).logits
    lp = b.to_groups(token_logprobs(logits, flat.input_ids) * flat.response_mask).reshape(M, G, T)
    for label in ("centered", "otb", "otb_exact"):
        adv = group_advantages(label, rewards, mask, logp, b.sum_pi_sq.reshape(M, G, T),
                               tv.token_sq.reshape(M, G, T))
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            est = group_estimates(tv.vec.reshape(M, G, T, -1), adv, mask.double(), logp, mode,
                                  max_len=5)
            for m in range(M):
                loss, _ = policy_loss(lp[m : m + 1], logp[m : m + 1].detach(), adv[m : m + 1],
                                      mask[m : m + 1], mode, max_len=5)
                g = torch.autograd.grad(loss, params, retain_graph=True)
                want = -torch.cat([x.reshape(-1) for x in g])
                # Stock attention/RMSNorm compute in float32 inside the float64 model, which
                # caps agreement near 1e-7.
                torch.testing.assert_close(est[m], want, rtol=1e-5, atol=1e-7)


def test_rloo_is_scaled_centered_on_shared_groups(arith_batch, flat_vectors):
    tv = flat_vectors
    M, G, T = 3, 2, arith_batch.T
    mask = (arith_batch.mask != 0).reshape(M, G, T)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.5]], dtype=torch.float64)
    logp = arith_batch.logprobs.reshape(M, G, T)
    ests = {}
    for label in ("centered", "rloo", "otb_loo"):
        adv = group_advantages(label, rewards, mask, logp, arith_batch.sum_pi_sq.reshape(M, G, T),
                               tv.token_sq.reshape(M, G, T))
        ests[label] = group_estimates(tv.vec.reshape(M, G, T, -1), adv, mask.double(), logp,
                                      "seq-mean-token-sum", max_len=5)
    torch.testing.assert_close(ests["rloo"], 2 * ests["centered"])  # G/(G-1) = 2
    v_c = variance_stats(ests["centered"])["variance"][0]
    assert variance_stats(ests["rloo"])["variance"][0] == pytest.approx(4 * v_c, rel=1e-9)


def _run(pol, tmp_path, **kw):
    task = get_task("sort", n=2, max_value=2)
    # Reward "exact": the oracle's support is the one correct response (a cheap reference).
    args = dict(schemes=["raw", "centered", "otb", "otb_exact"], Gs=(2, 3), M=4, n_prompts=1,
                reward="exact", sketch_dim=64, cache_dir=str(tmp_path), min_responses=0)
    args.update(kw)
    return estimator_variance(pol, task, **args)


def test_analysis_records_and_resume(tmp_path, monkeypatch):
    pol = build_preset("micro", seed=0)
    res = _run(pol, tmp_path)
    cells = res.records["cells"]
    assert set(cells["scheme"]) == {"raw", "centered", "otb", "otb_exact"}
    assert set(cells["G"]) == {2, 3}
    assert (cells["variance"] >= 0).all() and cells["variance_se"].notna().all()
    assert res.records["reference"]["reference"].iloc[0].startswith("exact enumeration of 900")
    # ratios to centered, and otb to otb_exact (what the proxy costs)
    assert set(res.records["paired"]["baseline"]) == {"centered", "otb_exact"}
    assert set(cells["method"]) == {"mc"}  # 900 x 2 tokens: over table_limit, Monte Carlo
    for k in ("projection", "mse", "variance"):
        assert (cells[f"{k}_ci_low"] <= cells[k]).all()
        assert (cells[k] <= cells[f"{k}_ci_high"]).all()
    # sketched: the sketch's error is in the SE wherever there is a variance to sketch
    assert ((cells["variance_sketch_sd"] > 0) | (cells["variance"] == 0)).all()
    assert any("Sampling is shared across schemes" in n for n in res.notes)

    def boom(*a, **k):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(varmod, "sample", boom)
    again = _run(pol, tmp_path)
    for k in ("cells", "paired", "reference"):
        pd.testing.assert_frame_equal(again.records[k], res.records[k], rtol=1e-12), k


def test_bad_input(tmp_path):
    pol = build_preset("micro", seed=0)
    with pytest.raises(ValueError, match="schemes"):
        _run(pol, tmp_path, schemes=["nope"])
    with pytest.raises(ValueError, match="Gs"):
        _run(pol, tmp_path, Gs=(1, 2))
    with pytest.raises(ValueError, match="reference='exact'"):
        estimator_variance(pol, get_task("arith"), reference="exact")
    with pytest.raises(ValueError, match="M="):
        _run(pol, tmp_path, M=2)
    for arg in ("Gs", "schemes", "modes"):  # empty lists: an empty report, exit 0 before
        with pytest.raises(ValueError, match=rf"{arg}=\[\] is empty"):
            _run(pol, tmp_path, **{arg: []})
    for bad in ("many", -1, 1.5):
        with pytest.raises(ValueError, match="min_responses"):
            _run(pol, tmp_path, min_responses=bad)


@pytest.mark.slow
def test_unbiasedness_against_exact_reference(micro64):
    """rloo is unbiased; centered has E[g_hat] = (G-1)/G g* (docs/science.md section 2.1)."""
    task = get_task("sort", n=2, max_value=1)
    res = estimator_variance(micro64, task, schemes=["rloo", "centered"], Gs=(4,), M=150,
                             n_prompts=1, reward="positional", sketch_dim=None, seed=3)
    cells = res.records["cells"].set_index("scheme")
    r = cells.loc["rloo"]
    assert abs(r["bias2_debiased"]) < 4 * r["bias2_debiased_se"] + 1e-12
    # centered = 3/4 rloo exactly on the same groups, so its mean is 3/4 g*: its bias^2 is
    # ||g*||^2 / 16 up to noise.
    ref_norm2 = float(res.records["reference"]["ref_norm"].iloc[0]) ** 2
    c = cells.loc["centered"]
    assert abs(c["bias2_debiased"] - ref_norm2 / 16) < 4 * c["bias2_debiased_se"] + 1e-12


def test_reference_records_exact_sequence_norms(micro64, arith_batch):
    """The per-prompt record's exact mean ||sum_t g_t||^2 (sequence_grad_norms) equals one
    backward per response; with flat vectors the 'sketched' value is the same number."""
    from varbench.grads import sequence_grads

    tv = token_vectors(micro64.model, arith_batch, sketch_dim=None)
    got = varmod._sequence_norms(micro64.model, arith_batch, tv)
    flat = arith_batch.flat()
    want = sequence_grads(micro64.model, flat.input_ids, flat.response_mask,
                          flat.attention_mask).pow(2).sum(-1).mean()
    # micro64 is a stock model in float64 whose RMS norms cast to float32 inside: two exact
    # routes agree to float32-level rounding of those casts (observed 5e-10 relative)
    assert abs(got["seq_sq_exact"] - float(want)) <= 1e-7 * float(want)
    assert abs(got["seq_sq_sketched"] - float(want)) <= 1e-7 * float(want)


def test_adaptive_M_targets_the_headline_figures(tmp_path):
    """A pilot round of M groups (never reported) sets M in steps of M from the headline
    figures' relative SE (pooled over prompts), within [floor, cap]; every response is used at
    every G; the notes state the M used and the reached relative SE of the reported groups."""
    pol = build_preset("micro", seed=0)
    kw = dict(schemes=["centered", "otb", "otb_exact"], reward="positional", n_boot=50)
    capped = _run(pol, tmp_path / "a", target_rel_se=1e-6, M_cap=12, **kw)
    ref = capped.records["reference"].iloc[0]
    assert ref["M_used"] == 12 and ref["target_met"] == 0.0 and ref["target_rel_se"] == 1e-6
    assert ref["max_rel_se_of"].split(":")[0] in ("projection", "variance_ratio", "mse_ratio",
                                                   "proxy_cost")
    cells = capped.records["cells"]
    assert set(zip(cells["G"], cells["M"], strict=True)) == {(2, 18), (3, 12)}  # 36 responses
    assert ref["groups_per_G"] == "G=2:18 G=3:12"
    assert any("NOT met: cap" in n for n in capped.notes)
    assert any("Adaptive M targets the headline figures" in n and "above the target" in n
               for n in capped.notes)
    met = _run(pol, tmp_path / "b", target_rel_se=100.0, M_cap=12, **kw)
    ref = met.records["reference"].iloc[0]
    assert ref["M_used"] == 4 and ref["target_met"] == 1.0 and ref["max_rel_se"] <= 100.0
    assert any("all within the target" in n for n in met.notes)


def test_proxy_weighted_labels_get_the_response_floor(tmp_path, monkeypatch):
    """min_responses="auto": a label fed the proxy weights (otb, otb_loo; not otb_exact, not the
    reward-only schemes) raises M in whole rounds of M to PROXY_MIN_RESPONSES responses per
    prompt, above M_cap, and keeps round 0 (the historical sample) as it was; an explicit 0
    keeps M and the notes say the OTB intervals are too narrow; the floor is in the config."""
    import varbench.analysis.variance as variance
    import varbench.analysis.variance_report as variance_report
    from varbench.analysis.variance_report import reads_proxy_weights

    assert [reads_proxy_weights(s) for s in ("otb", "otb_loo", "otb_exact", "otb_loo_exact",
                                             "centered", "rloo", "normalized", "topk", "raw",
                                             "opo")] == [True, True] + [False] * 8
    for mod in (variance, variance_report):  # 30 responses: M 4 -> 12 at G = 3
        monkeypatch.setattr(mod, "PROXY_MIN_RESPONSES", 30)
    for mod in (variance, variance_report):  # 15 responses at G = 3: below 30
        monkeypatch.setattr(mod, "PROXY_MIN_GROUPS", 5)
    pol = build_preset("micro", seed=0)
    kw = dict(schemes=["centered", "otb", "otb_exact"], reward="positional", n_boot=50,
              exact="never", min_responses="auto")
    floor = _run(pol, tmp_path / "a", M_cap=4, **kw)
    ref = floor.records["reference"].iloc[0]
    assert (ref["M_used"], ref["responses"], ref["min_responses"]) == (12, 36, 30)
    assert floor.config["min_responses"] == 30
    assert set(zip(floor.records["cells"]["G"], floor.records["cells"]["M"],
                   strict=True)) == {(2, 18), (3, 12)}
    assert not any("rest on fewer than" in n for n in floor.notes)
    off = _run(pol, tmp_path / "b", **{**kw, "min_responses": 0})
    ref0 = off.records["reference"].iloc[0]
    assert (ref0["M_used"], ref0["responses"]) == (4, 12)
    # 12 responses: 6 groups at G = 2 (not below 5), 4 at G = 3 (below): counted per G
    note = [n for n in off.notes if "rest on fewer than 5 groups at some G (p0: G=3: 4 groups)"
            in n]
    assert note and "otb (proxy weights)" in note[0] and "otb_exact" not in note[0]
    plain = _run(pol, tmp_path / "c", **{**kw, "schemes": ["centered", "rloo", "otb_exact"]})
    assert plain.records["reference"].iloc[0]["M_used"] == 4  # no proxy label: no floor


def test_small_M_all_agree_intervals_are_flagged_degenerate(tmp_path):
    """At M = 3 with a random micro policy every group all-agrees: each estimate is 0, the
    bootstrap intervals have zero width, and the records, text and summary.json say so."""
    import json

    from varbench.report import write_report

    pol = build_preset("micro", seed=0)
    res = estimator_variance(pol, get_task("sort", n=2), schemes=["centered", "rloo"], Gs=[2],
                             M=3, min_responses=0, n_prompts=1, sketch_dim=None, n_boot=50)
    cells = res.records["cells"]
    assert (cells["method"] == "mc").all() and (cells["distinct_groups"] == 1).all()
    assert (cells["degenerate_ci"] == 1.0).all()
    flagged = [h for h in res.headlines if h.key.startswith("projection:")]
    assert flagged and all("degenerate interval" in h.text for h in flagged)
    out = write_report([res], tmp_path / "r")
    summary = json.loads((out / "summary.json").read_text())
    heads = summary["analyses"][0]["headlines"]
    assert all(h.get("degenerate_ci") is True for h in heads if h["key"].startswith("projection:"))


def test_headlines_carry_their_intervals_at_the_analysis_level(tmp_path):
    """summary.json's projection and ratio headlines carry ci_lo / ci_hi / level equal to the
    records' bounds; level=0.9 says '90% CI' (it used to print 95% whatever the level)."""
    import json

    from varbench.report import write_report

    pol = build_preset("micro", seed=0)
    res = _run(pol, tmp_path, level=0.9, n_boot=100)
    cells, paired = res.records["cells"], res.records["paired"]
    heads = {h.key: h for h in res.headlines}
    checked = 0
    for r in cells[cells["method"] == "mc"].itertuples():
        h = heads.get(f"projection:{r.scheme}:G={r.G}:{r.mode}")
        if h is None:
            continue
        assert (h.ci_lo, h.ci_hi, h.level) == (r.projection_ci_low, r.projection_ci_high, 0.9)
        assert "90% CI" in h.text and "95% CI" not in h.text
        checked += 1
    for r in paired[(paired["baseline"] == "centered")
                    & paired["scheme"].str.startswith("otb")].itertuples():
        h = heads.get(f"{r.stat}_ratio:{r.scheme}:centered:G={r.G}:{r.mode}")
        if h is None:  # a ratio that is not finite has no headline
            continue
        assert (h.ci_lo, h.ci_hi, h.level) == (r.ratio_ci_low, r.ratio_ci_high, 0.9)
        assert "90% CI" in h.text
        checked += 1
    assert checked >= 4
    out = write_report([res], tmp_path / "r")
    summary = json.loads((out / "summary.json").read_text())
    for h in summary["analyses"][0]["headlines"]:
        if h["key"] in heads and heads[h["key"]].ci_lo is not None:
            assert (h["ci_lo"], h["ci_hi"], h["level"]) == (heads[h["key"]].ci_lo,
                                                            heads[h["key"]].ci_hi, 0.9)
        else:
            assert "ci_lo" not in h


@pytest.mark.parametrize("gradients", ["vectors", "projected"])
def test_prompts_get_independent_sketches(tmp_path, monkeypatch, gradients):
    """Prompt p is sketched with seed sketch_seed + SKETCH_PROMPT_STRIDE * p (the pooled SE
    treats prompts as independent, a shared sketch would correlate their errors): the prompts
    run in turn, and every per-token vector call of the first uses its seed, of the second its
    own; the reference rows say which (projected: the projections carry the seed)."""
    seeds: list[int] = []
    real_tv = varmod.token_vectors

    def tv(*a, **k):
        seeds.append(k["sketch_seed"])
        return real_tv(*a, **k)

    monkeypatch.setattr(varmod, "token_vectors", tv)
    pol = build_preset("micro", seed=0)
    res = _run(pol, tmp_path, n_prompts=2, sketch_seed=5, schemes=["centered", "otb"],
               gradients=gradients)
    stride = varmod.SKETCH_PROMPT_STRIDE
    sketches = list(res.records["reference"]["sketch"])
    if gradients == "vectors":
        n = len(seeds) // 2
        assert n > 0 and seeds == [5] * n + [5 + stride] * n, seeds
        assert sketches == ["countsketch(K=64, seed=5)", f"countsketch(K=64, seed={5 + stride})"]
    else:
        assert seeds == []
        assert "seed=5)" in sketches[0] and f"seed={5 + stride})" in sketches[1], sketches
    pooled_note = "Paired ratios pooled over prompts are coverage-tested at G = 8, 4 and 2 ("
    assert any(pooled_note in n for n in res.notes)
