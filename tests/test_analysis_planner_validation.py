"""benchmarks/planner_validation.py: the leave-one-task-out statistics against scipy and a hand
computation on fixed data, and the published report re-derived from its own table."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import planner_validation as pv  # noqa: E402


def _table() -> pd.DataFrame:
    rng = np.random.default_rng(3)
    P = np.array([32, 64, 256] * 4, dtype=float)
    rows = []
    for task, L, c in (("a", 3.0, 10.0), ("b", 14.0, 20.0)):
        B = rng.uniform(2, 90, 12)
        pred = L * (P + B)
        rows.append(pd.DataFrame({"task": task, "P": P, "tokens_per_response": L, "B_noise": B,
                                  "pred_tokens": pred,
                                  "t2t_rmst": c * pred * np.exp(rng.normal(0, 0.4, 12))}))
    return pd.concat(rows, ignore_index=True)


def test_spearman_and_constants_against_scipy_and_by_hand():
    t = _table()
    res = pv.loto(t)
    assert res["cells"] == 24 and res["tasks"] == ["a", "b"]
    rho, lo, hi = res["pooled"]
    assert rho == pytest.approx(sps.spearmanr(t["pred_tokens"], t["t2t_rmst"]).statistic,
                                abs=1e-12)
    assert lo <= rho <= hi
    for k in ("a", "b"):
        d = t[t["task"] == k]
        assert res["per_task"][k][0] == pytest.approx(
            sps.spearmanr(d["pred_tokens"], d["t2t_rmst"]).statistic, abs=1e-12)
        null = d["tokens_per_response"] * d["P"]
        assert res["controls"]["B_noise = 0 (P and L only)"][k][0] == pytest.approx(
            sps.spearmanr(null, d["t2t_rmst"]).statistic, abs=1e-12)
    # the constant of task a is the median realised / predicted ratio of task b's cells
    b = t[t["task"] == "b"]
    c_b = float(np.exp(np.median(np.log(b["t2t_rmst"] / b["pred_tokens"]))))
    assert res["held_out"]["a"]["S_min"] == pytest.approx(c_b, rel=1e-12)
    a = res["table"][res["table"]["task"] == "a"]
    np.testing.assert_allclose(a["pred_tokens_loto"], c_b * a["pred_tokens"], rtol=1e-12)
    err = np.exp(np.median(np.abs(np.log(a["t2t_rmst"] / a["pred_tokens_loto"]))))
    assert res["held_out"]["a"]["median_abs_error_factor"] == pytest.approx(err, rel=1e-12)


def test_the_target_rule():
    t = _table()
    assert pv.loto(t)["target_met"] == (pv.loto(t)["pooled"][0] >= 0.8
                                        and pv.loto(t)["pooled"][1] >= 0.5)
    # fewer than 20 cells or one task: never met, whatever rho
    exact = t.assign(t2t_rmst=t["pred_tokens"])
    assert pv.loto(exact)["target_met"]
    assert not pv.loto(exact.iloc[:19])["target_met"]
    assert not pv.loto(exact.assign(task="a"))["target_met"]
    # a cell without a prediction (signal not resolved) is left out, not ranked
    gap = exact.copy()
    gap.loc[0, "pred_tokens"] = np.nan
    assert pv.loto(gap)["cells"] == 23


def test_published_report_rederives_from_its_table(tmp_path):
    """reports/claims/planner_validation.md is what --from-csv writes from the published csv."""
    csv = ROOT / "reports" / "claims" / "planner_validation.csv"
    published = (ROOT / "reports" / "claims" / "planner_validation.md").read_text()
    out = tmp_path / "new" / "dir"  # an --out that does not exist yet is made
    assert pv.main(["--from-csv", str(csv), "--out", str(out)]) == 0
    again = (out / "planner_validation.md").read_text()
    # the re-measured-variance line needs the published column, which the csv carries
    assert again == published
