"""varbench.app.compare: report comparison with standard errors and tolerances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from varbench.app.compare import compare_reports, regressions


def _summary(path: Path, figures: dict[str, tuple[float | None, float | None]]) -> Path:
    analyses: dict[str, list] = {}
    for key, (v, se) in figures.items():
        a, h = key.split("/")
        analyses.setdefault(a, []).append({"key": h, "value": v, "se": se, "text": key})
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(
        {"schema": "varbench.report/1", "analyses": [
            {"name": a, "kind": "x", "headlines": hs} for a, hs in analyses.items()]}))
    return path


def test_compare_with_standard_errors(tmp_path):
    base = _summary(tmp_path / "b", {"v/ratio": (0.50, 0.01), "v/exact": (2.0, None),
                                     "v/gone": (1.0, 0.1), "v/nan": (None, None)})
    new = _summary(tmp_path / "n", {"v/ratio": (0.53, 0.01), "v/exact": (2.01, None),
                                    "v/nan": (None, None), "v/extra": (3.0, 0.1)})
    t = compare_reports(base, new, tolerance=3.0, rel_tolerance=0.01).set_index("figure")
    assert t.loc["v/ratio", "status"] == "ok"  # 0.03 <= 3 * sqrt(2) * 0.01 + 0.005
    assert t.loc["v/exact", "status"] == "ok"  # 0.01 <= 0.01 * 2
    assert t.loc["v/gone", "status"] == "missing"
    assert t.loc["v/nan", "status"] == "ok" and t.loc["v/extra", "status"] == "new"
    tight = compare_reports(base, new, tolerance=1.0, rel_tolerance=0.0).set_index("figure")
    assert tight.loc["v/ratio", "status"] == "regression"
    assert tight.loc["v/exact", "status"] == "regression"
    assert len(regressions(tight)) == 3
    with pytest.raises(FileNotFoundError, match="summary.json"):
        compare_reports(tmp_path / "nowhere", new)
