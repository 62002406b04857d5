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


def test_headline_interval_round_trips_and_is_dropped_when_not_stated():
    from varbench.report.result import Headline

    h = Headline("k", 1.0, 0.1, "1 [95% CI 0.8, 1.2]", ci_lo=0.8, ci_hi=1.2)
    assert h.level == 0.95
    d = h.to_dict()
    assert (d["ci_lo"], d["ci_hi"], d["level"]) == (0.8, 1.2, 0.95)
    assert Headline.from_dict(d) == h
    for lo, hi in ((None, 1.0), (float("nan"), 1.0), (0.0, float("inf")), ("nan", 1.0)):
        bare = Headline("k", 1.0, None, "1", ci_lo=lo, ci_hi=hi, level=0.9)
        assert (bare.ci_lo, bare.ci_hi, bare.level) == (None, None, None)
        assert "ci_lo" not in bare.to_dict() and "level" not in bare.to_dict()
