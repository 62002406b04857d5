"""varbench.report.writer: directory layout, summary schema, self-contained HTML, atomic
rewrites."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from varbench.report import SCHEMA, provenance, write_report
from varbench.report.headline import ratio_sentence
from varbench.report.result import AnalysisResult, Headline


def _variance_result():
    rows = []
    for scheme in ("centered", "otb"):
        for G in (2, 4, 8):
            v = (1.0 if scheme == "centered" else 0.4) / G
            rows.append({"scheme": scheme, "G": G, "mode": "seq-mean-token-sum",
                         "variance": v, "variance_se": v / 10,
                         "variance_x_tokens": v * 3 * G, "variance_x_tokens_se": v / 5})
    h = Headline("otb_vs_centered_G4", 0.4, 0.03,
                 ratio_sentence("otb at G=4", "centered at G=4", "variance", 0.4, 0.03))
    return AnalysisResult(
        kind="variance", name="variance", records={"cells": pd.DataFrame(rows)},
        summary={"reference": "exact"}, headlines=[h],
        config={"G": [2, 4, 8]},
        provenance=provenance(config={"G": [2, 4, 8]}, seeds={"sample": 0}, wall_time_s=1.5),
        notes=["Sampling is shared across schemes."],
    )


def _proxy_result():
    rng = np.random.default_rng(0)
    n = 60
    tok = pd.DataFrame({"state": ["random"] * 30 + ["warm"] * 30, "seq": np.arange(n) // 5,
                        "pos": np.arange(n) % 5, "w_t": rng.uniform(0.1, 1.9, n),
                        "token_sq": rng.lognormal(size=n)})
    cor = pd.DataFrame({"state": ["random", "random", "warm", "warm"],
                        "quantity": ["W vs prefix"] * 4, "scope": ["position"] * 4,
                        "position": [0, 1, 0, 1], "method": ["spearman"] * 4,
                        "estimate": [0.1, 0.2, 0.5, 0.6], "ci_low": [0, 0.1, 0.4, 0.5],
                        "ci_high": [0.2, 0.3, 0.6, 0.7]})
    cal = pd.DataFrame({"state": ["warm"] * 3, "bin": [0, 1, 2], "proxy_mean": [0.2, 0.8, 1.5],
                        "true_mean": [1.0, 2.0, 4.0], "true_se": [0.1, 0.2, 0.3], "n": [5, 5, 5]})
    return AnalysisResult(kind="proxy", name="proxy tiny",
                          records={"tokens": tok, "correlations": cor, "calibration": cal},
                          provenance=provenance(config={}, seeds=0))


def test_report_layout_and_summary(tmp_path):
    out = write_report([_variance_result(), _proxy_result()], tmp_path / "rep")
    for f in ("summary.json", "report.md", "report.html"):
        assert (out / f).is_file()
    assert (out / "tables" / "variance__cells.csv").is_file()
    figs = sorted(p.name for p in (out / "figures").iterdir())
    assert "variance__variance_vs_G.png" in figs and "proxy_tiny__proxy_scatter.png" in figs
    assert all((out / "figures" / f).read_bytes()[:4] == b"\x89PNG" for f in figs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == SCHEMA
    head = summary["analyses"][0]["headlines"][0]
    assert head["value"] == 0.4 and head["se"] == 0.03
    assert head["text"] == "otb at G=4 has 0.4x the variance of centered at G=4 (SE 0.03)."
    prov = summary["analyses"][0]["provenance"]
    for key in ("varbench_version", "git_commit", "torch_version", "transformers_version",
                "device", "seeds", "config", "wall_time_s"):
        assert key in prov
    assert prov["wall_time_s"] == 1.5
    back = pd.read_csv(out / "tables" / "variance__cells.csv")
    pd.testing.assert_frame_equal(back, _variance_result().records["cells"], check_dtype=False)


def test_html_is_self_contained(tmp_path):
    out = write_report([_variance_result()], tmp_path)
    text = (out / "report.html").read_text()
    assert text.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=['\"](https?:|//|figures/)", text)
    md = (out / "report.md").read_text()
    assert "otb at G=4 has 0.4x the variance" in md and "figures/variance__variance_vs_G.png" in md


def test_nan_becomes_null_and_rewrite_is_atomic(tmp_path):
    res = _variance_result()
    res.headlines.append(Headline("x", float("nan"), None, "undefined"))
    write_report([res], tmp_path)
    write_report([res], tmp_path)  # rewriting an existing report replaces files in place
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["analyses"][0]["headlines"][1]["value"] is None
    assert not list(tmp_path.rglob("*.tmp*"))


def test_empty_results_rejected(tmp_path):
    with pytest.raises(ValueError, match="results"):
        write_report([], tmp_path)


def test_report_md_escapes_html_and_markdown_from_data(tmp_path):
    """Names, headlines, notes and cells come from case files: report.md shows them as text,
    never as HTML or Markdown markup, and a line break never starts a block (issue 32)."""
    from dataclasses import replace

    res = _variance_result()
    evil = "<script>alert(1)</script> **bold** [link](http://x) | pipe"
    res = replace(res, name="v<b>", headlines=[Headline("k", 1.0, 0.1, evil + "\n# heading")],
                  notes=["<img src=x onerror=alert(1)>", "`code` ~strike~"],
                  records={**res.records, "extra": pd.DataFrame({"col<i>": [evil]})})
    md = (write_report([res], tmp_path / "r", title="t <u>") / "report.md").read_text()
    for raw in ("<script>", "<img", "<b>", "<i>", "<u>", "**bold**", "[link](", "\n# heading",
                "`code`", "~strike~"):
        assert raw not in md, raw
    for shown in ("&lt;script&gt;", "&lt;img src=x onerror=alert(1)&gt;", r"\*\*bold\*\*",
                  r"\[link\](http://x)", r"\| pipe", r"\`code\`", "# t &lt;u&gt;"):
        assert shown in md, shown
