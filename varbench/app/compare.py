"""Compare two reports' summary.json figure by figure, with their standard errors.

A figure is one headline of one analysis: ``"<analysis name>/<headline key>"`` with a value and
(usually) an SE. Two values differ beyond tolerance when

    |new - base| > tolerance * sqrt(se_base^2 + se_new^2) + rel_tolerance * |base| + abs_tolerance

(an SE that is missing counts as 0, so figures without SEs are held to the relative and
absolute tolerances). Headlines carry no "better" direction, so any change beyond tolerance is a
regression against the golden baseline, and so is a figure that disappeared. Figures that are
new in NEW are listed, not failed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from varbench._util.checks import UsageError, UsageFileNotFoundError
from varbench._util.io import check_path


def load_figures(path: str | Path) -> dict[str, tuple[float | None, float | None]]:
    """``{"analysis/key": (value, se)}`` from a report directory or a summary.json file."""
    p = check_path("report", path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise UsageFileNotFoundError(
            f"{path}: no summary.json (give a report directory or the file)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        analyses = data["analyses"]
    except OSError as err:
        raise UsageError(f"cannot read {str(p)!r}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{p} is not a varbench summary.json ({err})") from None
    out: dict[str, tuple[float | None, float | None]] = {}
    for a in analyses:
        for h in a.get("headlines", []):
            out[f"{a['name']}/{h['key']}"] = (_num(h.get("value")), _num(h.get("se")))
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def compare_reports(
    baseline: str | Path,
    new: str | Path,
    *,
    tolerance: float = 3.0,
    rel_tolerance: float = 0.01,
    abs_tolerance: float = 1e-9,
) -> pd.DataFrame:
    """One row per figure: base, new, their SEs, the allowed gap and the status.

    Status: ``ok``, ``regression`` (beyond tolerance), ``missing`` (in BASELINE, not in NEW),
    ``new`` (only in NEW), ``undefined`` (a value that is null in one report and not the other
    counts as a regression; null in both is ok).
    """
    for name, v in (("tolerance", tolerance), ("rel_tolerance", rel_tolerance),
                    ("abs_tolerance", abs_tolerance)):
        if not (isinstance(v, (int, float)) and v >= 0):
            raise UsageError(f"{name}={v!r} is not valid; expected a number >= 0")
    base, cur = load_figures(baseline), load_figures(new)
    rows = []
    for key in list(base) + [k for k in cur if k not in base]:
        b, bse = base.get(key, (None, None))
        n, nse = cur.get(key, (None, None))
        row = {"figure": key, "base": b, "base_se": bse, "new": n, "new_se": nse,
               "diff": None, "allowed": None}
        if key not in cur:
            row["status"] = "missing"
        elif key not in base:
            row["status"] = "new"
        elif b is None or n is None or not (math.isfinite(b) and math.isfinite(n)):
            row["status"] = "ok" if b is None and n is None else "undefined"
        else:
            se = math.sqrt((bse or 0.0) ** 2 + (nse or 0.0) ** 2)
            allowed = tolerance * se + rel_tolerance * abs(b) + abs_tolerance
            row.update(diff=n - b, allowed=allowed,
                       status="ok" if abs(n - b) <= allowed else "regression")
        rows.append(row)
    return pd.DataFrame(rows, columns=["figure", "status", "base", "base_se", "new", "new_se",
                                       "diff", "allowed"])


def regressions(table: pd.DataFrame) -> pd.DataFrame:
    """Rows that fail the comparison (regression, missing, undefined)."""
    return table[table["status"].isin(["regression", "missing", "undefined"])]
