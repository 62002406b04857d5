"""varbench.report.headline: headline sentences generated from numbers."""

from __future__ import annotations

from varbench.report.headline import correlation_sentence, fmt, ratio_sentence, with_se


def test_with_se_formats():
    assert with_se(0.123456, 0.0123) == "0.123 (SE 0.012)"
    assert with_se(float("nan"), None) == "n/a"


def test_fmt_and_missing_values():
    assert fmt(0.123456) == "0.123" and fmt(1234.5) == "1.23e+03" and fmt(2) == "2"
    assert fmt(0.123456, 2) == "0.12"
    for missing in (None, float("nan"), float("inf"), -float("inf")):
        assert fmt(missing) == "n/a"
    assert with_se(0.5, float("nan")) == "0.5" and with_se(0.5, None) == "0.5"


def test_sentences():
    assert ratio_sentence("otb at G=4", "centered at G=4", "variance", 0.4213, 0.0312) == (
        "otb at G=4 has 0.421x the variance of centered at G=4 (SE 0.031).")
    assert ratio_sentence("a", "b", "MSE", 2.0, None) == "a has 2x the MSE of b (SE n/a)."
    assert correlation_sentence("At random init", "Spearman(w_t, token_sq)", 0.1234, 0.05,
                                0.2, 64) == (
        "At random init: Spearman(w_t, token_sq) = 0.123 [95% CI 0.05, 0.2] over 64 sequences.")
