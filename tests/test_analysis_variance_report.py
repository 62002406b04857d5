"""varbench.analysis.variance_report: headlines, notes and summary generated from hand-built
variance records (which rows become headlines, and their numbers)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from varbench.analysis.variance_report import _ratio_se, shrinkage_share, variance_headlines

NAN = float("nan")


def _cell(scheme, G, variance, se, cosine=NAN, tokens=10.0, projection=NAN, method="mc"):
    return {"scheme": scheme, "G": G, "mode": "token-mean", "variance": variance,
            "variance_se": se, "cosine": cosine, "cosine_se": 0.01, "bias2_debiased": 0.5,
            "bias2_debiased_se": 0.1, "mse": 2.0, "mse_se": 0.2, "tokens_per_group": tokens,
            "projection": projection, "projection_se": 0.01, "projection_ci_low": projection - 0.02,
            "projection_ci_high": projection + 0.02, "mse_ci_low": 1.6, "mse_ci_high": 2.5,
            "variance_ci_low": variance * 0.8, "variance_ci_high": variance * 1.3,
            "frac_all_agree": 0.25, "method": method}


def _records():
    cells = pd.DataFrame([
        _cell("centered", 2, 4.0, 0.4, projection=0.5, method="exact"),
        _cell("centered", 8, 1.0, 0.1, tokens=40.0),
        _cell("otb", 2, 2.0, 0.2, cosine=0.9, projection=0.45),
        _cell("otb", 8, 0.5, 0.05, cosine=NAN),
        _cell("rloo", 2, 3.0, 0.3, cosine=0.8, projection=1.0),
    ])
    paired = pd.DataFrame([
        {"stat": "variance", "scheme": "otb", "baseline": "centered", "G": 2,
         "mode": "token-mean", "ratio": 0.5, "ratio_se": 0.02, "ratio_ci_low": 0.46,
         "ratio_ci_high": 0.55, "method": "mc"},
        {"stat": "variance", "scheme": "rloo", "baseline": "centered", "G": 2,
         "mode": "token-mean", "ratio": 0.75, "ratio_se": 0.03, "ratio_ci_low": NAN,
         "ratio_ci_high": NAN, "method": "mc"},
        {"stat": "variance", "scheme": "normalized", "baseline": "centered", "G": 2,
         "mode": "token-mean", "ratio": 0.9, "ratio_se": 0.03, "ratio_ci_low": 0.8,
         "ratio_ci_high": 1.0, "method": "mc"},
        {"stat": "mse", "scheme": "otb", "baseline": "otb_exact", "G": 2, "mode": "token-mean",
         "ratio": 1.5, "ratio_se": 0.1, "ratio_ci_low": 1.3, "ratio_ci_high": 1.8,
         "method": "mc"},
    ])
    ref = pd.DataFrame({"reference": ["exact enumeration of 900 responses"], "sketch": ["flat"],
                        "n_params": [1234.0], "ref_norm": [2.0], "ref_se_norm": [0.1]})
    return {"cells": cells, "paired": paired, "reference": ref}


def test_headlines_from_the_records():
    heads, notes, summary = variance_headlines(_records(), "exact")
    keys = [h.key for h in heads]
    assert keys == [
        "projection:centered:G=2:token-mean",  # cells with a finite projection; no cosine
        "projection:otb:G=2:token-mean",
        "projection:rloo:G=2:token-mean",
        "variance_ratio:otb:centered:G=2:token-mean",
        "variance_ratio:rloo:centered:G=2:token-mean",
        "proxy_cost:otb:mse:G=2:token-mean",
        "shrinkage_share:otb:G=2:token-mean",
        "budget:otb:G=2:vs_centered:G=8:token-mean",
    ]
    by = {h.key: h for h in heads}
    h = by["variance_ratio:otb:centered:G=2:token-mean"]
    assert (h.value, h.se) == (0.5, 0.02)
    assert h.text == ("otb at G=2 has 0.5 [95% CI 0.46, 0.55]x the variance (token-mean) of "
                      "centered at G=2.")
    assert by["variance_ratio:rloo:centered:G=2:token-mean"].text.endswith("(SE 0.03).")
    assert "projection on g* 0.5 (exact)" in by["projection:centered:G=2:token-mean"].text
    assert "0.45 [95% CI 0.43, 0.47]" in by["projection:otb:G=2:token-mean"].text
    assert "1.5 [95% CI 1.3, 1.8]x the mse of otb_exact" in by[
        "proxy_cost:otb:mse:G=2:token-mean"].text
    # projection ratio 0.9 and variance ratio 0.5: 2 log 0.9 / log 0.5 of it is rescaling
    s = by["shrinkage_share:otb:G=2:token-mean"]
    assert s.value == pytest.approx(2 * math.log(0.9) / math.log(0.5))
    b = by["budget:otb:G=2:vs_centered:G=8:token-mean"]
    assert b.value == pytest.approx(2.0)  # 2.0 / 1.0, unpaired
    assert b.se == pytest.approx(2.0 * math.sqrt(0.1**2 + 0.1**2))
    assert "using 0.25x the sampled tokens" in b.text and "groups not paired" in b.text
    assert summary["reference"] == "exact"
    assert summary["projection:otb:G=2:token-mean"] == {"value": 0.45, "se": 0.01}
    assert any("exact enumeration of 900 responses (exact)" in n and "flat of 1234" in n
               for n in notes)
    assert not any("sampled reference" in n for n in notes)


def test_g2_monte_carlo_cells_carry_the_measured_coverage_note():
    """G = 2 mc intervals measured at the low end of nominal (docs/science.md): the note
    appears for an mc cell at G = 2 and not for exact-only G = 2 cells."""
    _, notes, _ = variance_headlines(_records(), "exact")
    assert sum("G = 2 Monte Carlo intervals cover at the low end" in n for n in notes) == 1
    rec = _records()
    rec["cells"] = rec["cells"][(rec["cells"]["G"] != 2) | (rec["cells"]["method"] != "mc")]
    _, notes, _ = variance_headlines(rec, "exact")
    assert not any("G = 2 Monte Carlo" in n for n in notes)


def test_shrinkage_share():
    assert shrinkage_share(0.25, 0.5) == pytest.approx(1.0)  # all of it is rescaling
    assert shrinkage_share(0.05, 1.01) == 0.0
    assert math.isnan(shrinkage_share(1.2, 0.9))


def test_sampled_reference_note_and_empty_records():
    _, notes, _ = variance_headlines(_records(), "sampled")
    assert any("||g*|| = 2 (SE 0.1)" in n for n in notes)
    empty = {k: v.iloc[0:0] for k, v in _records().items()}
    heads, notes, summary = variance_headlines(empty, "sampled")
    assert heads == [] and summary == {"reference": "sampled"}
    assert any("none (sampled)" in n for n in notes)


def test_ratio_se_delta_method():
    assert _ratio_se(2.0, 0.2, 4.0, 0.2) == pytest.approx(0.5 * math.sqrt(0.01 + 0.0025))
    assert math.isnan(_ratio_se(0.0, 0.1, 1.0, 0.1)) and math.isnan(_ratio_se(1.0, 0.1, 0, 0.1))


def test_all_rewards_equal_and_zero_reference_are_said_not_printed_as_n_a():
    """Every reward equal: every estimate is 0, every ratio 0/0, g* = 0. The headlines say so
    and no 'n/a x' ratio or cosine to a zero g* is printed."""
    cells = pd.DataFrame([
        {**_cell("centered", 2, 0.0, 0.0), "frac_all_agree": 1.0},
        {**_cell("centered", 4, 0.0, 0.0), "frac_all_agree": 1.0},
        {**_cell("otb", 2, 0.0, 0.0, cosine=0.0), "frac_all_agree": 1.0},
        {**_cell("rloo", 4, 0.0, 0.0, cosine=0.0), "frac_all_agree": 1.0},
    ])
    paired = pd.DataFrame([
        {"stat": "variance", "scheme": s, "baseline": "centered", "G": g, "mode": "token-mean",
         "ratio": NAN,
         "ratio_se": NAN} for s, g in (("otb", 2), ("rloo", 4))])
    ref = pd.DataFrame({"reference": ["sampled: raw estimator over 64 independent responses"],
                        "sketch": ["flat"], "n_params": [10.0], "ref_norm": [0.0],
                        "ref_se_norm": [0.0], "mean_reward_sampled": [0.0]})
    heads, _, summary = variance_headlines({"cells": cells, "paired": paired,
                                            "reference": ref}, "sampled")
    keys = [h.key for h in heads]
    assert keys == ["all_rewards_equal", "reference_gradient_zero"]
    text = " ".join(h.text for h in heads)
    assert "all rewards equal (mean reward 0)" in text and "g* is exactly 0" in text
    assert "n/a" not in text
    # with some groups informative, only the zero reference is reported
    cells.loc[0, "frac_all_agree"] = 0.5
    heads, _, _ = variance_headlines({"cells": cells, "paired": paired, "reference": ref},
                                     "sampled")
    assert [h.key for h in heads] == ["reference_gradient_zero"]


def test_a_zero_width_interval_is_flagged_in_text_and_summary():
    """Issue 29: `variance 257 [95% CI 257, 257]` was printed unflagged at small M."""
    rec = _records()
    zero = _cell("otb", 2, 257.0, 0.0, projection=0.45)
    zero.update(variance_ci_low=257.0, variance_ci_high=257.0)
    rec["cells"] = pd.DataFrame([zero, _cell("rloo", 2, 3.0, 0.3, projection=1.0)])
    heads, notes, summary = variance_headlines(rec, "exact")
    flat = {h.key: h for h in heads}
    bad, good = flat["projection:otb:G=2:token-mean"], flat["projection:rloo:G=2:token-mean"]
    assert "variance 257 [95% CI 257, 257; degenerate interval]" in bad.text
    assert bad.degenerate_ci and bad.to_dict()["degenerate_ci"] is True
    assert summary["projection:otb:G=2:token-mean"]["degenerate_ci"] is True
    assert not good.degenerate_ci and "degenerate_ci" not in good.to_dict()
    assert "degenerate_ci" not in summary["projection:rloo:G=2:token-mean"]
    assert any("degenerate interval" in n and "projection:otb:G=2" in n for n in notes)


def test_an_interval_from_too_few_distinct_groups_is_flagged():
    rec = _records()
    few = _cell("otb", 2, 2.0, 0.2, projection=0.45)
    few["degenerate_ci"] = 1.0  # the analysis saw fewer than MIN_DISTINCT_GROUPS estimates
    rec["cells"] = pd.DataFrame([few])
    rec["paired"] = rec["paired"].assign(degenerate_ci=[1.0, 0.0, 0.0, 0.0])
    heads, _, _ = variance_headlines(rec, "exact")
    flat = {h.key: h for h in heads}
    assert flat["projection:otb:G=2:token-mean"].degenerate_ci
    assert flat["variance_ratio:otb:centered:G=2:token-mean"].degenerate_ci
    assert not flat["proxy_cost:otb:mse:G=2:token-mean"].degenerate_ci


def test_a_user_scheme_that_declares_token_weights_gets_the_otb_headlines():
    """The OTB-type headlines follow the declared capability (register_scheme(..., reads=
    ("token_weights",))), not the name: a user scheme under another name gets otb's rows, and
    otb itself would lose them if it did not declare the read."""
    import varbench.estimators as E
    from varbench.analysis.variance import _targeted
    from varbench.analysis.variance_report import headline_vs_centered, otb_type

    def weighted(rewards, mask, opts):  # scheme shape; the records below are hand-built
        return rewards.unsqueeze(-1) * mask

    records = _records()
    renamed = {k: v.replace({"otb": "userw", "otb_exact": "userw_exact"})
               for k, v in records.items() if k != "reference"}
    renamed["reference"] = records["reference"]
    assert not otb_type("userw") and not headline_vs_centered("userw")  # not yet registered
    E.register_scheme("userw", reads=("token_weights",))(weighted)
    E.register_scheme("otbish_unweighted")(weighted)  # an "otb" prefix declares nothing
    try:
        assert otb_type("userw") and otb_type("userw_exact") and otb_type("otb_loo")
        assert not otb_type("otbish_unweighted") and not otb_type("rloo")
        assert _targeted("userw", "centered") and not _targeted("otbish_unweighted", "centered")
        keys = [h.key for h in variance_headlines(renamed, "exact")[0]]
        want = [k.replace(":otb:", ":userw:") for k in
                [h.key for h in variance_headlines(records, "exact")[0]]]
        assert keys == want
        assert "shrinkage_share:userw:G=2:token-mean" in keys
        assert "budget:userw:G=2:vs_centered:G=8:token-mean" in keys
        unweighted = {k: v.replace({"otb": "otbish_unweighted"}) for k, v in records.items()}
        keys = [h.key for h in variance_headlines(unweighted, "exact")[0]]
        assert not any(k.startswith(("shrinkage_share", "budget", "variance_ratio:otbish"))
                       for k in keys)
    finally:
        E.unregister_scheme("userw")
        E.unregister_scheme("otbish_unweighted")


def test_pooled_monte_carlo_ratios_carry_the_measured_coverage_note():
    """Pooled Monte Carlo ratios were coverage-tested at G = 8, 4 and 2 (docs/science.md): the note
    appears when a Monte Carlo ratio pools several prompts, not for one prompt's, exact or
    exact-sketched ones."""
    rec = _records()
    _, notes, _ = variance_headlines(rec, "exact")
    assert not any("Paired ratios pooled over prompts" in n for n in notes)  # no n_prompts
    rec["paired"] = rec["paired"].assign(n_prompts=1)
    _, notes, _ = variance_headlines(rec, "exact")
    assert not any("Paired ratios pooled over prompts" in n for n in notes)
    rec["paired"] = rec["paired"].assign(n_prompts=2)
    _, notes, _ = variance_headlines(rec, "exact")
    note = "Paired ratios pooled over prompts are coverage-tested at G = 8, 4 and 2 ("
    assert sum(note in n for n in notes) == 1
    # only Monte Carlo ratios were measured: a sketched closed form has its own interval
    for method, noted in (("mixed", True), ("exact", False), ("exact-sketched", False)):
        rec["paired"] = rec["paired"].assign(method=method)
        _, notes, _ = variance_headlines(rec, "exact")
        assert any("Paired ratios pooled over prompts" in n for n in notes) is noted, method
