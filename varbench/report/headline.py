"""Headline sentences generated from numbers (never written by hand)."""

from __future__ import annotations

import math


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits; 'n/a' for None/NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}g}"


def with_se(value: float | None, se: float | None, digits: int = 3) -> str:
    """'0.42 (SE 0.03)'; the SE is omitted when unknown."""
    if se is None or (isinstance(se, float) and not math.isfinite(se)):
        return fmt(value, digits)
    return f"{fmt(value, digits)} (SE {fmt(se, 2)})"


DEGENERATE_CI = "degenerate interval"
"""What a flagged interval says after its bounds (see :func:`interval_text`)."""


def ci_label(level: float = 0.95) -> str:
    """'95% CI' for ``level`` 0.95 (the interval's stated coverage, as a percentage)."""
    return f"{100 * level:.4g}% CI"


def has_interval(lo: float | None, hi: float | None) -> bool:
    """Whether ``lo``/``hi`` are both given and finite numbers (an interval is stated)."""
    try:
        return all(x is not None and not isinstance(x, (bool, str)) and math.isfinite(float(x))
                   for x in (lo, hi))
    except (TypeError, ValueError):
        return False


def interval_text(value: float | None, lo: float | None, hi: float | None,
                  digits: int = 3, *, exact: bool = False, degenerate: bool = False,
                  level: float = 0.95) -> str:
    """'0.42 [95% CI 0.38, 0.47]' (``level`` sets the percentage); '0.42 (exact)' for an exact
    value; the interval is omitted when unknown; ``degenerate`` (a Monte Carlo interval of
    zero width or from too few distinct replicates: no measure of uncertainty) is said inside
    the brackets."""
    if exact:
        return f"{fmt(value, digits)} (exact)"
    if not has_interval(lo, hi):
        return fmt(value, digits)
    flag = f"; {DEGENERATE_CI}" if degenerate else ""
    return (f"{fmt(value, digits)} [{ci_label(level)} {fmt(lo, digits)}, {fmt(hi, digits)}"
            f"{flag}]")


def ratio_sentence(a: str, b: str, what: str, ratio: float, se: float | None,
                   lo: float | None = None, hi: float | None = None, *,
                   exact: bool = False, degenerate: bool = False, level: float = 0.95) -> str:
    """'otb at G=4 has 0.42x the variance of centered at G=4 (SE 0.03).'; with an interval
    ``lo, hi``: '... has 0.42 [95% CI 0.38, 0.47]x the variance ...'; exact: '0.42 (exact)x';
    ``degenerate``: see :func:`interval_text`."""
    if exact or has_interval(lo, hi):
        text = interval_text(ratio, lo, hi, exact=exact, degenerate=degenerate, level=level)
        return f"{a} has {text}x the {what} of {b}."
    return f"{a} has {fmt(ratio)}x the {what} of {b} (SE {fmt(se, 2)})."


def correlation_sentence(
    label: str, method: str, estimate: float, lo: float, hi: float, n_seq: int,
    level: float = 0.95,
) -> str:
    """'At random init, Spearman(w_t, token_sq) = 0.12 [95% CI 0.05, 0.20] over 64 sequences.'"""
    return (
        f"{label}: {method} = {fmt(estimate)} [{ci_label(level)} {fmt(lo)}, {fmt(hi)}] "
        f"over {n_seq} sequences."
    )
