"""Rule S (tests/_coverage_verdict.py): Holm, the exact binomial p-values, the power and the
row verdicts, each against a brute-force reference."""

from __future__ import annotations

import random
from fractions import Fraction
from math import comb, exp, lgamma, log, log1p
from pathlib import Path

import _coverage_verdict as V
import pandas as pd
import pytest


def _holm_adjusted(p: list[float], alpha: float) -> list[bool]:
    """Reference: Holm's adjusted p-values max_{j <= i} (m - j) p_(j), rejected at <= alpha."""
    m = len(p)
    order = sorted(range(m), key=lambda k: p[k])
    adj, run = [0.0] * m, 0.0
    for i, j in enumerate(order):
        run = max(run, min(1.0, (m - i) * p[j]))
        adj[j] = run
    return [a <= alpha for a in adj]


def test_holm_matches_adjusted_pvalues():
    assert V.holm([0.01, 0.04, 0.03, 0.005], 0.05) == [True, False, False, True]
    rng = random.Random(0)
    for _ in range(500):
        m = rng.randint(1, 30)
        p = [rng.random() ** rng.choice((1, 3, 8)) for _ in range(m)]
        assert V.holm(p, 0.05) == _holm_adjusted(p, 0.05), p
    with pytest.raises(ValueError, match="alpha=1.5"):
        V.holm([0.1], 1.5)


def _exact_cdf(h: int, n: int, q: Fraction) -> float:
    return float(sum(comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(h + 1)))


@pytest.mark.parametrize("hits,reps", [(0, 5), (540, 600), (558, 600), (600, 600), (280, 300)])
def test_figure_pvalues_are_exact_binomial_tails(hits, reps):
    ps, po = V.figure_pvalues(hits, reps)
    assert ps == pytest.approx(_exact_cdf(hits, reps, Fraction(93, 100)), rel=1e-9, abs=1e-300)
    over = 1 - _exact_cdf(hits - 1, reps, Fraction(97, 100)) if hits else 1.0
    assert po == pytest.approx(over, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="hits=7"):
        V.figure_pvalues(7, 5)


@pytest.mark.parametrize("n,m,true", [(600, 90, 0.90), (600, 90, 0.99), (300, 30, 0.91),
                                      (1200, 200, 0.905)])
def test_power_is_the_rejection_region_mass(n, m, true):
    cut = 0.05 / m
    side = 0 if true < 0.93 else 1
    brute = sum(exp(lgamma(n + 1) - lgamma(h + 1) - lgamma(n - h + 1) + h * log(true)
                    + (n - h) * log1p(-true)) for h in range(n + 1)
                if V.figure_pvalues(h, n)[side] <= cut)
    assert V.power(n, m, true) == pytest.approx(brute, rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="true_coverage=0.95"):
        V.power(n, m, 0.95)


def test_rule_s_row_verdicts():
    qs = [("otb", "variance"), ("otb", "mse"), ("centered", "variance")]
    rows = []
    for row, reps, hits in [("ok", 600, [570, 556, 581]),       # .928 by rule W, not short
                            ("short", 600, [570, 530, 570]),    # .883: p ~ 1e-5
                            ("over", 600, [600, 570, 570]),     # 1.000: p ~ 1e-8
                            ("few", 100, [95, 90, 99])]:
        rows += [{"row": row, "quantity": q, "stat": s, "hits": h, "reps": reps}
                 for (q, s), h in zip(qs, hits, strict=True)]
    f, r = V.rule_s(pd.DataFrame(rows))
    got = dict(zip(r.row, r.rule_s, strict=True))
    assert got == {"ok": "within", "short": "not within", "over": "not within",
                   "few": "undecided"}
    assert dict(zip(r.row, r.rule_w, strict=True)) == {"ok": False, "short": False, "over": False,
                                          "few": False}
    assert r.set_index("row").flagged["short"] == "otb mse"
    assert r.set_index("row").flagged["over"] == "otb variance"
    assert f.short.sum() == 1 and f.over.sum() == 1
    with pytest.raises(ValueError, match="hits"):
        V.rule_s(pd.DataFrame(rows).drop(columns="hits"))


def test_run_figures_splits_a_pooled_run(tmp_path):
    csv = tmp_path / "P2t.csv"
    pd.DataFrame({"quantity": ["otb", "p0:otb", "p1:otb/centered"],
                  "stat": ["variance", "mse", "variance"], "coverage": [0.95, 0.9, 0.935],
                  "reps": [20, 20, 200]}).to_csv(csv, index=False)
    f = V.run_figures(str(csv))
    assert list(f.row) == ["P2t", "P2t p0 alone", "P2t p1 alone"]
    assert list(f.quantity) == ["otb", "otb", "otb/centered"]
    assert list(f.hits) == [19, 18, 187]


STOP58 = Path(__file__).resolve().parents[1] / "docs" / "coverage" / "stop58"


def test_stop58_rows_are_the_documented_verdicts():
    """docs/science.md's stop-58 rows (§) from the kept per-figure CSVs: P2a and P2b are the two
    registered halves of one row (hits summed per figure), A8u its own; one family."""
    halves = [V.run_figures(str(STOP58 / f"{n}.csv"), "P2m") for n in ("P2a", "P2b")]
    keys = ["row", "quantity", "stat"]
    assert all((h[keys].values == halves[0][keys].values).all() for h in halves)
    p2m = halves[0][keys].assign(hits=halves[0].hits + halves[1].hits,
                                 reps=halves[0].reps + halves[1].reps)
    figs = pd.concat([p2m, V.run_figures(str(STOP58 / "A8u.csv"))], ignore_index=True)
    f, r = V.rule_s(figs)
    assert len(f) * 2 == 106
    r = r.set_index("row")
    assert dict(r.rule_s) == {"P2m": "within", "P2m p0 alone": "within",
                              "P2m p1 alone": "within", "A8u": "within"}
    assert dict(r["range"]) == {"P2m": "0.938-0.973", "P2m p0 alone": "0.925-0.973",
                                "P2m p1 alone": "0.940-0.965", "A8u": "0.935-0.963"}
    assert dict(r.reps) == {"P2m": 400, "P2m p0 alone": 400, "P2m p1 alone": 400, "A8u": 400}
    smallest = {row: round(min(g.p_short.min(), g.p_over.min()), 2)
                for row, g in f.groupby("row")}
    assert smallest == {"P2m": 0.46, "P2m p0 alone": 0.37, "P2m p1 alone": 0.77, "A8u": 0.68}


def test_stop59_row_is_the_documented_verdict():
    """docs/science.md's stop-59 row (¶), a family of its own: within over 400 replicates."""
    f, r = V.rule_s(V.run_figures(str(STOP58.parent / "stop59" / "M8u.csv")))
    assert len(f) == 15
    assert r.to_dict("records")[0] | {"flagged": ""} == {
        "row": "M8u", "figures": 15, "reps": 400, "range": "0.935-0.965", "rule_w": True,
        "rule_s": "within", "flagged": ""}
    assert round(min(f.p_short.min(), f.p_over.min()), 2) == 0.68
