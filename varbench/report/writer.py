"""Render analysis results into a report directory.

Layout written by ``write_report(results, out_dir)``::

    out_dir/summary.json   schema-versioned: every headline figure with its SE, provenance
    out_dir/tables/*.csv   every record frame (and *.parquet when pyarrow is importable)
    out_dir/figures/*.png  matplotlib figures drawn from the records
    out_dir/report.md      headlines, notes, tables (first rows), figures, provenance
    out_dir/report.html    the same, self-contained: figures base64-embedded, no external assets

The report reads records only; nothing here computes a statistic.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from varbench._util.checks import UsageError
from varbench._util.io import atomic_write, jsonable
from varbench.report.figures import FIGURES

SCHEMA = "varbench.report/1"
_MAX_TABLE_ROWS = 40


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "analysis"


def _parquet_ok() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


_MD_SPECIAL = re.compile(r"([\\`*\[\]|!~])")


def _md(text: Any) -> str:
    """Data as literal Markdown text: HTML escaped (``<``, ``>``, ``&``), Markdown's inline
    markup backslash-escaped, line breaks as spaces (a name or note from a case file can
    neither inject HTML into a viewer nor start a block)."""
    out = html.escape(" ".join(str(text).splitlines()), quote=False)
    return _MD_SPECIAL.sub(r"\\\1", out)


def _md_table(df: pd.DataFrame) -> str:
    df = df.head(_MAX_TABLE_ROWS)
    cols = [_md(c) for c in df.columns]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if math.isfinite(v) else ""
        return _md(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def write_report(
    results: Sequence[Any], out_dir: str | Path, *, title: str = "varbench report"
) -> Path:
    """Write tables, figures, report.md, report.html and summary.json for ``results``.

    ``results``: AnalysisResult objects (kind, name, records, summary, headlines, config,
    provenance, notes). Returns the output directory. Existing files of the same name are
    replaced atomically.
    """
    if not results:
        raise UsageError("results is empty; pass at least one AnalysisResult")
    out = Path(out_dir)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    parquet = _parquet_ok()
    sections: list[dict[str, Any]] = []
    for res in results:
        prefix = _slug(res.name) + "__"
        tables = []
        for tname, df in res.records.items():
            fname = f"{prefix}{_slug(tname)}.csv"
            atomic_write(out / "tables" / fname, df.to_csv(index=False))
            if parquet:
                df.to_parquet(out / "tables" / fname.replace(".csv", ".parquet"), index=False)
            tables.append((tname, fname, df))
        draw = FIGURES.get(res.kind)
        figs = draw(res, out / "figures", prefix) if draw is not None else []
        sections.append({"res": res, "tables": tables, "figures": figs})

    summary = {
        "schema": SCHEMA,
        "title": title,
        "analyses": [
            {
                "kind": s["res"].kind,
                "name": s["res"].name,
                "headlines": [h.to_dict() for h in s["res"].headlines],
                "summary": s["res"].summary,
                "notes": list(s["res"].notes),
                "tables": [f"tables/{f}" for _, f, _ in s["tables"]],
                "figures": [f"figures/{f}" for f, _ in s["figures"]],
                "provenance": s["res"].provenance,
            }
            for s in sections
        ],
    }
    atomic_write(out / "summary.json", json.dumps(jsonable(summary), indent=2) + "\n")
    atomic_write(out / "report.md", _markdown(title, sections))
    atomic_write(out / "report.html", _html(title, sections, out))
    return out


def _provenance_lines(prov: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(k, v) for k, v in prov.items() if k != "config"]
    rows.append(("config", json.dumps(jsonable(prov.get("config", {})), sort_keys=True)))
    return [(k, str(v)) for k, v in rows]


def _markdown(title: str, sections: list[dict[str, Any]]) -> str:
    md = [f"# {_md(title)}", ""]
    for s in sections:
        res = s["res"]
        md += [f"## {_md(res.name)} ({_md(res.kind)})", "", "### Headlines", ""]
        md += [f"- {_md(h.text)}" for h in res.headlines] or ["- (no headline figures)"]
        if res.notes:
            md += ["", "### Notes", ""] + [f"- {_md(n)}" for n in res.notes]
        if s["figures"]:
            md += ["", "### Figures", ""]
            for fname, cap in s["figures"]:
                md += [f"![{_md(cap)}](figures/{fname})", "", f"*{_md(cap)}*", ""]
        md += ["", "### Tables", ""]
        for tname, fname, df in s["tables"]:
            big = len(df) > _MAX_TABLE_ROWS
            more = f" (first {_MAX_TABLE_ROWS} of {len(df)} rows)" if big else ""
            md += [f"**{_md(tname)}**{more}: [tables/{fname}](tables/{fname})", ""]
            if tname != "tokens":
                md += [_md_table(df), ""]
        md += ["### Provenance", "", "| field | value |", "|---|---|"]
        md += [f"| {_md(k)} | {_md(v)} |" for k, v in _provenance_lines(res.provenance)]
        md += [""]
    return "\n".join(md) + "\n"


_CSS = (
    "body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em;color:#222}"
    "table{border-collapse:collapse;font-size:12px;margin:.5em 0}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    "img{max-width:100%}figcaption{font-style:italic;font-size:13px}"
    "code{font-size:11px;word-break:break-all}"
)


def _html(title: str, sections: list[dict[str, Any]], out: Path) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
    ]
    for s in sections:
        res = s["res"]
        parts.append(f"<h2>{esc(res.name)} ({esc(res.kind)})</h2><h3>Headlines</h3><ul>")
        parts += [f"<li>{esc(h.text)}</li>" for h in res.headlines]
        parts.append("</ul>")
        if res.notes:
            parts.append("<h3>Notes</h3><ul>")
            parts += [f"<li>{esc(n)}</li>" for n in res.notes]
            parts.append("</ul>")
        for fname, cap in s["figures"]:
            data = base64.b64encode((out / "figures" / fname).read_bytes()).decode("ascii")
            parts.append(
                f"<figure><img alt='{esc(cap)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{esc(cap)}</figcaption></figure>"
            )
        parts.append("<h3>Tables</h3>")
        for tname, fname, df in s["tables"]:
            parts.append(
                f"<h4>{esc(tname)} <small>({len(df)} rows; tables/{esc(fname)})</small></h4>"
            )
            if tname != "tokens":
                parts.append(df.head(_MAX_TABLE_ROWS).to_html(index=False, float_format="%.4g",
                                                             na_rep=""))
        parts.append("<h3>Provenance</h3><table>")
        parts += [
            f"<tr><th>{esc(k)}</th><td style='text-align:left'><code>{esc(v)}</code></td></tr>"
            for k, v in _provenance_lines(res.provenance)
        ]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
