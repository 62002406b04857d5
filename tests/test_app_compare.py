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


def test_huge_infinite_and_nan_values_are_explicit(tmp_path):
    """Regression: compare crashed on huge numbers and let a change pass when an SE was inf."""
    inf = float("inf")
    base = _summary(tmp_path / "b", {"v/huge": (1e308, 1e300), "v/opp": (1e308, 0.0),
                                     "v/inf_se": (1.0, inf), "v/same_inf": (inf, None),
                                     "v/inf": (1.0, 0.1), "v/nan_se": (1.0, 0.1),
                                     "v/bigint": (1.0, 0.1)})
    new = _summary(tmp_path / "n", {"v/huge": (1e308, 1e300), "v/opp": (-1e308, 0.0),
                                    "v/inf_se": (2.0, 0.1), "v/same_inf": (inf, None),
                                    "v/inf": (inf, 0.1), "v/nan_se": (1.0, float("nan")),
                                    "v/bigint": (12345.0, 0.1)})
    # Python's json writes Infinity/NaN and reads them back: the non-strict JSON a hand edit
    # (or another tool) may produce. A huge integer literal is read as an int.
    text = (tmp_path / "n" / "summary.json").read_text().replace("12345.0", "1" + "0" * 400)
    (tmp_path / "n" / "summary.json").write_text(text)
    t = compare_reports(base, new).set_index("figure")
    assert t.loc["v/huge", "status"] == "ok"  # no OverflowError squaring the SEs
    assert t.loc["v/opp", "status"] == "regression"  # the difference overflows to inf
    assert t.loc["v/inf_se", "status"] == "undefined"  # an infinite SE excuses nothing
    assert t.loc["v/same_inf", "status"] == "ok"
    assert t.loc["v/inf", "status"] == "undefined"
    assert t.loc["v/nan_se", "status"] == "undefined"
    assert t.loc["v/bigint", "status"] == "undefined"  # 10**400: no OverflowError, +inf
    assert set(regressions(t).index) == {"v/opp", "v/inf_se", "v/inf", "v/nan_se", "v/bigint"}


def test_schema_and_types_are_validated(tmp_path):
    from varbench._util.checks import UsageError

    good = _summary(tmp_path / "g", {"v/x": (1.0, 0.1)})
    for i, (data, words) in enumerate([
        ({"schema": "varbench.report/99", "analyses": []}, "schema 'varbench.report/99'"),
        ({"analyses": []}, "schema None"),
        ({"schema": "varbench.report/1", "analyses": {}}, "'analyses' must be a list"),
        ({"schema": "varbench.report/1", "analyses": [{"name": 3, "headlines": []}]},
         "analyses[0] must be a table"),
        ({"schema": "varbench.report/1", "analyses": [
            {"name": "v", "headlines": [{"key": "x", "value": "1.0"}]}]}, "is not a number"),
        ({"schema": "varbench.report/1", "analyses": [
            {"name": "v", "headlines": [{"key": "x", "value": 1.0, "se": -1}]}]}, "se=-1.0"),
    ]):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "summary.json").write_text(json.dumps(data))
        with pytest.raises(UsageError, match="summary.json") as err:
            compare_reports(good, bad)
        assert words in str(err.value), str(err.value)
    for tol in (float("inf"), float("nan"), -1.0):
        with pytest.raises(UsageError, match="tolerance"):
            compare_reports(good, good, tolerance=tol)


def _with_interval(path: Path, value: float, lo: float, hi: float, level=0.95) -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(
        {"schema": "varbench.report/1", "analyses": [{"name": "c", "kind": "x", "headlines": [
            {"key": "claim", "value": value, "se": None, "text": "t", "ci_lo": lo,
             "ci_hi": hi, "level": level}]}]}))
    return path


def test_an_interval_without_se_counts_as_its_se(tmp_path):
    """A claim's interval [0.70, 0.90] at 95% has SE 0.1 / 1.96 = 0.051: a change of 0.2 is
    within 3 * sqrt(2) * 0.051 = 0.216, a change of 0.25 is not (before: held to 1% only)."""
    base = _with_interval(tmp_path / "b", 0.80, 0.70, 0.90)
    near = _with_interval(tmp_path / "n", 1.00, 0.90, 1.10)
    far = _with_interval(tmp_path / "f", 1.05, 0.95, 1.15)
    t = compare_reports(base, near, rel_tolerance=0.0).set_index("figure")
    assert t.loc["c/claim", "status"] == "ok"
    assert t.loc["c/claim", "base_se"] == pytest.approx(0.1 / 1.959964, rel=1e-6)
    assert compare_reports(base, far, rel_tolerance=0.0)["status"].iloc[0] == "regression"
    with pytest.raises(ValueError, match="level=1.5"):
        compare_reports(_with_interval(tmp_path / "x", 0.8, 0.7, 0.9, level=1.5), base)
    with pytest.raises(ValueError, match="not an interval"):
        compare_reports(_with_interval(tmp_path / "y", 0.8, 0.9, 0.7), base)


def test_a_ballooned_new_se_never_excuses_a_change(tmp_path):
    """New SE 1e300 would make any change 'within the SEs': a change the plain tolerances do
    not cover passes only when the two SEs are within SE_JUMP of each other (issue 32)."""
    from varbench.app.cli import main
    from varbench.app.compare import SE_JUMP

    base = _summary(tmp_path / "b", {"v/x": (1.0, 0.01), "v/same": (1.0, 0.01)})
    new = _summary(tmp_path / "n", {"v/x": (99.0, 1e300), "v/same": (1.0, 1e300)})
    table = compare_reports(base, new).set_index("figure")
    assert table.loc["v/x", "status"] == "undefined"  # 98 apart: only the 1e300 SE covered it
    assert table.loc["v/same", "status"] == "ok"  # no change: nothing to excuse
    assert list(regressions(table.reset_index())["figure"]) == ["v/x"]
    assert main(["compare", str(base), str(new)]) == 1
    close = _summary(tmp_path / "c", {"v/x": (1.05, 0.01 * SE_JUMP / 2), "v/same": (1.0, 0.01)})
    assert set(compare_reports(base, close)["status"]) == {"ok"}  # SEs alike: the SE gap holds
