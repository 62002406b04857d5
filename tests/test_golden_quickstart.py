"""Golden summaries in reports/baselines/: valid, comparable, and (slow) the quickstart's guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from varbench.app.compare import compare_reports, load_figures, regressions
from varbench.app.runner import run_suite

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "reports" / "baselines" / "quickstart" / "summary.json"


def test_quickstart_golden_summary_is_complete():
    sections = [a["name"] for a in json.loads(GOLDEN.read_text())["analyses"]]
    assert sections == ["proxy", "variance", "cancellation", "train-centered-G8", "train-otb-G4"]
    with_figures = {k.split("/")[0] for k in load_figures(GOLDEN)}
    assert {"proxy", "variance", "train-centered-G8", "train-otb-G4"} <= with_figures
    assert compare_reports(GOLDEN, GOLDEN, tolerance=0, rel_tolerance=0)["status"].eq("ok").all()


@pytest.mark.slow
def test_quickstart_matches_its_golden_summary(tmp_path):
    """Runs the quickstart (about ten minutes on 2 cores) and compares it figure by figure."""
    summary = run_suite(ROOT / "suites" / "quickstart.toml", tmp_path / "qs", progress=False)
    table = compare_reports(GOLDEN, summary.out_dir)
    assert regressions(table).empty, regressions(table).to_string()
