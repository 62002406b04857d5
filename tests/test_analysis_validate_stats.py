"""varbench.analysis.validate_stats: the validation experiment's statistics on hand-built
tables (tokens-to-threshold, claims, bootstrap CIs, rank correlation, hacking table)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from varbench.analysis import validate_stats as vs


def _curve(acc, tokens):
    return pd.DataFrame({"step": range(len(acc)), "tokens": tokens, "acc_sampled": acc})


def test_tokens_to_threshold_and_censoring():
    c = _curve([0.3, 0.5, 0.7, 0.65], [0, 100, 200, 300])
    assert vs.tokens_to_threshold(c, 0.6) == (200.0, True)
    assert vs.tokens_to_threshold(c, 0.5) == (100.0, True)
    assert vs.tokens_to_threshold(c, 0.8) == (300.0, False)  # never reached: censored at 300
    assert vs.threshold_of(0.4, 0.5) == pytest.approx(0.7)


def _t2t(values):
    rows = []
    for (scheme, G), xs in values.items():
        for seed, x in enumerate(xs):
            rows.append({"task": "sort", "scheme": scheme, "G": G, "seed": seed,
                         "tokens_to_threshold": float(x), "reached": x < 1000})
    return pd.DataFrame(rows)


def test_claim_saving_ci_and_sentence():
    t2t = _t2t({("otb", 4): [300, 300, 300], ("normalized", 32): [600, 600, 600]})
    c = vs.claim(t2t, "sort", ("otb", 4), ("normalized", 32))
    assert c["saving"] == pytest.approx(0.5)
    assert c["saving_ci_lo"] == pytest.approx(0.5) and c["saving_ci_hi"] == pytest.approx(0.5)
    text = vs.claim_sentence(c)
    assert "50% fewer" in text and "holds" in text
    # The other way round: otb needs more tokens -> "more", contradicted.
    t2t = _t2t({("otb", 4): [900, 800, 850], ("normalized", 32): [400, 500, 450]})
    c = vs.claim(t2t, "sort", ("otb", 4), ("normalized", 32))
    assert c["saving"] == pytest.approx(1 - 850 / 450)
    assert "more tokens" in vs.claim_sentence(c) and "contradicted" in vs.claim_sentence(c)
    # A censored run is named; a missing cell says what is missing.
    t2t = _t2t({("otb", 4): [300, 1000], ("normalized", 32): [600, 600]})
    assert "lower bounds" in vs.claim_sentence(vs.claim(t2t, "sort", ("otb", 4),
                                                        ("normalized", 32)))
    missing = vs.claim(t2t, "sort", ("otb", 4), ("normalized", 8))
    assert not missing["available"] and "normalized at G=8" in vs.claim_sentence(missing)


def test_cell_table_bootstrap_ci_brackets_the_mean():
    t2t = _t2t({("otb", 4): [100, 300, 200], ("rloo", 4): [500, 500, 1000]})
    t2t["final_acc_sampled"] = 0.5
    cells = vs.cell_table(t2t).set_index("scheme")
    assert cells.loc["otb", "t2t_mean"] == 200
    assert 100 <= cells.loc["otb", "t2t_ci_lo"] <= 200 <= cells.loc["otb", "t2t_ci_hi"] <= 300
    assert not cells.loc["otb", "t2t_is_lower_bound"] and cells.loc["rloo", "t2t_is_lower_bound"]


def test_rank_correlation_and_hacking_table():
    rho, lo, hi = vs.rank_correlation_ci(np.arange(6.0), np.arange(6.0) ** 2)
    assert rho == pytest.approx(1.0) and lo == pytest.approx(1.0)
    rho, _, _ = vs.rank_correlation_ci(np.arange(6.0), -np.arange(6.0))
    assert rho == pytest.approx(-1.0)
    curves = pd.DataFrame({"reward": "positional", "seed": 0, "step": range(5),
                           "reward_sampled": [1.0, 2.0, 2.5, 2.6, 2.9],
                           "acc_sampled": [0.1, 0.3, 0.2, 0.4, 0.5]})
    h = vs.hacking_table(curves).iloc[0]
    assert h["pearson"] == pytest.approx(np.corrcoef(curves["reward_sampled"],
                                                     curves["acc_sampled"])[0, 1])
    assert h["spearman"] == pytest.approx(0.9) and h["exact_end"] == 0.5
