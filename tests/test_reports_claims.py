"""The published claims report (reports/claims/) and the README's answers agree."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = ROOT / "reports" / "claims"


def test_the_claims_report_is_complete():
    """report.md, report.html, summary.json, the figures and tables are committed; no run
    directory, cache or checkpoint is."""
    for name in ("report.md", "report.html", "summary.json", "tables/validation__claims.csv",
                 "figures/validation__accuracy_vs_tokens.png"):
        assert (CLAIMS / name).is_file(), name
    kept = {p.suffix for p in CLAIMS.rglob("*") if p.is_file()}
    assert kept <= {".md", ".html", ".json", ".csv", ".parquet", ".png"}, kept


def test_the_readme_states_every_token_claim_as_the_report_decided_it():
    """Each token / proxy / compute saving of the report appears in the README's answers table
    with its verdict, estimate and CI as the report rounds them."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### The papers' claims, answered at this scale"):]
    table = table[: table.index("\n\n", table.index("| claim | answer |"))]
    claims = pd.read_csv(CLAIMS / "tables" / "validation__claims.csv")
    rows = {r["claim"]: r for r in claims.to_dict("records")}
    checked = 0
    for r in rows.values():
        if r["kind"] not in ("tokens", "proxy", "compute"):
            continue
        if r["task"] == "toolsum_long":  # stated once, as a whole: no arm reached the threshold
            assert r["verdict"] == "undecided" and r["reached_a"] == r["reached_b"] == 0
            continue
        est, lo, hi = (round(100 * r[k]) for k in ("estimate", "ci_lo", "ci_hi"))
        assert f"{est}% [{lo}, {hi}]" in table, (r["claim"], est, lo, hi)
        checked += 1
    assert checked >= 10
    verdicts = {r["claim"]: r["verdict"] for r in rows.values()}
    assert verdicts["sort: otb/4 vs normalized/32 (tokens-to-threshold)"] == "confirmed"
    assert "**confirmed**: 83% [79, 87] fewer than normalized" in table
    assert verdicts["toolsum: otb/4 vs normalized/32 (tokens-to-threshold)"] == "undecided"
    assert "undecided: normalized/32 35% [17, 54]" in table
