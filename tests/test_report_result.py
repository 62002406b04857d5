"""varbench.report.result: the Headline and AnalysisResult records every analysis returns."""

from __future__ import annotations

import pandas as pd

from varbench.report.result import AnalysisResult, Headline


def test_headline_to_dict():
    h = Headline("ratio", 0.4, 0.03, "otb has 0.4x the variance.", unit="x")
    assert h.to_dict() == {"key": "ratio", "value": 0.4, "se": 0.03, "unit": "x",
                           "text": "otb has 0.4x the variance."}
    assert Headline("k", 1.0, None, "t").to_dict()["unit"] == ""


def test_analysis_result_defaults_are_not_shared():
    a = AnalysisResult("variance", "a", {"cells": pd.DataFrame({"x": [1]})})
    b = AnalysisResult("variance", "b", {})
    a.notes.append("n")
    a.headlines.append(Headline("k", 1.0, None, "t"))
    a.summary["s"] = 1
    a.config["c"] = 1
    a.provenance["p"] = 1
    assert (b.notes, b.headlines, b.summary, b.config, b.provenance) == ([], [], {}, {}, {})
