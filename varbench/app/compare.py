"""Compare two reports' summary.json figure by figure, with their standard errors.

A figure is one headline of one analysis: ``"<analysis name>/<headline key>"`` with a value and
(usually) an SE; a headline with an interval and no SE (a claim's bootstrap interval) counts
its half-width over z at its level as the SE. Two values differ beyond tolerance when

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
from statistics import NormalDist
from typing import Any

import pandas as pd

from varbench._util.checks import UsageError, UsageFileNotFoundError, check_finite_number
from varbench._util.io import check_path
from varbench.report.writer import SCHEMA


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
    if data.get("schema") != SCHEMA:
        raise UsageError(f"{p} has schema {data.get('schema')!r}; this varbench compares "
                         f"{SCHEMA!r} reports only (re-render it with this version)")
    if not isinstance(analyses, list):
        raise UsageError(f"{p}: 'analyses' must be a list, got {type(analyses).__name__}")
    out: dict[str, tuple[float | None, float | None]] = {}
    for i, a in enumerate(analyses):
        heads = a.get("headlines", []) if isinstance(a, dict) else None
        if not isinstance(heads, list) or not isinstance(a.get("name"), str):
            raise UsageError(f"{p}: analyses[{i}] must be a table with a string 'name' and a "
                             "list of 'headlines'")
        for j, h in enumerate(heads):
            at = f"{p}: analyses[{i}] ({a['name']!r}) headlines[{j}]"
            if not isinstance(h, dict) or not isinstance(h.get("key"), str):
                raise UsageError(f"{at} must be a table with a string 'key'")
            value, se = _num(at, "value", h.get("value")), _num(at, "se", h.get("se"))
            if se is not None and se < 0:
                raise UsageError(f"{at}: se={se!r} is not valid; a standard error is >= 0")
            if se is None:
                se = _interval_se(at, h)
            out[f"{a['name']}/{h['key']}"] = (value, se)
    return out


def _interval_se(at: str, h: dict[str, Any]) -> float | None:
    """The SE a headline's stated interval implies, ``(ci_hi - ci_lo) / (2 z)`` at its level
    (a figure with an interval and no SE, e.g. a claim's bootstrap interval); None without."""
    lo, hi, level = (_num(at, k, h.get(k)) for k in ("ci_lo", "ci_hi", "level"))
    if lo is None or hi is None:
        return None
    if level is None or not 0 < level < 1:
        raise UsageError(f"{at}: level={level!r} is not valid; an interval's level is in (0, 1)")
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        raise UsageError(f"{at}: ci_lo={lo!r}, ci_hi={hi!r} is not an interval")
    return (hi - lo) / (2 * NormalDist().inv_cdf((1 + level) / 2))


def _num(at: str, key: str, v: Any) -> float | None:
    """A JSON number as float (an integer too large for a float is +/-inf), None for null."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{at}: {key}={v!r} is not a number or null")
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


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
    ``new`` (only in NEW), ``undefined`` (counts as a regression: a value that is null or
    non-finite in one report and not the same in the other, an infinite or NaN SE, an
    allowed gap that overflows, or a change within the SE gap only because the two SEs
    differ by more than ``SE_JUMP`` = 10 times; null in both, or the same infinity in both,
    is ok). Both
    files must be ``varbench.report/1`` summaries; tolerances must be finite and >= 0.
    """
    for name, v in (("tolerance", tolerance), ("rel_tolerance", rel_tolerance),
                    ("abs_tolerance", abs_tolerance)):
        check_finite_number(name, v, minimum=0)  # an infinite tolerance would pass anything
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
            # null in both: nothing to compare; the same infinity in both: unchanged
            same = (b is None and n is None) or (b is not None and n is not None and b == n)
            row["status"] = "ok" if same else "undefined"
        elif not all(math.isfinite(x) for x in (bse, nse) if x is not None):
            row["status"] = "undefined"  # an infinite or NaN SE would excuse any change
        else:
            se = math.hypot(bse or 0.0, nse or 0.0)  # no overflow for huge SEs
            allowed = tolerance * se + rel_tolerance * abs(b) + abs_tolerance
            diff = n - b  # may overflow to +/-inf for huge values of opposite signs
            if not math.isfinite(allowed):
                row.update(diff=diff, status="undefined")
            else:
                status = "ok" if abs(diff) <= allowed else "regression"
                plain = rel_tolerance * abs(b) + abs_tolerance  # the gap without SEs
                if status == "ok" and abs(diff) > plain and _se_jump(bse, nse):
                    status = "undefined"  # passed only because one report's SE ballooned
                row.update(diff=diff, allowed=allowed, status=status)
        rows.append(row)
    return pd.DataFrame(rows, columns=["figure", "status", "base", "base_se", "new", "new_se",
                                       "diff", "allowed"])


SE_JUMP = 10.0  # SEs of one figure this far apart: the two reports do not measure alike


def _se_jump(bse: float | None, nse: float | None) -> bool:
    """Whether the two SEs differ by more than :data:`SE_JUMP` times (both given): a new SE of
    1e300 would otherwise excuse any change."""
    if bse is None or nse is None:
        return False
    lo, hi = sorted((bse, nse))
    return hi > SE_JUMP * lo


def regressions(table: pd.DataFrame) -> pd.DataFrame:
    """Rows that fail the comparison (regression, missing, undefined)."""
    return table[table["status"].isin(["regression", "missing", "undefined"])]
