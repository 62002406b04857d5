"""The published claims report (reports/claims/) and the README's answers agree."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

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


def _follow_up(name: str, start: str, stop: str) -> tuple[Path, str, pd.DataFrame]:
    """A follow-up report's directory (its files checked present), the README's text from
    ``start`` to ``stop`` on one line, and the report's claims table by claim."""
    rep = ROOT / "reports" / name
    for f in ("report.md", "summary.json", "tables/validation__claims.csv"):
        assert (rep / f).is_file(), f
    readme = (ROOT / "README.md").read_text()
    sec = readme[readme.index(start):]
    sec = sec[: sec.index(stop)].replace("\n", " ")
    return rep, sec, pd.read_csv(rep / "tables" / "validation__claims.csv").set_index("claim")


def test_the_readme_states_the_gspo_follow_up_as_its_report_decided_it():
    """reports/gspo-lr/ is complete, and the README's follow-up paragraph quotes its verdicts,
    savings, collapse counts and hash as the report has them."""
    import hashlib

    rep, para, claims = _follow_up("gspo-lr", "**GSPO follow-up", "\n\n")
    for arm, metric, word in (("gspo4q_mr", "tokens-to-threshold", "refuted"),
                              ("gspo4q_ao", "tokens-to-threshold", "refuted"),
                              ("gspo4q_ao", "wall seconds to threshold", "undecided")):
        r = claims.loc[f"toolsum: normalized/8/{arm} vs normalized/8/gspo4q ({metric})"]
        assert r["verdict"] == word
        est, lo, hi = (round(100 * r[k]) for k in ("estimate", "ci_lo", "ci_hi"))
        assert f"{est}% [{lo}, {hi}]" in para, (arm, metric, est, lo, hi)
    rates = pd.read_csv(rep / "tables" / "validation__collapse_rates.csv").fillna({"variant": ""})
    n = rates.set_index("variant")["collapsed"].to_dict()
    assert n["ppo4"] == 4 and n["ppo4q"] == 0 and "collapsed 4/4" in para
    assert n["gspo4q"] + n["gspo4q_mr"] + n["gspo4q_ao"] == 0 and "0 of 48" in para
    sha = hashlib.sha256((ROOT / "suites" / "prereg" / "gspo-lr.toml").read_bytes()).hexdigest()
    assert sha[:8] in para and sha in (rep / "report.md").read_text()


@pytest.mark.parametrize("name,claims", [
    ("toolsum-eqg", [("centered/4", 4, 29)]),
    ("toolsum-eqg2", [("normalized/4", 7, 37), ("rloo/4", 7, 37)])])
def test_the_readme_states_the_toolsum_follow_ups_as_their_reports_decided_them(name, claims):
    """reports/toolsum-eqg*/ are complete and follow their registrations; the README's follow-up
    section quotes each saving, interval, verdict, OTB's censored count and the hash as the
    report has them."""
    import hashlib

    rep, sec, tab = _follow_up(name, "**Toolsum equal-G follow-ups", "Training throughput")
    t2t = pd.read_csv(rep / "tables" / "validation__tokens_to_threshold.csv")
    otb = t2t[t2t.scheme == "otb"]
    for b, censored, seeds in claims:
        r = tab.loc[f"toolsum: otb/4 vs {b} (tokens-to-threshold)"]
        assert r["verdict"] == "undecided"
        est, lo, hi = (round(100 * r[k]) for k in ("estimate", "ci_lo", "ci_hi"))
        assert f"{est}% [{lo}, {hi}]" in sec, (b, est, lo, hi)
        assert len(otb) == seeds and int((~otb.reached).sum()) == censored
        assert f"{censored} of {seeds} OTB runs" in sec or f"{censored} of the {seeds} OTB" in sec
    sha = hashlib.sha256((ROOT / "suites" / "prereg" / f"{name}.toml").read_bytes()).hexdigest()
    assert sha[:8] in sec and sha in (rep / "report.md").read_text()
    assert "(no deviation)" in (rep / "report.md").read_text()
